"""The Python wrappers exercised the way code written against FlashInfer uses them: argument names, positional
order and defaults of FlashInfer's API, its plan/run contract, the shapes of its own public tests (batch sizes,
page sizes around the page boundary, GQA groups, head dims 64/128/256, NHD/HND, 5-D cache or (k, v) tuple) and the
call sequences of serving engines (plan once per step, run every layer; append then decode; re-plan per batch).

Every output is compared with the float64 reference in reference.py (written from the math: base-2 LSE,
bottom-right causal mask, little bit order for packed masks). CPU backend, NumPy arrays; torch is not needed.

Differences from FlashInfer that are intentional are pinned by tests named test_documented_difference_*."""

import math
import warnings

import numpy as np
import pytest

import kvattn
from conftest import workspace
from reference import LN2, TOL, alibi_slopes, assert_close, attention, gather_kv, make_paged, merge

try:
    import ml_dtypes
    BF16 = ml_dtypes.bfloat16
except ImportError:  # NumPy has no bfloat16 without ml_dtypes
    BF16 = None


def _dtype_name(dtype):
    return "bfloat16" if BF16 is not None and np.dtype(dtype) == np.dtype(BF16) else np.dtype(dtype).name


def _tol(dtype):
    return TOL[_dtype_name(dtype)]


def _cast(x, dtype):
    return x.astype(dtype)


def _kv_lens_around(page_size, batch, long_len=300):
    """FlashInfer-test style lengths: 1, page_size - 1, page_size, page_size + 1, a few hundred, cycled to batch."""
    base = [1, page_size - 1, page_size, page_size + 1, long_len, 2 * page_size + 3, long_len - 37]
    base = [n for n in base if n >= 1]
    return [base[i % len(base)] for i in range(batch)]


def _pool(rng, kv_lens, page_size, hkv, d, dtype, layout, form):
    """(paged_kv_cache as the run takes it, k pool, v pool, indptr, indices, last_page_len)."""
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, page_size, hkv, d, np.float32, layout)
    cache = _cast(cache, dtype)
    k_pool, v_pool = cache[:, 0], cache[:, 1]
    if form == "tuple":
        k_pool, v_pool = np.ascontiguousarray(k_pool), np.ascontiguousarray(v_pool)
        paged = (k_pool, v_pool)
    else:
        paged = cache
    return paged, k_pool, v_pool, indptr, indices, last


def _check_rows(o, lse, q, k_pool, v_pool, indptr, indices, kv_lens, layout, dtype, case, qo_indptr=None,
                masks=None, **ref_kw):
    """o / lse of every request against the reference (decode: one row per request)."""
    atol, rtol = _tol(dtype)
    for b, n in enumerate(kv_lens):
        k, v = gather_kv(k_pool, v_pool, indptr, indices, b, n, layout)
        rs = slice(b, b + 1) if qo_indptr is None else slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        if rs.stop == rs.start:
            continue
        kw = dict(ref_kw)
        if masks is not None:
            kw["mask"] = masks[b]
            kw.pop("causal", None)
        ro, rl = attention(np.asarray(q[rs], np.float64), k, v, **kw)
        assert_close(o[rs], ro, atol, rtol, "%s: o of request %d (kv_len %d)" % (case, b, n))
        if lse is not None:
            assert_close(lse[rs], rl, atol, rtol, "%s: lse of request %d (kv_len %d)" % (case, b, n))


# ------------------------------------------------------------------------------------------------------------------
# Batch decode

@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["5d", "tuple"])
def test_batch_decode_pages_layouts_forms(rng, page_size, layout, form):
    i = [1, 5, 16, 64].index(page_size) + 4 * (layout == "HND") + 8 * (form == "tuple")
    batch = (1, 7, 33)[i % 3]
    hkv, group, d = [(1, 8, 64), (2, 3, 128), (8, 1, 64), (2, 6, 256)][i % 4]
    kv_lens = _kv_lens_around(page_size, batch)
    case = "B=%d ps=%d %s %s hkv=%d g=%d d=%d lens=%s" % (batch, page_size, layout, form, hkv, group, d, kv_lens)
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, page_size, hkv, d, np.float16, layout, form)
    q = rng.standard_normal((batch, hkv * group, d)).astype(np.float16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), layout)
    w.plan(indptr, indices, last, hkv * group, hkv, d, page_size)  # q_data_type defaults to float16
    o, lse = w.run(q, paged, return_lse=True)
    assert o.dtype == np.float16 and o.shape == q.shape and lse.dtype == np.float32 and lse.shape == q.shape[:2]
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, layout, np.float16, case)


@pytest.mark.parametrize("hkv", [1, 2, 8])
@pytest.mark.parametrize("group", [1, 3, 6, 8, 16])
def test_batch_decode_gqa_groups_head_dims(rng, hkv, group):
    d = (64, 128, 256)[(hkv + group) % 3]
    layout = "HND" if group % 2 else "NHD"
    kv_lens = [1, 15, 16, 17, 211, 3, 64]
    case = "hkv=%d g=%d d=%d %s" % (hkv, group, d, layout)
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, 16, hkv, d, np.float32, layout, "5d")
    q = rng.standard_normal((len(kv_lens), hkv * group, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout=layout, use_tensor_cores=group >= 4)
    w.plan(indptr, indices, last, hkv * group, hkv, d, 16, q_data_type="float32")
    o, lse = w.run_return_lse(q, paged)
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, layout, np.float32, case)


DECODE_FEATURES = [
    dict(pos_encoding_mode="ROPE_LLAMA"),
    dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=4.0, rope_theta=5e5),
    dict(pos_encoding_mode="ALIBI"),
    dict(logits_soft_cap=30.0),
    dict(logits_soft_cap=2.0, sm_scale=0.5),
    dict(window_left=0),
    dict(window_left=20),
    dict(window_left=20, logits_soft_cap=8.0),
    dict(sm_scale=0.01),
    dict(pos_encoding_mode="ALIBI", logits_soft_cap=5.0),
]


def _ref_kw(feature):
    kw = {k: feature[k] for k in ("logits_soft_cap", "window_left", "sm_scale", "rope_scale", "rope_theta", "causal")
          if k in feature}
    if "pos_encoding_mode" in feature:
        kw["pos_encoding"] = feature["pos_encoding_mode"]
    return kw


