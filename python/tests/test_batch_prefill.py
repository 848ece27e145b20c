"""BatchPrefillWithPagedKVCacheWrapper / BatchPrefillWithRaggedKVCacheWrapper on the CPU backend (NumPy)
against the float64 reference."""

import numpy as np
import pytest

import kvattn
from conftest import workspace
from reference import TOL, assert_close, attention, gather_kv, make_paged

QO_LENS = [1, 7, 0, 16, 3]
KV_LENS = [5, 7, 9, 40, 3]


def _qo_indptr(qo_lens):
    return np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)


def _ref_kw(feature):
    kw = {}
    for a in ("causal", "logits_soft_cap", "window_left", "sm_scale", "rope_scale", "rope_theta"):
        if a in feature:
            kw[a] = feature[a]
    if "pos_encoding_mode" in feature:
        kw["pos_encoding"] = feature["pos_encoding_mode"]
    return kw


def _paged(rng, qo_lens, kv_lens, ps, hq, hkv, d, layout="NHD", dtype=np.float32, mask=None, **feature):
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, ps, hkv, d, dtype, layout)
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(dtype)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout=layout)
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, custom_mask=mask, q_data_type=np.dtype(dtype).name,
           **feature)
    o, lse = w.run(q, cache, return_lse=True)
    atol, rtol = TOL[np.dtype(dtype).name]
    moff = 0
    for b, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, kv, layout)
        rs = slice(qo_indptr[b], qo_indptr[b + 1])
        m = None
        if mask is not None:
            m = mask[moff:moff + qo * kv].reshape(qo, kv)
            moff += qo * kv
        kw = _ref_kw(feature)
        if m is not None:
            kw.pop("causal", None)  # a custom mask takes precedence over causal
        ro, rl = attention(q[rs], k, v, mask=m, **kw)
        assert_close(o[rs], ro, atol, rtol, "o[req %d]" % b)
        assert_close(lse[rs], rl, atol, rtol, "lse[req %d]" % b)
    return w, o


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_prefill_gqa_pages_layouts(rng, group, page_size, layout):
    _paged(rng, QO_LENS, KV_LENS, page_size, 2 * group, 2, 32, layout, causal=True)


@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_prefill_block_tables(rng, page_size):
    """plan(block_tables=, seq_lens=): the block-table form of the page table gives the CSR form's result bit for bit
    (causal, and a custom mask); padding entries outside the pool are never read; seq_lens alone is refused."""
    hq, hkv, d = 8, 2, 32
    cache, indptr, indices, last, P = make_paged(rng, KV_LENS, page_size, hkv, d)
    qo_indptr = _qo_indptr(QO_LENS)
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(np.float32)
    pages = np.diff(indptr)
    bt = np.full((len(KV_LENS), int(pages.max()) + 3), P + 5, np.int32)
    for b in range(len(KV_LENS)):
        bt[b, :pages[b]] = indices[indptr[b]:indptr[b + 1]]
    bits = sum(a * b for a, b in zip(QO_LENS, KV_LENS))
    mask = rng.random(bits) < 0.7
    for kw in (dict(causal=True), dict(custom_mask=mask)):
        w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, q_data_type="float32", **kw)
        ref = w.run(q, cache, return_lse=True)
        wb = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
        wb.plan(qo_indptr, None, None, None, hq, hkv, d, page_size, q_data_type="float32", block_tables=bt,
                seq_lens=KV_LENS, num_pages=P, **kw)
        got = wb.run(q, cache, return_lse=True)
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])
    with pytest.raises(NotImplementedError, match="seq_lens"):
        wb.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, q_data_type="float32", seq_lens=KV_LENS)


@pytest.mark.parametrize("feature", [
    dict(causal=False),
    dict(causal=True, window_left=4),
    dict(causal=True, logits_soft_cap=3.0),
    dict(causal=True, pos_encoding_mode="ALIBI"),
    dict(causal=True, pos_encoding_mode="ROPE_LLAMA"),
    dict(causal=False, pos_encoding_mode="ROPE_LLAMA", rope_scale=4.0, rope_theta=1e6),
    dict(causal=True, sm_scale=0.11),
])
def test_paged_prefill_features(rng, feature):
    _paged(rng, QO_LENS, KV_LENS, 4, 8, 2, 32, **feature)


def test_paged_prefill_float16(rng):
    _paged(rng, QO_LENS, KV_LENS, 16, 8, 2, 64, dtype=np.float16, causal=True)


def test_paged_prefill_custom_mask(rng):
    bits = sum(q * k for q, k in zip(QO_LENS, KV_LENS))
    mask = rng.random(bits) < 0.6
    # the mask takes precedence over causal (FlashInfer semantics)
    _paged(rng, QO_LENS, KV_LENS, 4, 4, 2, 16, mask=mask, causal=True)


