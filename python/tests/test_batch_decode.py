"""BatchDecodeWithPagedKVCacheWrapper on the CPU backend (NumPy) against the float64 reference."""

import numpy as np
import pytest

import kvattn
from conftest import workspace
from reference import TOL, assert_close, attention, gather_kv, make_paged

KV_LENS = [0, 1, 16, 17, 45, 3]


def _run_decode(rng, kv_lens, page_size, hq, hkv, d, layout="NHD", dtype=np.float32, **plan_kw):
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, page_size, hkv, d, dtype, layout)
    q = rng.standard_normal((len(kv_lens), hq, d)).astype(dtype)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout=layout)
    w.plan(indptr, indices, last, hq, hkv, d, page_size, q_data_type=np.dtype(dtype).name, **plan_kw)
    o, lse = w.run(q, cache, return_lse=True)
    return q, cache, indptr, indices, o, lse


def _check(q, cache, indptr, indices, o, lse, kv_lens, layout, dtype, **ref_kw):
    atol, rtol = TOL[np.dtype(dtype).name]
    for b, n in enumerate(kv_lens):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, n, layout)
        ro, rl = attention(q[b:b + 1], k, v, **ref_kw)
        assert_close(o[b], ro[0], atol, rtol, "o[%d]" % b)
        assert_close(lse[b], rl[0], atol, rtol, "lse[%d]" % b)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_gqa_pages_layouts(rng, group, page_size, layout):
    hkv, d = 2, 32
    res = _run_decode(rng, KV_LENS, page_size, hkv * group, hkv, d, layout)
    _check(*res, KV_LENS, layout, np.float32)


def test_decode_empty_request_gives_zero_and_minus_inf(rng):
    q, cache, indptr, indices, o, lse = _run_decode(rng, [0, 5, 0], 4, 4, 2, 16)
    assert np.all(o[0] == 0) and np.all(o[2] == 0)
    assert np.all(np.isneginf(lse[0])) and np.all(np.isneginf(lse[2]))


def test_decode_float16(rng):
    res = _run_decode(rng, KV_LENS, 16, 8, 2, 64, dtype=np.float16)
    assert res[4].dtype == np.float16
    _check(*res, KV_LENS, "NHD", np.float16)


@pytest.mark.parametrize("feature", [
    dict(pos_encoding_mode="ROPE_LLAMA"),
    dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5),
    dict(pos_encoding_mode="ALIBI"),
    dict(logits_soft_cap=5.0),
    dict(window_left=7),
    dict(sm_scale=0.3),
])
def test_decode_features(rng, feature):
    lens = [1, 9, 33, 64]
    res = _run_decode(rng, lens, 8, 8, 2, 32, **feature)
    ref_kw = {}
    if "pos_encoding_mode" in feature:
        ref_kw["pos_encoding"] = feature["pos_encoding_mode"]
    for a, b in (("rope_scale", "rope_scale"), ("rope_theta", "rope_theta"), ("logits_soft_cap", "logits_soft_cap"),
                 ("window_left", "window_left"), ("sm_scale", "sm_scale")):
        if a in feature:
            ref_kw[b] = feature[a]
    _check(*res, lens, "NHD", np.float32, **ref_kw)


def test_decode_strided_pool_and_query(rng):
    """A pool with a layer dimension inside each page and padded heads; q sliced from a wider buffer."""
    lens, ps, hq, hkv, d = [3, 20, 11], 8, 4, 2, 16
    _, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d)
    big = rng.standard_normal((P, 3, 2, ps, hkv, d + 8)).astype(np.float32)  # [P, layers, 2, ps, H, D+8]
    cache = big[:, 1, :, :, :, :d]
    assert not cache.flags["C_CONTIGUOUS"]
    qbig = rng.standard_normal((len(lens), hq, d * 2)).astype(np.float32)
    q = qbig[:, :, :d]
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
    o = w.run(q, cache)
    ok, ov = np.ascontiguousarray(cache[:, 0]), np.ascontiguousarray(cache[:, 1])
    for b, n in enumerate(lens):
        k, v = gather_kv(ok, ov, indptr, indices, b, n)
        ro, _ = attention(q[b:b + 1], k, v)
        assert_close(o[b], ro[0], 2e-4, 2e-4, "o[%d]" % b)