@pytest.mark.parametrize("feature", DECODE_FEATURES, ids=lambda f: ",".join("%s=%s" % kv for kv in f.items()))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_batch_decode_features(rng, feature, dtype):
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("bfloat16 NumPy arrays need ml_dtypes")
    dt = np.float16 if dtype == "float16" else BF16
    kv_lens, ps, hkv, g, d = [1, 4, 5, 6, 77, 300, 21], 5, 2, 4, 128
    case = "decode %s %s" % (dtype, feature)
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, dt, "NHD", "5d")
    q = (rng.standard_normal((len(kv_lens), hkv * g, d)) * 2).astype(dt)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps, q_data_type=dtype, kv_data_type=dtype, **feature)
    o, lse = w.run(q, paged, return_lse=True)
    assert o.dtype == np.dtype(dt)
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, "NHD", dt, case, **_ref_kw(feature))


def test_batch_decode_out_buffers_layers_and_replan(rng):
    """An engine's step: plan once, run every layer (a different cache each) into preallocated out / lse, then the
    next step re-plans with another batch."""
    ps, hkv, g, d = 16, 2, 4, 64
    ws = workspace()
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    for step, kv_lens in enumerate(([7, 16, 17, 300, 1, 33, 48], [2, 95, 17])):
        layers = [_pool(rng, kv_lens, ps, hkv, d, np.float16, "NHD", "5d" if i % 2 else "tuple") for i in range(3)]
        _, _, _, indptr, indices, last = layers[0]
        w.plan(indptr, indices, last, hkv * g, hkv, d, ps, q_data_type="float16", kv_data_type="float16")
        B = len(kv_lens)
        out = np.full((B, hkv * g, d), np.nan, np.float16)
        lse = np.full((B, hkv * g), np.nan, np.float32)
        for layer, (paged, kp, vp, _, _, _) in enumerate(layers):
            # every layer's pool uses the same page table (make_paged draws its own; take layer 0's)
            q = rng.standard_normal((B, hkv * g, d)).astype(np.float16)
            res = w.run(q, paged, out=out, lse=lse, return_lse=True)
            assert res[0] is out and res[1] is lse
            _check_rows(out, lse, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float16,
                        "step %d layer %d" % (step, layer))
            o2 = w.run(q, paged, out=out)  # out= without lse
            assert o2 is out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_batch_decode_plan_positional_flashinfer_order(rng):
    """FlashInfer's decode plan() takes the optional arguments after page_size positionally too (deprecated, with a
    warning), in its historical order: pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type,
    o_data_type, data_type, sm_scale, rope_scale, rope_theta, non_blocking, ..."""
    kv_lens, ps, hkv, g, d = [3, 40, 17], 4, 2, 2, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    q = rng.standard_normal((3, hkv * g, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", False, False)
    with pytest.warns(DeprecationWarning):
        w.plan(indptr, indices, last, hkv * g, hkv, d, ps, "NONE", 9, 6.0, "float32", "float32", None, None, 0.2)
    o, lse = w.run(q, paged, return_lse=True)
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float32, "positional plan",
                window_left=9, logits_soft_cap=6.0, sm_scale=0.2)
    with pytest.raises(TypeError):  # a value given both positionally and by keyword
        w.plan(indptr, indices, last, hkv * g, hkv, d, ps, "NONE", 3, pos_encoding_mode="NONE")
    with pytest.raises(TypeError):  # more positional values than the legacy list has
        w.plan(indptr, indices, last, hkv * g, hkv, d, ps, *([None] * 17))
    with pytest.raises(TypeError):  # an unknown keyword
        w.plan(indptr, indices, last, hkv * g, hkv, d, ps, "NONE", windowleft=3)
    # keyword calls do not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.plan(indptr, indices, last, hkv * g, hkv, d, ps, q_data_type="float32", sm_scale=0.2)


def test_batch_decode_reads_indices_at_run_time(rng):
    """FlashInfer keeps (a device copy of) the indices array given to plan() and reads it at run time: a caller that
    rewrites the array's contents between plan and run (same page counts) gets attention over the new pages."""
    kv_lens, ps, hkv, g, d = [9, 30, 16], 8, 2, 3, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    P = paged.shape[0]
    idx = indices.copy()
    q = rng.standard_normal((3, hkv * g, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, idx, last, hkv * g, hkv, d, ps, q_data_type="float32", num_pages=P)
    idx[:] = rng.permutation(P)[:idx.size]  # the engine refills its page-table buffer in place
    o, lse = w.run(q, paged, return_lse=True)
    _check_rows(o, lse, q, kp, vp, indptr, idx, kv_lens, "NHD", np.float32, "indices rewritten after plan")


def test_batch_decode_run_checks_against_plan(rng):
    kv_lens, ps, hkv, g, d = [9, 30], 8, 2, 3, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, "NHD", "5d")
    q = rng.standard_normal((2, hkv * g, d)).astype(np.float16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps, window_left=4)
    with pytest.raises(ValueError):  # q of another dtype than planned (FlashInfer: ValueError)
        w.run(q.astype(np.float32), paged)
    with pytest.raises(ValueError):  # KV of another dtype than planned
        w.run(q, paged.astype(np.float32))
    with pytest.raises(ValueError):  # a run-time window_left that differs from the plan's
        w.run(q, paged, window_left=5)
    o = w.run(q, paged, window_left=4)  # the planned one is accepted
    _check_rows(o, None, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float16, "window run", window_left=4)


def test_batch_decode_deprecated_aliases(rng):
    kv_lens, ps, hkv, g, d = [5, 12, 1], 4, 1, 8, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, "HND", "tuple")
    q = rng.standard_normal((3, hkv * g, d)).astype(np.float16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout="HND", use_tensor_cores=True)
    assert w.use_tensor_cores
    w.begin_forward(indptr, indices, last, hkv * g, hkv, d, ps, data_type="float16")
    o = w.forward(q, paged)
    o2, lse2 = w.forward_return_lse(q, paged)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(o, w.run(q, paged))
    w.end_forward()
    _check_rows(o2, lse2, q, kp, vp, indptr, indices, kv_lens, "HND", np.float16, "begin_forward/forward")


# ------------------------------------------------------------------------------------------------------------------
# Paged and ragged prefill

PREFILL_QO = [0, 3, 1, 17, 0, 40]
PREFILL_KV = [5, 3, 16, 33, 7, 40]


def _qo_indptr(qo_lens):
    return np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)