def test_paged_prefill_packed_custom_mask_matches_segment_packbits(rng):
    qo_lens, kv_lens = [3, 2], [5, 9]
    bits = sum(q * k for q, k in zip(qo_lens, kv_lens))
    mask = rng.random(bits) < 0.5
    bit_indptr = np.concatenate([[0], np.cumsum([q * k for q, k in zip(qo_lens, kv_lens)])])
    packed, byte_indptr = kvattn.segment_packbits(mask, bit_indptr, bitorder="little")
    assert list(byte_indptr) == [0, 2, 5]
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, 4, 2, 16)
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((5, 2, 16)).astype(np.float32)
    outs = []
    for kw in (dict(custom_mask=mask), dict(packed_custom_mask=packed)):
        w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
        w.plan(qo_indptr, indptr, indices, last, 2, 2, 16, 4, q_data_type="float32", **kw)
        outs.append(w.run(q, cache))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_paged_prefill_head_dim_vo(rng):
    """Different K and V head dims through a (K, V) tuple."""
    qo_lens, kv_lens, ps, hq, hkv, dqk, dvo = [2, 5], [6, 11], 4, 4, 2, 32, 16
    _, indptr, indices, last, P = make_paged(rng, kv_lens, ps, hkv, dqk)
    kc = rng.standard_normal((P, ps, hkv, dqk)).astype(np.float32)
    vc = rng.standard_normal((P, ps, hkv, dvo)).astype(np.float32)
    qo_indptr = _qo_indptr(qo_lens)
    q = rng.standard_normal((7, hq, dqk)).astype(np.float32)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, dqk, ps, head_dim_vo=dvo, causal=True, q_data_type="float32")
    o = w.run(q, (kc, vc))
    assert o.shape == (7, hq, dvo)
    for b, kv in enumerate(kv_lens):
        k, v = gather_kv(kc, vc, indptr, indices, b, kv)
        rs = slice(qo_indptr[b], qo_indptr[b + 1])
        ro, _ = attention(q[rs], k, v, causal=True)
        assert_close(o[rs], ro, 2e-4, 2e-4)


def _ragged(rng, qo_lens, kv_lens, hq, hkv, d, layout="NHD", dtype=np.float32, mask=None, **feature):
    qo_indptr, kv_indptr = _qo_indptr(qo_lens), _qo_indptr(kv_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(dtype)
    k = rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(dtype)
    v = rng.standard_normal((int(kv_indptr[-1]), hkv, d)).astype(dtype)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace(), kv_layout=layout)
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, custom_mask=mask, q_data_type=np.dtype(dtype).name, **feature)
    if layout == "HND":
        o, lse = w.run(q, np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2)),
                       return_lse=True)
    else:
        o, lse = w.run(q, k, v, return_lse=True)
    atol, rtol = TOL[np.dtype(dtype).name]
    moff = 0
    for b, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        rs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        m = None
        if mask is not None:
            m = mask[moff:moff + qo * kv].reshape(qo, kv)
            moff += qo * kv
        kw = _ref_kw(feature)
        if m is not None:
            kw.pop("causal", None)
        ro, rl = attention(q[rs], k[ks], v[ks], mask=m, **kw)
        assert_close(o[rs], ro, atol, rtol, "o[req %d]" % b)
        assert_close(lse[rs], rl, atol, rtol, "lse[req %d]" % b)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_prefill(rng, group, layout, causal):
    _ragged(rng, QO_LENS, KV_LENS, 2 * group, 2, 32, layout, causal=causal)


@pytest.mark.parametrize("feature", [
    dict(causal=True, window_left=3),
    dict(causal=True, logits_soft_cap=2.5),
    dict(causal=True, pos_encoding_mode="ALIBI"),
    dict(causal=True, pos_encoding_mode="ROPE_LLAMA"),
])
def test_ragged_prefill_features(rng, feature):
    _ragged(rng, QO_LENS, KV_LENS, 4, 2, 16, **feature)


def test_ragged_prefill_custom_mask_and_fp16(rng):
    bits = sum(q * k for q, k in zip(QO_LENS, KV_LENS))
    mask = rng.random(bits) < 0.4
    _ragged(rng, QO_LENS, KV_LENS, 4, 2, 16, mask=mask)
    _ragged(rng, QO_LENS, KV_LENS, 4, 2, 64, dtype=np.float16, causal=True)