def test_decode_kv_tuple_and_out_buffers(rng):
    lens, ps, hq, hkv, d = [4, 30], 16, 4, 4, 16
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d)
    k_cache, v_cache = np.ascontiguousarray(cache[:, 0]), np.ascontiguousarray(cache[:, 1])
    q = rng.standard_normal((2, hq, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=np.float32)
    out = np.full((2, hq, d), np.nan, np.float32)
    lse = np.full((2, hq), np.nan, np.float32)
    r = w.run(q, (k_cache, v_cache), out=out, lse=lse)
    assert r is out
    o2 = w.run(q, cache)
    np.testing.assert_array_equal(out, o2)
    assert np.all(np.isfinite(lse))


def test_decode_plan_reused_across_layers(rng):
    """One plan, several layers (different pools and queries)."""
    lens, ps, hq, hkv, d = [5, 19, 40], 4, 8, 2, 16
    cache, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
    for layer in range(3):
        cache_l = rng.standard_normal(cache.shape).astype(np.float32)
        q = rng.standard_normal((3, hq, d)).astype(np.float32)
        o, lse = w.run_return_lse(q, cache_l)
        _check(q, cache_l, indptr, indices, o, lse, lens, "NHD", np.float32)


def test_decode_split_kv_options(rng):
    """Long sequences with a fixed split size (pages) and with splitting disabled give the same answer."""
    lens, ps, hq, hkv, d = [700, 3, 260], 16, 4, 1, 16
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d)
    q = rng.standard_normal((3, hq, d)).astype(np.float32)
    outs = []
    for kw in ({}, dict(fixed_split_size=4), dict(disable_split_kv=True)):
        w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
        w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32", **kw)
        if "fixed_split_size" in kw:
            assert w.plan_info()["kv_chunk_size"] in (0, 64)  # 4 pages of 16 tokens
        if "disable_split_kv" in kw:
            assert w.plan_info()["kv_chunk_size"] == 0
        o, lse = w.run(q, cache, return_lse=True)
        _check(q, cache, indptr, indices, o, lse, lens, "NHD", np.float32)
        outs.append(o)


def test_decode_q_len_per_req(rng):
    """Speculative verification: q_len_per_req rows per request, causal inside the block."""
    lens, ps, hq, hkv, d, ql = [6, 20], 4, 4, 2, 16, 3
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d)
    q = rng.standard_normal((2 * ql, hq, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32", q_len_per_req=ql)
    o = w.run(q, cache)
    for b, n in enumerate(lens):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, n)
        ro, _ = attention(q[b * ql:(b + 1) * ql], k, v, causal=True)
        assert_close(o[b * ql:(b + 1) * ql], ro, 2e-4, 2e-4, "o[%d]" % b)


def test_decode_v_scale_non_fp8_is_applied(rng):
    lens, ps, hq, hkv, d = [5, 9], 4, 2, 2, 16
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d)
    q = rng.standard_normal((2, hq, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
    o1 = w.run(q, cache)
    o2 = w.run(q, cache, v_scale=0.5)
    assert_close(o2, o1 * 0.5, 1e-6, 1e-6)
    # q_scale * k_scale scales the logits (as sm_scale does) for any KV dtype
    o3 = w.run(q, cache, k_scale=0.5, q_scale=0.8)
    w2 = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w2.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32", sm_scale=0.4 / np.sqrt(d))
    assert_close(o3, w2.run(q, cache), 1e-5, 1e-5)
    assert not np.allclose(o3, o1, rtol=1e-3, atol=1e-3)


def test_decode_deprecated_aliases(rng):
    lens, ps, hq, hkv, d = [5, 9], 4, 2, 2, 16
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d)
    q = rng.standard_normal((2, hq, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.begin_forward(indptr, indices, last, hq, hkv, d, ps, data_type="float32")
    o = w.forward(q, cache)
    o2, lse = w.forward_return_lse(q, cache)
    np.testing.assert_array_equal(o, o2)
    w.end_forward()
    # forward() with a per-call parameter honours it (a new plan), unlike FlashInfer which ignored it.
    o3 = w.forward(q, cache, logits_soft_cap=2.0)
    for b, n in enumerate(lens):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, n)
        ro, _ = attention(q[b:b + 1], k, v, logits_soft_cap=2.0)
        assert_close(o3[b], ro[0], 2e-4, 2e-4)
    assert w.is_cuda_graph_enabled is False and w.use_tensor_cores is False


def test_decode_workspace_size_and_too_small(rng):
    lens, ps, hq, hkv, d = [300, 500, 7], 16, 8, 2, 64
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(1 << 20))
    # split KV (fixed chunks of 4 pages): the float workspace holds the partials, the plan lives in the wrapper
    fbytes, ibytes = w.workspace_size(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32",
                                      fixed_split_size=4)
    assert fbytes > 256 and ibytes > 0
    small = kvattn.BatchDecodeWithPagedKVCacheWrapper(np.zeros(64, np.uint8))
    with pytest.raises(kvattn.WorkspaceTooSmallError) as ei:
        small.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32", fixed_split_size=4)
    assert ei.value.needed_bytes and ei.value.needed_bytes >= fbytes - 512
    assert isinstance(ei.value, ValueError)
    # exactly the reported size is enough
    ok = kvattn.BatchDecodeWithPagedKVCacheWrapper(np.zeros(ei.value.needed_bytes, np.uint8))
    ok.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32", fixed_split_size=4)
    # without split KV the plan needs no float workspace bytes
    assert w.workspace_size(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32",
                            disable_split_kv=True)[0] == 256


def test_decode_replan_grows_plan_memory_and_refuses_small_workspace(rng):
    """Re-plans go straight into the plan memory of the wrapper's earlier plan when they fit, and size it again when
    they do not: a much larger batch after a small one (the plan memory grows), then a split that does not fit the
    float workspace (WorkspaceTooSmallError with the size; as after any failed plan, run() then refuses until the
    next plan)."""
    ps, hq, hkv, d = 4, 4, 2, 16
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(1 << 20))
    small = [5, 9]
    cache, indptr, indices, last, _ = make_paged(rng, small, ps, hkv, d)
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
    q = rng.standard_normal((len(small), hq, d)).astype(np.float32)
    o, lse = w.run(q, cache, return_lse=True)
    _check(q, cache, indptr, indices, o, lse, small, "NHD", np.float32)
    first_bytes = w.plan_info()["device_bytes"]
    big = [int(x) for x in rng.integers(0, 12, 3000)]
    cache, indptr, indices, last, _ = make_paged(rng, big, ps, hkv, d)
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
    assert w.plan_info()["device_bytes"] > max(first_bytes, 64 << 10)  # past the first plan memory's 64 KB
    q = rng.standard_normal((len(big), hq, d)).astype(np.float32)
    o, lse = w.run(q, cache, return_lse=True)
    _check(q, cache, indptr, indices, o, lse, big, "NHD", np.float32)
    # a split whose partials do not fit the 1 MB float workspace
    long_ = [200000, 200000]
    cache2, indptr2, indices2, last2, _ = make_paged(rng, long_, 64, hkv, d)
    with pytest.raises(kvattn.WorkspaceTooSmallError) as ei:
        w.plan(indptr2, indices2, last2, hq, hkv, d, 64, q_data_type="float32", fixed_split_size=1)
    assert ei.value.needed_bytes > (1 << 20)
    with pytest.raises(RuntimeError, match="failed plan drops"):  # the documented contract
        w.run(q, cache)
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
    np.testing.assert_array_equal(w.run(q, cache), o)