def _random_masks(rng, qo_lens, kv_lens):
    masks = []
    for qo, kv in zip(qo_lens, kv_lens):
        m = rng.random((qo, kv)) < 0.6
        if qo and kv:
            m[:, 0] |= ~m.any(axis=1)  # not required, keeps most rows non-empty
            m[qo // 2] = False  # one fully masked row: o = 0, lse = -inf
        masks.append(m)
    return masks


def _pack_little(masks):
    """FlashInfer's packed_custom_mask: each request's row-major mask packed little-endian into its own byte-aligned
    segment (written here with NumPy directly, not through kvattn.segment_packbits)."""
    segs = [np.packbits(m.reshape(-1).astype(np.uint8), bitorder="little") for m in masks]
    return np.concatenate(segs).astype(np.uint8)


@pytest.mark.parametrize("mask_kind", ["causal", "none", "custom", "packed"])
@pytest.mark.parametrize("layout,form,ps", [("NHD", "5d", 16), ("HND", "tuple", 5), ("NHD", "tuple", 1)])
def test_batch_prefill_paged(rng, mask_kind, layout, form, ps):
    hkv, g, d = 2, 4, 128
    qo_lens, kv_lens = PREFILL_QO, PREFILL_KV
    case = "paged prefill %s %s %s ps=%d" % (mask_kind, layout, form, ps)
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, layout, form)
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * g, d)).astype(np.float16)
    masks = _random_masks(rng, qo_lens, kv_lens) if mask_kind in ("custom", "packed") else None
    kw = {}
    if mask_kind == "custom":
        kw["custom_mask"] = np.concatenate([m.reshape(-1) for m in masks])  # flattened bool, FlashInfer's form
    elif mask_kind == "packed":
        kw["packed_custom_mask"] = _pack_little(masks)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), layout)
    w.plan(qo_indptr, indptr, indices, last, hkv * g, hkv, d, ps, causal=(mask_kind != "none"), **kw)
    o, lse = w.run(q, paged, return_lse=True)
    assert o.shape == q.shape and o.dtype == np.float16
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, layout, np.float16, case, qo_indptr=qo_indptr,
                masks=masks, causal=(mask_kind == "causal"))


def test_batch_prefill_paged_positional_flashinfer_order(rng):
    """plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
    head_dim_qk, page_size, head_dim_vo, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
    use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type, ...)."""
    qo_lens, kv_lens, ps, hkv, g, d = [4, 1, 9], [4, 20, 30], 8, 2, 2, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * g, d)).astype(np.float32)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(qo_indptr, indptr, indices, last, hkv * g, hkv, d, ps, None, None, None, True, "ROPE_LLAMA", False,
           0.3, 6, 7.0, 2.0, 1e5, "float32")
    o, lse = w.run(q, paged, return_lse=True)
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float32, "positional paged plan",
                qo_indptr=qo_indptr, causal=True, pos_encoding="ROPE_LLAMA", sm_scale=0.3, window_left=6,
                logits_soft_cap=7.0, rope_scale=2.0, rope_theta=1e5)


@pytest.mark.parametrize("feature", [dict(pos_encoding_mode="ALIBI", causal=True), dict(window_left=5, causal=True),
                                     dict(logits_soft_cap=4.0), dict(pos_encoding_mode="ROPE_LLAMA", causal=True)],
                         ids=lambda f: ",".join("%s=%s" % kv for kv in f.items()))
def test_batch_prefill_paged_features(rng, feature):
    hkv, g, d, ps = 1, 6, 64, 16
    qo_lens, kv_lens = [5, 0, 1, 12], [5, 2, 60, 31]
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, "NHD", "5d")
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * g, d)).astype(np.float16)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(qo_indptr, indptr, indices, last, hkv * g, hkv, d, ps, q_data_type="float16", **feature)
    o, lse = w.run(q, paged, return_lse=True)
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float16, "paged %s" % feature,
                qo_indptr=qo_indptr, **_ref_kw(feature))


@pytest.mark.parametrize("mask_kind", ["causal", "none", "custom", "packed"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_batch_prefill_ragged(rng, mask_kind, layout):
    hkv, g, d = 2, 3, 64
    qo_lens, kv_lens = PREFILL_QO, PREFILL_KV
    case = "ragged prefill %s %s" % (mask_kind, layout)
    qo_indptr, kv_indptr = _qo_indptr(qo_lens), _qo_indptr(kv_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * g, d)).astype(np.float16)
    k = rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(np.float16)
    v = rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(np.float16)
    masks = _random_masks(rng, qo_lens, kv_lens) if mask_kind in ("custom", "packed") else None
    kw = {}
    if mask_kind == "custom":
        kw["custom_mask"] = np.concatenate([m.reshape(-1) for m in masks])
    elif mask_kind == "packed":
        kw["packed_custom_mask"] = _pack_little(masks)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace(), layout)
    w.plan(qo_indptr, kv_indptr, hkv * g, hkv, d, causal=(mask_kind == "causal"), **kw)
    kr, vr = (k, v) if layout == "NHD" else (np.ascontiguousarray(k.transpose(1, 0, 2)),
                                             np.ascontiguousarray(v.transpose(1, 0, 2)))
    o, lse = w.run(q, kr, vr, return_lse=True)
    atol, rtol = _tol(np.float16)
    for b in range(len(qo_lens)):
        rs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        if rs.stop == rs.start:
            continue
        ro, rl = attention(q[rs], k[ks], v[ks], causal=(mask_kind == "causal"),
                           mask=None if masks is None else masks[b])
        assert_close(o[rs], ro, atol, rtol, "%s: o of request %d" % (case, b))
        assert_close(lse[rs], rl, atol, rtol, "%s: lse of request %d" % (case, b))


def test_batch_prefill_ragged_positional_and_head_dim_vo(rng):
    """plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, custom_mask,
    packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
    ...), with the 192/128 head dims of the ragged DeepSeek prefill."""
    qo_lens, kv_lens, hkv, g = [3, 8], [10, 8], 2, 2
    qo_indptr, kv_indptr = _qo_indptr(qo_lens), _qo_indptr(kv_lens)
    q = rng.standard_normal((11, hkv * g, 192)).astype(np.float32)
    k = rng.standard_normal((18, hkv, 192)).astype(np.float32)
    v = rng.standard_normal((18, hkv, 128)).astype(np.float32)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    sm = 1.0 / math.sqrt(128 + 64)
    w.plan(qo_indptr, kv_indptr, hkv * g, hkv, 192, 128, None, None, True, "NONE", False, -1, None, sm, None, None,
           "float32")
    o, lse = w.run_return_lse(q, k, v)
    assert o.shape == (11, hkv * g, 128)
    for b in range(2):
        rs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        ro, rl = attention(q[rs], k[ks], v[ks], causal=True, sm_scale=sm)
        assert_close(o[rs], ro, *_tol(np.float32), what="ragged 192/128 o[%d]" % b)
        assert_close(lse[rs], rl, *_tol(np.float32), what="ragged 192/128 lse[%d]" % b)