def test_ragged_forward_with_per_call_causal(rng):
    """SGLang plans without causal and passes causal=True to forward(): honoured (re-plan)."""
    qo_lens, kv_lens = [3, 4], [3, 6]
    qo_indptr, kv_indptr = _qo_indptr(qo_lens), _qo_indptr(kv_lens)
    q = rng.standard_normal((7, 2, 16)).astype(np.float32)
    k = rng.standard_normal((9, 2, 16)).astype(np.float32)
    v = rng.standard_normal((9, 2, 16)).astype(np.float32)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    w.begin_forward(qo_indptr, kv_indptr, 2, 2, 16, q_data_type="float32")
    o, lse = w.forward_return_lse(q, k, v, causal=True, sm_scale=0.2)
    for b in range(2):
        rs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        ro, rl = attention(q[rs], k[ks], v[ks], causal=True, sm_scale=0.2)
        assert_close(o[rs], ro, 2e-4, 2e-4)
        assert_close(lse[rs], rl, 2e-4, 2e-4)
    # run() does not change plans: a differing value raises
    with pytest.raises(kvattn.PlanMismatchError, match="causal"):
        w.run(q, k, v, causal=False)



def test_forward_parameters_apply_per_call(rng):
    """A parameter a forward() call leaves out (None) is the one given to plan(), not the value an earlier forward()
    re-planned with: forward(logits_soft_cap=c) followed by forward() is uncapped again, forward(causal=True) then
    forward() is not causal (plan had causal=False). run() uses the plan as last (re-)made."""
    qo_lens, kv_lens = [3, 4], [5, 6]
    qo_indptr, kv_indptr = _qo_indptr(qo_lens), _qo_indptr(kv_lens)
    q = rng.standard_normal((7, 4, 16)).astype(np.float32)
    k = rng.standard_normal((11, 2, 16)).astype(np.float32)
    v = rng.standard_normal((11, 2, 16)).astype(np.float32)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    w.begin_forward(qo_indptr, kv_indptr, 4, 2, 16, q_data_type="float32", sm_scale=0.3)

    def check(o, **ref_kw):
        for b in range(2):
            rs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
            ro, _ = attention(q[rs], k[ks], v[ks], **ref_kw)
            assert_close(o[rs], ro, 2e-4, 2e-4)

    check(w.forward(q, k, v, causal=True, logits_soft_cap=3.0), causal=True, logits_soft_cap=3.0, sm_scale=0.3)
    check(w.run(q, k, v), causal=True, logits_soft_cap=3.0, sm_scale=0.3)  # run(): the plan as last made
    check(w.forward(q, k, v), sm_scale=0.3)  # back to plan()'s values
    check(w.forward(q, k, v, sm_scale=0.5, window_left=2), sm_scale=0.5, window_left=2)
    check(w.forward(q, k, v, logits_soft_cap=4.0), sm_scale=0.3, logits_soft_cap=4.0)
    check(w.forward_return_lse(q, k, v)[0], sm_scale=0.3)

def test_prefill_split_kv_long(rng):
    """A long request split across workers (the merge path), with and without a fixed split size."""
    qo_lens, kv_lens = [2, 1], [900, 300]
    for kw in ({}, dict(fixed_split_size=8), dict(disable_split_kv=True)):
        _paged(rng, qo_lens, kv_lens, 16, 4, 1, 16, causal=True, **kw)


def test_plan_scalars_readable_under_flashinfer_attribute_names(rng):
    """Engines assert on a wrapper's planned scalars after plan() (``_causal``, ``_window_left``,
    ``_logits_soft_cap``, ``_sm_scale``): they hold the values as given (the exact Python float for sm_scale, 0.0
    for a logits_soft_cap of None), follow forward()'s per-call values, and raise AttributeError before a plan."""
    kv_lens, ps, hkv, d = [5, 9], 4, 2, 64
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, ps, hkv, d)
    qo_indptr = np.array([0, 2, 5], np.int32)
    scale = 1.0 / 7.3  # not a float32 value: compared exactly
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    with pytest.raises(AttributeError):
        w._sm_scale
    w.plan(qo_indptr, indptr, indices, last, 4, hkv, d, ps, causal=True, sm_scale=scale, window_left=-1,
           logits_soft_cap=None, q_data_type="float32")
    assert w._causal is True and w._window_left == -1 and w._logits_soft_cap == 0.0 and w._sm_scale == scale
    q = rng.standard_normal((5, 4, d)).astype(np.float32)
    w.forward(q, cache, causal=False, logits_soft_cap=3.0)
    assert w._causal is False and w._logits_soft_cap == 3.0 and w._sm_scale == scale
    w.forward(q, cache)  # back to plan()'s values
    assert w._causal is True and w._logits_soft_cap == 0.0
    dw = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    dw.plan(indptr, indices, last, 4, hkv, d, ps, window_left=7, logits_soft_cap=2.5, q_data_type="float32")
    assert dw._window_left == 7 and dw._logits_soft_cap == 2.5 and dw._sm_scale is None
    rw = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    rw.plan(qo_indptr, np.array([0, 5, 14], np.int32), 4, hkv, d, causal=True, q_data_type="float32")
    assert rw._causal is True and rw._window_left == -1
    w.reset_workspace_buffer(workspace())  # drops the plan
    with pytest.raises(AttributeError):
        w._causal