def test_decode_graph_mode_buffers_numpy(rng):
    """use_cuda_graph=True semantics on the CPU backend: fixed batch, buffers filled by plan, re-plan works."""
    ps, hq, hkv, d, B = 4, 4, 2, 16, 3
    indptr_buf = np.zeros(B + 1, np.int32)
    indices_buf = np.zeros(64, np.int32)
    last_buf = np.zeros(B, np.int32)
    w = kvattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(workspace(), indptr_buf, indices_buf, last_buf)
    assert w.is_cuda_graph_enabled
    for lens in ([3, 10, 1], [17, 0, 40]):
        cache, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d, extra_pages=4)
        cache = np.concatenate([cache, rng.standard_normal((60 - P,) + cache.shape[1:]).astype(np.float32)])
        w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
        np.testing.assert_array_equal(indptr_buf, indptr)
        np.testing.assert_array_equal(indices_buf[:len(indices)], indices)
        q = rng.standard_normal((B, hq, d)).astype(np.float32)
        o, lse = w.run(q, cache, return_lse=True)
        _check(q, cache, indptr, indices, o, lse, lens, "NHD", np.float32)
    with pytest.raises(ValueError, match="fixed"):
        w.plan(indptr[:2], indices, last[:1], hq, hkv, d, ps, q_data_type="float32")


def test_decode_bfloat16_numpy_via_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="NumPy has no bfloat16 without ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    lens, ps, hq, hkv, d = [3, 40], 16, 8, 2, 32
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d)
    cache = cache.astype(bf16)
    q = rng.standard_normal((2, hq, d)).astype(bf16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="bfloat16")
    o, lse = w.run(q, cache, return_lse=True)
    assert o.dtype == bf16
    _check(q, cache, indptr, indices, o, lse, lens, "NHD", bf16)
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q.astype(np.float32), cache)