def test_batch_prefill_q_dtype_mismatch_and_aliases(rng):
    kv_lens, qo_lens, ps, hkv, g, d = [6, 9], [2, 9], 4, 2, 2, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, "NHD", "5d")
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((11, hkv * g, d)).astype(np.float16)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.begin_forward(qo_indptr, indptr, indices, last, hkv * g, hkv, d, ps, causal=True)
    with pytest.raises(ValueError):
        w.run(q.astype(np.float32), paged)
    o = w.forward(q, paged)  # the deprecated forward with the planned parameters
    np.testing.assert_array_equal(o, w.run(q, paged))
    _check_rows(o, None, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float16, "prefill forward",
                qo_indptr=qo_indptr, causal=True)


def test_documented_difference_causal_qo_longer_than_kv(rng):
    """FlashInfer rejects (single prefill) or does not define causal attention with qo_len > kv_len. kvattn accepts
    it: with the bottom-right alignment, query row i sees keys j <= kv_len - qo_len + i, so the first
    qo_len - kv_len rows see no key and get o = 0, lse = -inf; the other rows are ordinary."""
    qo_lens, kv_lens, ps, hkv, g, d = [7, 2], [3, 2], 4, 1, 2, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((9, hkv * g, d)).astype(np.float32)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(qo_indptr, indptr, indices, last, hkv * g, hkv, d, ps, causal=True, q_data_type="float32")
    o, lse = w.run(q, paged, return_lse=True)
    assert np.all(o[:4] == 0) and np.all(np.isneginf(lse[:4]))
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float32, "causal qo > kv",
                qo_indptr=qo_indptr, causal=True)
    k0 = np.ascontiguousarray(kp[indices[0]])[:3].astype(np.float32)
    v0 = np.ascontiguousarray(vp[indices[0]])[:3].astype(np.float32)
    os_, ls_ = kvattn.single_prefill_with_kv_cache(q[:7], k0, v0, causal=True, return_lse=True)
    assert np.all(os_[:4] == 0) and np.all(np.isneginf(ls_[:4]))
    assert_close(os_, o[:7], 1e-6, 1e-6, "single vs batch")


def test_documented_difference_alibi_lse_offset(rng):
    """ALiBi: kvattn's bias is slope * (j - q_pos) with q_pos = kv_len - qo_len + i (the key at the query's own
    position gets no bias). FlashInfer's kernels add slope * (j - i) with the unshifted row index i (decode: i = 0),
    which shifts every logit of a row by the same slope * (kv_len - qo_len). The outputs are the same; FlashInfer's
    base-2 LSE is kvattn's plus slope * (kv_len - qo_len) / ln 2. This test pins the relation."""
    kv_lens, ps, hkv, g, d = [1, 9, 40], 8, 2, 4, 64
    hq = hkv * g
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    q = rng.standard_normal((3, hq, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hq, hkv, d, ps, pos_encoding_mode="ALIBI", q_data_type="float32")
    o, lse = w.run(q, paged, return_lse=True)
    slopes = alibi_slopes(hq)
    for b, n in enumerate(kv_lens):
        k, v = gather_kv(kp, vp, indptr, indices, b, n)
        # FlashInfer's convention written out: logits sm_scale * q.k + slope * j (decode row index 0)
        x = np.einsum("hd,khd->hk", q[b].astype(np.float64), np.repeat(k, g, axis=1)) / math.sqrt(d)
        x = x + slopes[:, None] * np.arange(n)[None, :]
        m = x.max(-1, keepdims=True)
        p = np.exp(x - m)
        fi_o = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), np.repeat(v, g, axis=1))
        fi_lse = (m[:, 0] + np.log(p.sum(-1))) / LN2
        assert_close(o[b], fi_o, 2e-4, 2e-4, "ALiBi o vs FlashInfer's convention, request %d" % b)
        assert_close(lse[b] + slopes * (n - 1) / LN2, fi_lse, 2e-4, 2e-4, "ALiBi lse offset, request %d" % b)


# ------------------------------------------------------------------------------------------------------------------
# Single-request functions

@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("hkv,g,d,kv_len", [(1, 8, 128, 1), (2, 3, 64, 255), (8, 1, 256, 33), (4, 16, 64, 129)])
def test_single_decode_flashinfer_call(rng, layout, hkv, g, d, kv_len):
    case = "single decode %s hkv=%d g=%d d=%d kv=%d" % (layout, hkv, g, d, kv_len)
    q = rng.standard_normal((hkv * g, d)).astype(np.float16)
    k = rng.standard_normal((kv_len, hkv, d)).astype(np.float16)
    v = rng.standard_normal((kv_len, hkv, d)).astype(np.float16)
    kk, vv = (k, v) if layout == "NHD" else (np.ascontiguousarray(k.transpose(1, 0, 2)),
                                             np.ascontiguousarray(v.transpose(1, 0, 2)))
    o = kvattn.single_decode_with_kv_cache(q, kk, vv, layout)  # kv_layout is the 4th positional argument
    o2, lse = kvattn.single_decode_with_kv_cache(q, kk, vv, kv_layout=layout, pos_encoding_mode="NONE",
                                                 use_tensor_cores=True, return_lse=True)
    assert o.shape == (hkv * g, d) and lse.shape == (hkv * g,) and o.dtype == np.float16
    np.testing.assert_array_equal(o, o2)
    ro, rl = attention(q[None], k, v)  # default sm_scale 1/sqrt(head_dim)
    assert_close(o, ro[0], *_tol(np.float16), what=case + " o")
    assert_close(lse, rl[0], *_tol(np.float16), what=case + " lse")
    o3 = kvattn.single_decode_with_kv_cache(q, kk, vv, layout, "ROPE_LLAMA", False, None, None, None, 16, 20.0, 0.1)
    ro3, _ = attention(q[None], k, v, pos_encoding="ROPE_LLAMA", window_left=16, logits_soft_cap=20.0, sm_scale=0.1)
    assert_close(o3, ro3[0], *_tol(np.float16), what=case + " positional features")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("qo_len,kv_len,causal", [(1, 1, True), (17, 17, True), (9, 64, True), (33, 20, False),
                                                  (16, 300, False)])
def test_single_prefill_flashinfer_call(rng, layout, qo_len, kv_len, causal):
    hkv, g, d = 2, 4, 128
    case = "single prefill %s qo=%d kv=%d causal=%s" % (layout, qo_len, kv_len, causal)
    q = rng.standard_normal((qo_len, hkv * g, d)).astype(np.float16)
    k = rng.standard_normal((kv_len, hkv, d)).astype(np.float16)
    v = rng.standard_normal((kv_len, hkv, d)).astype(np.float16)
    kk, vv = (k, v) if layout == "NHD" else (np.ascontiguousarray(k.transpose(1, 0, 2)),
                                             np.ascontiguousarray(v.transpose(1, 0, 2)))
    o, lse = kvattn.single_prefill_with_kv_cache(q, kk, vv, causal=causal, kv_layout=layout, return_lse=True)
    ro, rl = attention(q, k, v, causal=causal)
    assert_close(o, ro, *_tol(np.float16), what=case + " o")
    assert_close(lse, rl, *_tol(np.float16), what=case + " lse")
    o2, lse2 = kvattn.single_prefill_with_kv_cache_return_lse(q, kk, vv, causal=causal, kv_layout=layout)
    np.testing.assert_array_equal(o, o2)
    # custom_mask [qo_len, kv_len] and its little-endian packbits give the same result; the mask wins over causal
    m = rng.random((qo_len, kv_len)) < 0.5
    om = kvattn.single_prefill_with_kv_cache(q, kk, vv, custom_mask=m, causal=True, kv_layout=layout)
    op = kvattn.single_prefill_with_kv_cache(q, kk, vv, packed_custom_mask=np.packbits(m.reshape(-1), bitorder="little"),
                                             kv_layout=layout)
    np.testing.assert_array_equal(om, op)
    rm, _ = attention(q, k, v, mask=m)
    assert_close(om, rm, *_tol(np.float16), what=case + " custom mask")


# ------------------------------------------------------------------------------------------------------------------
# Attention states

def test_merge_state_base2_and_minus_inf(rng):
    n, h, d = 6, 4, 64
    va = rng.standard_normal((n, h, d)).astype(np.float16)
    vb = rng.standard_normal((n, h, d)).astype(np.float16)
    sa = (rng.standard_normal((n, h)) * 5).astype(np.float32)
    sb = (rng.standard_normal((n, h)) * 5).astype(np.float32)
    sa[0] = -np.inf  # a empty: the merge is b
    sb[1] = -np.inf  # b empty: the merge is a
    sa[2] = sb[2] = -np.inf  # both empty: v = 0, s = -inf, no NaN
    sb[3] = sa[3] + 1.0  # base 2: b weighs exactly twice as much as a
    v, s = kvattn.merge_state(va, sa, vb, sb)
    assert v.dtype == np.float16 and s.dtype == np.float32
    rv, rs = merge(va, sa, vb, sb)
    assert_close(v, rv, *_tol(np.float16), what="merge_state v")
    assert_close(s, rs, 1e-5, 1e-5, what="merge_state s")
    assert np.all(v[2] == 0) and np.all(np.isneginf(s[2]))
    assert_close(s[3], sa[3] + math.log2(3.0), 1e-5, 1e-5, what="log2(2^a + 2^(a+1))")
    assert_close(s[:2], np.where(np.isneginf(sa[:2]), sb[:2], sa[:2]), 0, 0, what="one side empty")

    # in place, with FlashInfer's optional row mask
    v_ip, s_ip = va.copy(), sa.copy()
    mask = np.array([True, False, True, True, False, True])
    kvattn.merge_state_in_place(v_ip, s_ip, vb, sb, mask=mask)
    assert_close(v_ip[mask], rv[mask], *_tol(np.float16), what="merge_state_in_place v")
    assert_close(s_ip[mask], rs[mask], 1e-5, 1e-5, what="merge_state_in_place s")
    np.testing.assert_array_equal(v_ip[~mask], va[~mask])
    np.testing.assert_array_equal(s_ip[~mask], sa[~mask])

    # merge_states over [n, num_states, h, d] with empty states anywhere
    vs = rng.standard_normal((n, 3, h, d)).astype(np.float32)
    ss = (rng.standard_normal((n, 3, h)) * 3).astype(np.float32)
    ss[0, :] = -np.inf
    ss[1, 1] = -np.inf
    vm, sm = kvattn.merge_states(vs, ss)
    rv, rs = vs[:, 0], ss[:, 0]
    for i in (1, 2):
        rv, rs = merge(rv, rs, vs[:, i], ss[:, i])
    assert_close(vm, rv, 1e-5, 1e-5, what="merge_states v")
    assert_close(sm, rs, 1e-5, 1e-5, what="merge_states s")
    assert np.all(vm[0] == 0) and np.all(np.isneginf(sm[0]))


def test_merge_of_two_kv_halves_equals_full_attention(rng):
    """The cascade pattern: attention over a shared prefix and over the unique suffix, merged with the base-2 LSEs
    the kernels return, equals attention over the concatenation."""
    qo, kv1, kv2, hkv, g, d = 5, 40, 13, 2, 4, 64
    q = rng.standard_normal((qo, hkv * g, d)).astype(np.float32)
    k = rng.standard_normal((kv1 + kv2, hkv, d)).astype(np.float32)
    v = rng.standard_normal((kv1 + kv2, hkv, d)).astype(np.float32)
    o1, s1 = kvattn.single_prefill_with_kv_cache(q, k[:kv1], v[:kv1], return_lse=True)
    o2, s2 = kvattn.single_prefill_with_kv_cache(q, k[kv1:], v[kv1:], causal=True, return_lse=True)
    om, sm = kvattn.merge_state(o1, s1, o2, s2)
    ro, rl = attention(q, k, v, causal=True)
    assert_close(om, ro, 1e-4, 1e-4, what="merged o")
    assert_close(sm, rl, 1e-4, 1e-4, what="merged lse")


# ------------------------------------------------------------------------------------------------------------------
# Append then decode

@pytest.mark.parametrize("layout,form,ps", [("NHD", "5d", 16), ("HND", "tuple", 5), ("NHD", "tuple", 1),
                                            ("HND", "5d", 64)])