def test_fast_decode_plan(rng):
    from kvattn.decode import fast_decode_plan

    lens, ps, hq, hkv, d = [5, 19], 4, 4, 2, 16
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d)
    q = rng.standard_normal((2, hq, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
    ref = w.run(q, cache)
    w2 = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w2.plan = fast_decode_plan.__get__(w2)  # how engines monkey-patch it
    w2.plan(None, indices, last, hq, hkv, d, ps, q_data_type="float32", global_override_indptr_cpu=indptr)
    np.testing.assert_array_equal(w2.run(q, cache), ref)


def test_decode_batch_of_zero_requests(rng):
    # a step with no decode requests: empty outputs, no error (NumPy reports zero strides for empty arrays)
    cache = rng.standard_normal((4, 2, 16, 2, 64)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout="NHD")
    w.plan(np.array([0], np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), 8, 2, 64, 16,
           q_data_type="float32")
    q = rng.standard_normal((0, 8, 64)).astype(np.float32)
    o, lse = w.run(q, cache, return_lse=True)
    assert o.shape == (0, 8, 64) and lse.shape == (0, 8)
    # the same wrapper then serves a real step
    res = _run_decode(rng, [3, 20], 16, 8, 2, 64)
    _check(*res, [3, 20], "NHD", np.float32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_page_size_one_cache_without_page_dim(rng, layout):
    """A page-size-1 cache may omit the page dimension: a (K, V) tuple of 3-D [num_tokens, num_kv_heads, head_dim]
    pools (a token-granular pool, planned with page_size=1) or one 4-D [num_tokens, 2, num_kv_heads, head_dim]
    tensor; the decode, paged-prefill and append paths read it as [num_tokens, 1, ...]."""
    hq, hkv, d, size = 6, 2, 16, 40
    kbuf = rng.standard_normal((size, hkv, d)).astype(np.float32)
    vbuf = rng.standard_normal((size, hkv, d)).astype(np.float32)
    lens = [7, 0, 12, 3]
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    indices = rng.permutation(size)[:indptr[-1]].astype(np.int32)
    last = np.ones(len(lens), np.int32)
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout=layout)
    w.plan(indptr, indices, last, hq, hkv, d, 1, q_data_type="float32")
    atol, rtol = TOL["float32"]
    o3, lse3 = w.run(q, (kbuf, vbuf), return_lse=True)
    o4 = w.run(q, np.stack([kbuf, vbuf], axis=1))
    for b in range(len(lens)):
        sel = indices[indptr[b]:indptr[b + 1]]
        ro, rl = attention(q[b:b + 1], kbuf[sel], vbuf[sel])
        assert_close(o3[b], ro[0], atol, rtol, "o[%d]" % b)
        assert_close(lse3[b], rl[0], atol, rtol, "lse[%d]" % b)
    np.testing.assert_array_equal(o4, o3)
    # paged prefill over the same pools
    qo_indptr = np.array([0, 2, 3, 5, 6], np.int32)
    qp = rng.standard_normal((6, hq, d)).astype(np.float32)
    wp = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout=layout)
    wp.plan(qo_indptr, indptr, indices, last, hq, hkv, d, 1, q_data_type="float32", causal=True)
    op = wp.run(qp, (kbuf, vbuf))
    for b in range(len(lens)):
        sel = indices[indptr[b]:indptr[b + 1]]
        ro, _ = attention(qp[qo_indptr[b]:qo_indptr[b + 1]], kbuf[sel], vbuf[sel], causal=True)
        assert_close(op[qo_indptr[b]:qo_indptr[b + 1]], ro, atol, rtol, "prefill o[%d]" % b)
    # append into the 3-D pools: the last token of each non-empty request
    nz = [b for b in range(len(lens)) if lens[b]]
    new_k = rng.standard_normal((len(nz), hkv, d)).astype(np.float32)
    new_v = rng.standard_normal((len(nz), hkv, d)).astype(np.float32)
    kvattn.append_paged_kv_cache(new_k, new_v, np.array(nz, np.int32), np.array([lens[b] - 1 for b in nz], np.int32),
                                 (kbuf, vbuf), indices, indptr, last, kv_layout=layout)
    for i, b in enumerate(nz):
        slot = indices[indptr[b + 1] - 1]
        np.testing.assert_array_equal(kbuf[slot], new_k[i])
        np.testing.assert_array_equal(vbuf[slot], new_v[i])
    # the page dimension is not guessed for other page sizes
    w.plan(indptr, indices, last, hq, hkv, d, 2, q_data_type="float32")
    with pytest.raises(kvattn.PlanMismatchError, match="k_cache"):
        w.run(q, (kbuf, vbuf))


def _block_table(indptr, indices, extra, fill=-1):
    """The [B, max_pages + extra] block-table form of a CSR page table, rows padded with `fill` (never read)."""
    B = len(indptr) - 1
    pages = np.diff(indptr)
    bt = np.full((B, int(pages.max(initial=0)) + extra), fill, np.int32)
    for b in range(B):
        bt[b, :pages[b]] = indices[indptr[b]:indptr[b + 1]]
    return bt


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_block_tables(rng, page_size, layout):
    """plan(block_tables=, seq_lens=) (vLLM's page-table form, run natively): the same result as the CSR form,
    bit for bit, and the reference; the padding entries (outside the pool) are never read."""
    lens, hq, hkv, d = [0, 1, 16, 17, 45, 3, 0], 8, 2, 32
    cache, indptr, indices, last, P = make_paged(rng, lens, page_size, hkv, d, layout=layout)
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout=layout)
    w.plan(indptr, indices, last, hq, hkv, d, page_size, q_data_type="float32")
    o_csr, lse_csr = w.run(q, cache, return_lse=True)
    for fill in (-1, P, 2 ** 31 - 1):
        bt = _block_table(indptr, indices, 2, fill)
        wb = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout=layout)
        wb.plan(None, None, None, hq, hkv, d, page_size, q_data_type="float32", block_tables=bt,
                seq_lens=np.array(lens, np.int32), num_pages=P)
        o, lse = wb.run(q, cache, return_lse=True)
        np.testing.assert_array_equal(o, o_csr)
        np.testing.assert_array_equal(lse, lse_csr)
    _check(q, cache, indptr, indices, o, lse, lens, layout, np.float32)
    # the pool size from the pages in use (the padding is not an index), a row-strided view of a wider table, and a
    # list of lists
    wide = np.full((len(lens), bt.shape[1] + 5), 7, np.int32)
    wide[:, :bt.shape[1]] = _block_table(indptr, indices, 2, -1)
    for table in (wide[:, :bt.shape[1]], _block_table(indptr, indices, 2, -1).tolist()):
        wb = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout=layout)
        wb.plan(None, None, None, hq, hkv, d, page_size, q_data_type="float32", block_tables=table, seq_lens=lens)
        np.testing.assert_array_equal(wb.run(q, cache), o_csr)