def test_append_paged_kv_cache_then_decode(rng, layout, form, ps):
    """FlashInfer's append flow: the page table already covers the new tokens; get_seq_lens gives each request's
    length after the append, get_batch_indices_positions each new token's request and absolute position; then the
    decode over the cache sees old and new tokens."""
    hkv, g, d = 2, 3, 64
    old_lens = [0, 5, ps, 37, 3]
    append_lens = [3, 1, 1, ps + 2, 0]
    new_lens = [a + b for a, b in zip(old_lens, append_lens)]
    case = "append %s %s ps=%d" % (layout, form, ps)
    B = len(old_lens)
    pages = [(n + ps - 1) // ps for n in new_lens]
    P = sum(pages) + 4
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = rng.permutation(P)[: kv_indptr[-1]].astype(np.int32)
    kv_last_page_len = np.array([(n - 1) % ps + 1 if n else 0 for n in new_lens], np.int32)
    shape = (P, ps, hkv, d) if layout == "NHD" else (P, hkv, ps, d)
    k_pool = rng.standard_normal(shape).astype(np.float16)
    v_pool = rng.standard_normal(shape).astype(np.float16)
    # the reference's view of each request's old tokens (what the pool holds before the append)
    old_k = [gather_kv(k_pool, v_pool, kv_indptr, kv_indices, b, old_lens[b], layout)[0] for b in range(B)]
    old_v = [gather_kv(k_pool, v_pool, kv_indptr, kv_indices, b, old_lens[b], layout)[1] for b in range(B)]
    append_indptr = _qo_indptr(append_lens)
    nnz = int(append_indptr[-1])
    ak = rng.standard_normal((nnz, hkv, d)).astype(np.float16)
    av = rng.standard_normal((nnz, hkv, d)).astype(np.float16)
    seq_lens = kvattn.get_seq_lens(kv_indptr, kv_last_page_len, ps)
    np.testing.assert_array_equal(seq_lens, new_lens)
    batch_indices, positions = kvattn.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    exp_b = np.repeat(np.arange(B), append_lens)
    exp_p = np.concatenate([np.arange(o, n) for o, n in zip(old_lens, new_lens)])
    np.testing.assert_array_equal(batch_indices, exp_b)
    np.testing.assert_array_equal(positions, exp_p)
    if form == "5d":
        paged = np.stack([k_pool, v_pool], axis=1)
        k_view, v_view = paged[:, 0], paged[:, 1]
    else:
        paged = (k_pool, v_pool)
        k_view, v_view = k_pool, v_pool
    kvattn.append_paged_kv_cache(ak, av, batch_indices, positions, paged, kv_indices, kv_indptr, kv_last_page_len,
                                 kv_layout=layout)
    # every appended token is in place, and the old ones are untouched
    for b in range(B):
        k, v = gather_kv(k_view, v_view, kv_indptr, kv_indices, b, new_lens[b], layout)
        sl = slice(append_indptr[b], append_indptr[b + 1])
        np.testing.assert_array_equal(k[:old_lens[b]], old_k[b], err_msg=case)
        np.testing.assert_array_equal(k[old_lens[b]:], ak[sl].astype(np.float64), err_msg=case)
        np.testing.assert_array_equal(v[old_lens[b]:], av[sl].astype(np.float64), err_msg=case)
    # decode over the appended cache (requests with kv_len 0 dropped from the decode batch: FlashInfer's decode
    # needs last_page_len >= 1)
    live = [b for b in range(B) if new_lens[b] > 0]
    d_indptr = np.concatenate([[0], np.cumsum([pages[b] for b in live])]).astype(np.int32)
    d_indices = np.concatenate([kv_indices[kv_indptr[b]:kv_indptr[b + 1]] for b in live]).astype(np.int32)
    d_last = kv_last_page_len[live]
    q = rng.standard_normal((len(live), hkv * g, d)).astype(np.float16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), layout)
    w.plan(d_indptr, d_indices, d_last, hkv * g, hkv, d, ps)
    o, lse = w.run(q, paged, return_lse=True)
    _check_rows(o, lse, q, k_view, v_view, d_indptr, d_indices, [new_lens[b] for b in live], layout, np.float16,
                case + " decode")


# ------------------------------------------------------------------------------------------------------------------
# Data types, outputs and per-call arguments

def test_decode_data_type_alias_and_fp8_kv_scales(rng):
    """vLLM's call: plan(..., q_data_type=<model dtype>, kv_data_type or data_type=<cache dtype>). An explicit
    q_data_type wins over data_type (a float16 query over an fp8 cache); run(k_scale=, v_scale=) scales the logits
    and the values."""
    if BF16 is None:
        pytest.skip("fp8 / bfloat16 NumPy arrays need ml_dtypes")
    e4m3 = ml_dtypes.float8_e4m3fn
    kv_lens, ps, hkv, g, d = [3, 17, 40], 16, 2, 4, 64
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, ps, hkv, d)
    cache8 = (cache * 0.5).astype(e4m3)
    q = rng.standard_normal((3, hkv * g, d)).astype(np.float16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps, q_data_type="float16", data_type="float8_e4m3fn")
    o, lse = w.run(q, cache8, k_scale=1.5, v_scale=3.0, return_lse=True)
    assert o.dtype == np.float16
    kp = cache8[:, 0].astype(np.float64) * 1.5
    vp = cache8[:, 1].astype(np.float64) * 3.0
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float16, "fp8 kv, q_data_type + data_type")
    # the same plan with kv_data_type= instead of the deprecated alias
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps, q_data_type=np.float16, kv_data_type=e4m3)
    np.testing.assert_array_equal(w.run(q, cache8, k_scale=1.5, v_scale=3.0), o)


def test_documented_difference_data_type_alone_sets_q_dtype(rng):
    """FlashInfer's current default q_data_type is "float16", and data_type only fills a q_data_type left None: so
    plan(..., data_type="bfloat16") alone plans a float16 query there (a bfloat16 q then fails its dtype check).
    kvattn lets data_type set q's dtype when q_data_type is left at its default (the older FlashInfer behaviour, when
    its default was None), so such calls plan bfloat16 q and kv."""
    if BF16 is None:
        pytest.skip("bfloat16 NumPy arrays need ml_dtypes")
    kv_lens, ps, hkv, g, d = [5, 33], 16, 1, 4, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, BF16, "NHD", "5d")
    q = rng.standard_normal((2, hkv * g, d)).astype(BF16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps, data_type="bfloat16")
    o, lse = w.run(q, paged, return_lse=True)
    assert o.dtype == np.dtype(BF16)
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, "NHD", BF16, "data_type alone")


def test_o_data_type_and_lse_buffer_without_return_lse(rng):
    """o_data_type differs from q's (float32 output of a float16 run); an lse= buffer is written even when
    return_lse is False (only out is returned), as FlashInfer's run does."""
    kv_lens, qo_lens, ps, hkv, g, d = [9, 40], [3, 5], 8, 2, 2, 128
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, "HND", "5d")
    qd = rng.standard_normal((2, hkv * g, d)).astype(np.float16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), "HND")
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps, q_data_type="float16", o_data_type="float32")
    lse = np.full((2, hkv * g), np.nan, np.float32)
    o = w.run(qd, paged, lse=lse)
    assert isinstance(o, np.ndarray) and o.dtype == np.float32
    _check_rows(o, lse, qd, kp, vp, indptr, indices, kv_lens, "HND", np.float16, "decode o_data_type f32")

    qo_indptr = _qo_indptr(qo_lens)
    qp = rng.standard_normal((8, hkv * g, d)).astype(np.float16)
    wp = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), "HND")
    wp.plan(qo_indptr, indptr, indices, last, hkv * g, hkv, d, ps, causal=True, o_data_type=np.float32)
    out = np.empty((8, hkv * g, d), np.float32)
    res = wp.run(qp, paged, out=out)
    assert res is out
    _check_rows(out, None, qp, kp, vp, indptr, indices, kv_lens, "HND", np.float16, "prefill o_data_type f32",
                qo_indptr=qo_indptr, causal=True)


def test_documented_difference_q_rows_must_match_plan(rng):
    """FlashInfer's run does not check q's row count against the plan (extra rows are left unwritten in a
    torch.empty output). kvattn's run checks q (and out / lse) against the plan outside CUDA-graph mode: a q with
    more rows than qo_indptr[-1] (or than the decode batch) raises PlanMismatchError (a ValueError); slice q to the
    planned rows (CUDA-graph wrappers accept padded buffers: the plan's rows are the leading ones)."""
    kv_lens, ps, hkv, g, d = [9, 40], 8, 2, 2, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, "NHD", "5d")
    q = rng.standard_normal((3, hkv * g, d)).astype(np.float16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps)
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q, paged)
    o = w.run(q[:2], paged)
    _check_rows(o, None, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float16, "sliced q")
    wp = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    wp.plan(np.array([0, 1, 2], np.int32), indptr, indices, last, hkv * g, hkv, d, ps)
    with pytest.raises(kvattn.PlanMismatchError):
        wp.run(q, paged)


def test_documented_difference_forward_defaults_to_the_plan(rng):
    """FlashInfer's deprecated forward() has concrete defaults (causal=False, pos_encoding_mode="NONE",
    window_left=-1, sm_scale=None, ...) that overwrite what plan() was given, so forward(q, kv) after
    plan(causal=True) runs non-causal there. kvattn's forward() takes None for "as planned": forward(q, kv) runs the
    plan as made; a value passed explicitly applies to that call (re-planning when it differs)."""
    qo_lens, kv_lens, ps, hkv, g, d = [4, 6], [4, 9], 4, 2, 2, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((10, hkv * g, d)).astype(np.float32)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(qo_indptr, indptr, indices, last, hkv * g, hkv, d, ps, causal=True, q_data_type="float32")
    o_plan = w.forward(q, paged)
    _check_rows(o_plan, None, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float32, "forward as planned",
                qo_indptr=qo_indptr, causal=True)
    o_nc = w.forward(q, paged, causal=False)
    _check_rows(o_nc, None, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float32, "forward causal=False",
                qo_indptr=qo_indptr, causal=False)


def test_get_batch_indices_positions_into_buffers():
    """FlashInfer's optional output buffers (engines preallocate them at the maximum token count)."""
    append_indptr = np.array([0, 2, 2, 7], np.int32)
    seq_lens = np.array([10, 4, 5], np.int32)
    bi = np.full(16, -1, np.int32)
    pos = np.full(16, -1, np.int32)
    rb, rp = kvattn.get_batch_indices_positions(append_indptr, seq_lens, 7, batch_indices=bi, positions=pos)
    np.testing.assert_array_equal(bi[:7], [0, 0, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(pos[:7], [8, 9, 0, 1, 2, 3, 4])
    assert np.all(bi[7:] == -1) and np.all(pos[7:] == -1)


# ------------------------------------------------------------------------------------------------------------------
# Edge cases from FlashInfer's issue history

def test_strided_q_and_kv_from_fused_qkv(rng):
    """q (and ragged k / v) as views of one fused qkv projection [tokens, Hq + 2 Hkv, D]: strided rows, contiguous
    head dim (FlashInfer accepts strided q everywhere and strided ragged k / v)."""
    qo_lens, hkv, g, d = [5, 0, 12], 2, 3, 64
    hq = hkv * g
    qo_indptr = _qo_indptr(qo_lens)
    n = int(qo_indptr[-1])
    qkv = rng.standard_normal((n, hq + 2 * hkv, d)).astype(np.float16)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    assert not q.flags["C_CONTIGUOUS"]
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    w.plan(qo_indptr, qo_indptr, hq, hkv, d, causal=True)
    o, lse = w.run(q, k, v, return_lse=True)
    for b in range(len(qo_lens)):
        rs = slice(qo_indptr[b], qo_indptr[b + 1])
        if rs.stop == rs.start:
            continue
        ro, rl = attention(q[rs], k[rs], v[rs], causal=True)
        assert_close(o[rs], ro, *_tol(np.float16), what="fused qkv o[%d]" % b)
        assert_close(lse[rs], rl, *_tol(np.float16), what="fused qkv lse[%d]" % b)
    # decode: one token per request, q taken from the fused buffer
    kv_lens, ps = [7, 30, 16], 16
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, "NHD", "5d")
    qd = qkv[:3, :hq]
    wd = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    wd.plan(indptr, indices, last, hq, hkv, d, ps)
    od, ld = wd.run(qd, paged, return_lse=True)
    _check_rows(od, ld, qd, kp, vp, indptr, indices, kv_lens, "NHD", np.float16, "fused qkv decode")


@pytest.mark.parametrize("feature", [dict(window_left=3), dict(window_left=3, causal=True),
                                     dict(pos_encoding_mode="ALIBI"), dict(logits_soft_cap=3.0, window_left=0)],
                         ids=lambda f: ",".join("%s=%s" % kv for kv in f.items()))
def test_custom_mask_combined_with_features(rng, feature):
    """A custom mask with a sliding window / ALiBi / soft cap: the mask restricts what the window leaves (FlashInfer's
    default variant applies the custom mask and the window together), and replaces causal."""
    qo_lens, kv_lens, hkv, g, d = [4, 9, 0, 2], [10, 9, 3, 2], 1, 4, 64
    qo_indptr, kv_indptr = _qo_indptr(qo_lens), _qo_indptr(kv_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * g, d)).astype(np.float32)
    k = rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(np.float32)
    v = rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(np.float32)
    masks = _random_masks(rng, qo_lens, kv_lens)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    w.plan(qo_indptr, kv_indptr, hkv * g, hkv, d, packed_custom_mask=_pack_little(masks), q_data_type="float32",
           **feature)
    o, lse = w.run(q, k, v, return_lse=True)
    kw = _ref_kw(feature)
    kw.pop("causal", None)
    for b in range(len(qo_lens)):
        rs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        if rs.stop == rs.start:
            continue
        ro, rl = attention(q[rs], k[ks], v[ks], mask=masks[b], **kw)
        assert_close(o[rs], ro, *_tol(np.float32), what="mask + %s o[%d]" % (feature, b))
        assert_close(lse[rs], rl, *_tol(np.float32), what="mask + %s lse[%d]" % (feature, b))