def test_decode_block_tables_errors_graph_and_size(rng):
    lens, ps, hq, hkv, d = [5, 19, 0], 4, 4, 2, 16
    cache, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d)
    bt = _block_table(indptr, indices, 1)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    with pytest.raises(ValueError, match="seq_lens"):
        w.plan(None, None, None, hq, hkv, d, ps, q_data_type="float32", block_tables=bt)
    with pytest.raises(ValueError, match="needs 7 pages"):
        w.plan(None, None, None, hq, hkv, d, ps, q_data_type="float32", block_tables=bt, seq_lens=[5, 27, 0])
    with pytest.raises(ValueError, match="negative"):
        w.plan(None, None, None, hq, hkv, d, ps, q_data_type="float32", block_tables=bt, seq_lens=[5, -1, 0])
    with pytest.raises(ValueError, match="rows"):
        w.plan(None, None, None, hq, hkv, d, ps, q_data_type="float32", block_tables=bt[:2], seq_lens=lens)
    bad = bt.copy()
    bad[1, 0] = P  # a page in use outside the pool
    with pytest.raises(kvattn.KvattnError):
        w.plan(None, None, None, hq, hkv, d, ps, q_data_type="float32", block_tables=bad, seq_lens=lens,
               num_pages=P)
    sizes = w.workspace_size(None, None, None, hq, hkv, d, ps, q_data_type="float32", block_tables=bt,
                             seq_lens=lens)
    assert sizes == w.workspace_size(indptr, indices, last, hq, hkv, d, ps, q_data_type="float32")
    # use_cuda_graph=True semantics on the CPU backend: the table is copied into the indices buffer
    B = len(lens)
    indices_buf = np.zeros(B * bt.shape[1] + 3, np.int32)
    wg = kvattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(workspace(), np.zeros(B + 1, np.int32), indices_buf,
                                                            np.zeros(B, np.int32))
    q = rng.standard_normal((B, hq, d)).astype(np.float32)
    wg.plan(None, None, None, hq, hkv, d, ps, q_data_type="float32", block_tables=bt, seq_lens=lens)
    np.testing.assert_array_equal(indices_buf[:bt.size], bt.reshape(-1))
    o, lse = wg.run(q, cache, return_lse=True)
    _check(q, cache, indptr, indices, o, lse, lens, "NHD", np.float32)