def test_prefill_empty_requests_everywhere_and_kv_len_zero(rng):
    """qo_indptr with empty requests first, in the middle and last; a ragged request with queries but no keys
    (non-causal) gets o = 0, lse = -inf."""
    qo_lens, kv_lens, hkv, g, d = [0, 2, 0, 3, 4, 0], [4, 5, 0, 0, 6, 0], 2, 2, 64
    qo_indptr, kv_indptr = _qo_indptr(qo_lens), _qo_indptr(kv_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * g, d)).astype(np.float32)
    k = rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(np.float32)
    v = rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(np.float32)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    w.plan(qo_indptr, kv_indptr, hkv * g, hkv, d, q_data_type="float32")
    o, lse = w.run(q, k, v, return_lse=True)
    for b in range(len(qo_lens)):
        rs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        if rs.stop == rs.start:
            continue
        ro, rl = attention(q[rs], k[ks], v[ks])
        assert_close(o[rs], ro, *_tol(np.float32), what="empty-mix o[%d]" % b)
        assert_close(lse[rs], rl, *_tol(np.float32), what="empty-mix lse[%d]" % b)
    assert np.all(o[2:5] == 0) and np.all(np.isneginf(lse[2:5]))
    # the paged form: requests without pages (equal indptr entries) in a prefill batch
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, 4, hkv, d, np.float32, "NHD", "5d")
    wp = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    wp.plan(qo_indptr, indptr, indices, last, hkv * g, hkv, d, 4, q_data_type="float32")
    op, lp = wp.run(q, paged, return_lse=True)
    _check_rows(op, lp, q, kp, vp, indptr, indices, kv_lens, "NHD", np.float32, "paged empty-mix",
                qo_indptr=qo_indptr)


def test_extreme_logits(rng):
    """Logits of magnitude ~1e4 (all of one row very negative, others mixed): no finite mask sentinel may leak in
    (FlashInfer's old -5e4 sentinel gave wrong results here)."""
    kv_lens, ps, hkv, g, d = [20, 33], 8, 1, 2, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    q = rng.standard_normal((2, hkv * g, d)).astype(np.float32) * 300
    # request 0: every key points against the query of head 0, so all its logits are about -1e4 or below
    pg = indices[indptr[0]:indptr[1]]
    kpos = np.abs(rng.standard_normal((len(pg), ps, 1, d))).astype(np.float32)
    paged[pg, 0] = -np.sign(q[0, 0])[None, None, None, :] * kpos * 10
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps, q_data_type="float32", sm_scale=1.0)
    o, lse = w.run(q, paged, return_lse=True)
    assert lse[0, 0] < -1e4
    _check_rows(o, lse, q, paged[:, 0], paged[:, 1], indptr, indices, kv_lens, "NHD", np.float32, "extreme logits",
                sm_scale=1.0)


def test_paged_prefill_reads_indices_at_run_time_and_replans_across_pools(rng):
    """The paged prefill wrapper reads the plan's indices array at run time too; a later step's plan over a smaller
    pool (another model's cache, a resized pool) runs correctly on it."""
    qo_lens, kv_lens, ps, hkv, g, d = [3, 1, 8], [3, 20, 64], 16, 2, 2, 64
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((12, hkv * g, d)).astype(np.float32)
    idx = indices.copy()
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(qo_indptr, indptr, idx, last, hkv * g, hkv, d, ps, causal=True, q_data_type="float32")
    idx[:] = idx[::-1]  # same pages, other order, rewritten after plan
    o = w.run(q, paged)
    _check_rows(o, None, q, kp, vp, indptr, idx, kv_lens, "NHD", np.float32, "prefill indices after plan",
                qo_indptr=qo_indptr, causal=True)
    # next step: a smaller pool with its own page table
    small_lens = [2, 5]
    paged2, kp2, vp2, indptr2, indices2, last2 = _pool(rng, small_lens, ps, hkv, d, np.float32, "NHD", "tuple")
    assert paged2[0].shape[0] < paged.shape[0]
    qo2 = _qo_indptr([2, 5])
    q2 = rng.standard_normal((7, hkv * g, d)).astype(np.float32)
    w.plan(qo2, indptr2, indices2, last2, hkv * g, hkv, d, ps, causal=True, q_data_type="float32")
    o2, l2 = w.run(q2, paged2, return_lse=True)
    _check_rows(o2, l2, q2, kp2, vp2, indptr2, indices2, small_lens, "NHD", np.float32, "smaller pool",
                qo_indptr=qo2, causal=True)


@pytest.mark.parametrize("split", [dict(), dict(fixed_split_size=3), dict(disable_split_kv=True)],
                         ids=["auto", "fixed3", "nosplit"])
def test_long_sequences_split_kv(rng, split):
    """Long KV (the scheduler splits it into chunks whose partial states are merged) for decode and paged prefill,
    with FlashInfer's fixed_split_size (pages) / disable_split_kv."""
    ps, hkv, g, d = 64, 2, 8, 128
    kv_lens = [900, 1, 63, 64, 65, 700]
    paged, kp, vp, indptr, indices, last = _pool(rng, kv_lens, ps, hkv, d, np.float16, "HND", "5d")
    q = rng.standard_normal((len(kv_lens), hkv * g, d)).astype(np.float16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(64 << 20), "HND", use_tensor_cores=True)
    w.plan(indptr, indices, last, hkv * g, hkv, d, ps, **split)
    o, lse = w.run(q, paged, return_lse=True)
    _check_rows(o, lse, q, kp, vp, indptr, indices, kv_lens, "HND", np.float16, "long decode %s" % split)
    qo_lens = [130, 1, 0, 64, 2, 9]
    qo_indptr = _qo_indptr(qo_lens)
    qp = rng.standard_normal((int(qo_indptr[-1]), hkv * g, d)).astype(np.float16)
    wp = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace(64 << 20), "HND")
    wp.plan(qo_indptr, indptr, indices, last, hkv * g, hkv, d, ps, causal=True, window_left=500, **split)
    op, lp = wp.run(qp, paged, return_lse=True)
    _check_rows(op, lp, qp, kp, vp, indptr, indices, kv_lens, "HND", np.float16, "long prefill %s" % split,
                qo_indptr=qo_indptr, causal=True, window_left=500)
