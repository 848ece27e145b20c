"""Errors: C-layer errors become KvattnError subclasses carrying kva_last_error_message(); run-time arguments
that disagree with the plan raise; unsupported FlashInfer arguments raise clearly."""

import numpy as np
import pytest

import kvattn
from conftest import workspace
from reference import make_paged


def _decode_setup(rng, lens=(5, 9), ps=4, hq=4, hkv=2, d=16):
    cache, indptr, indices, last, P = make_paged(rng, list(lens), ps, hkv, d)
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float32)
    return cache, indptr, indices, last, q


def test_bad_indptr_raises_with_c_message(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    bad = indptr.copy()
    bad[1], bad[2] = bad[2], bad[1]  # decreasing
    with pytest.raises(kvattn.PageTableMalformedError) as ei:
        w.plan(bad, indices, last, 4, 2, 16, 4, q_data_type="float32")
    msg = str(ei.value)
    assert "indptr" in msg and "decreases" in msg  # the C library's message
    assert ei.value.status_name == "KVA_ERR_PAGETABLE_MALFORMED" and ei.value.status == 4
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, kvattn.KvattnError)
    bad0 = indptr.copy()
    bad0[0] = 1
    with pytest.raises(kvattn.PageTableMalformedError, match=r"indptr\[0\]"):
        w.plan(bad0, indices, last, 4, 2, 16, 4, q_data_type="float32")


def test_bad_last_page_len(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    bad = last.copy()
    bad[0] = 5  # > page_size
    with pytest.raises(kvattn.PageTableMalformedError, match="last_page_len"):
        w.plan(indptr, indices, bad, 4, 2, 16, 4, q_data_type="float32")


def test_page_index_out_of_range(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    w.run(q, cache)  # the wrapper learns the pool size
    bad = indices.copy()
    bad[-1] = cache.shape[0] + 3
    # FlashInfer's plan never sees the pool, so an index past the pool is reported when run() gets the pool
    w.plan(indptr, bad, last, 4, 2, 16, 4, q_data_type="float32")
    with pytest.raises(kvattn.PageIndexOutOfRangeError, match="outside the pool"):
        w.run(q, cache)
    # ... or at plan time when the pool size is given (kvattn extension)
    with pytest.raises(kvattn.PageIndexOutOfRangeError, match="outside the pool"):
        w.plan(indptr, bad, last, 4, 2, 16, 4, q_data_type="float32", num_pages=cache.shape[0])
    neg = indices.copy()
    neg[0] = -1
    with pytest.raises(kvattn.PageIndexOutOfRangeError):
        w.plan(indptr, neg, last, 4, 2, 16, 4, q_data_type="float32")


def test_pool_smaller_than_indices_raises_at_run(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    small = cache[: int(indices.max())]  # the largest index is now outside
    with pytest.raises(kvattn.PageIndexOutOfRangeError):
        w.run(q, small)


def test_run_dtype_mismatch_raises(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4)  # q_data_type defaults to float16, like FlashInfer
    with pytest.raises(kvattn.PlanMismatchError, match="q has dtype float32 but the plan expects float16"):
        w.run(q, cache)
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    with pytest.raises(kvattn.PlanMismatchError, match="k_cache"):
        w.run(q, cache.astype(np.float16))
    with pytest.raises(kvattn.PlanMismatchError, match="out"):
        w.run(q, cache, out=np.zeros((2, 4, 16), np.float16))


def test_run_scalar_mismatch_raises(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", window_left=8, logits_soft_cap=30.0)
    w.run(q, cache, window_left=8, logits_soft_cap=30.0)  # equal values are fine
    with pytest.raises(kvattn.PlanMismatchError, match="window_left"):
        w.run(q, cache, window_left=4)
    with pytest.raises(kvattn.PlanMismatchError, match="logits_soft_cap"):
        w.run(q, cache, logits_soft_cap=50.0)
    with pytest.raises(kvattn.PlanMismatchError, match="sm_scale"):
        w.run(q, cache, sm_scale=1.0)
    with pytest.raises(kvattn.PlanMismatchError, match="q_len_per_req"):
        w.run(q, cache, q_len_per_req=2)


def test_run_shape_mismatch_raises(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    with pytest.raises(kvattn.PlanMismatchError, match="q has shape"):
        w.run(q[:1], cache)
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(np.zeros((2, 8, 16), np.float32), cache)
    with pytest.raises(ValueError, match="5-D"):
        w.run(q, cache[:, 0])


def test_run_before_plan_and_after_reset(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, cache)
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    w.reset_workspace_buffer(workspace(), None)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q, cache)


def test_strides_rejected_clearly(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    with pytest.raises(ValueError, match="negative stride"):
        w.run(q[::-1], cache)
    qt = np.ascontiguousarray(q.transpose(0, 2, 1)).transpose(0, 2, 1)  # last dim stride != 1
    with pytest.raises(ValueError, match="contiguous last dimension"):
        w.run(qt, cache)
    with pytest.raises(ValueError, match="contiguous"):
        kvattn.single_decode_with_kv_cache(q[0], np.zeros((16, 3, 2), np.float32).transpose(0, 2, 1),
                                           np.zeros((3, 2, 16), np.float32))


def test_unsupported_arguments_raise(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    with pytest.raises(NotImplementedError, match="backend"):
        kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), backend="trtllm-gen")
    with pytest.raises(NotImplementedError, match="jit_args"):
        kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), jit_args=["x"])
    with pytest.raises(NotImplementedError, match="jit_args"):
        kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), jit_kwargs={"a": 1})
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    with pytest.raises(ValueError, match="seq_lens"):  # the block-table form needs the lengths
        w.plan(indptr, indices, last, 4, 2, 16, 4, block_tables=np.zeros((2, 3), np.int32))
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    with pytest.raises(NotImplementedError, match="sinks"):
        w.run(q, cache, sinks=np.zeros(4, np.float32))
    with pytest.raises(NotImplementedError, match="positional"):
        w.run(q, cache, 1.0)
    p = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    qo = np.array([0, 1, 2], np.int32)
    with pytest.raises(NotImplementedError, match="use_fp16_qk_reduction"):
        p.plan(qo, indptr, indices, last, 4, 2, 16, 4, use_fp16_qk_reduction=True)
    with pytest.raises(NotImplementedError, match="prefix_len_ptr"):
        p.plan(qo, indptr, indices, last, 4, 2, 16, 4, prefix_len_ptr=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        p.plan(qo, indptr, indices, last, 4, 2, 16, 4, pos_encoding_mode="ROPE_NEOX")
    with pytest.raises(ValueError, match="kv_layout"):
        kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace(), kv_layout="NDH")
    with pytest.raises(TypeError, match="q_data_type"):
        p.plan(qo, indptr, indices, last, 4, 2, 16, 4, q_data_type="int8")


def test_bad_heads_raise(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    with pytest.raises(ValueError, match="multiple"):
        w.plan(indptr, indices, last, 5, 2, 16, 4, q_data_type="float32")


def test_c_status_from_library_is_keyed():
    """error_for_status maps every kva_status to its class."""
    from kvattn.exceptions import error_for_status

    e = error_for_status(2, "no")
    assert isinstance(e, kvattn.UnsupportedError) and isinstance(e, NotImplementedError)
    e = error_for_status(3, "plan: ... this plan needs 4096 bytes")
    assert isinstance(e, kvattn.WorkspaceTooSmallError) and e.needed_bytes == 4096
    assert isinstance(error_for_status(9, "x"), RuntimeError)
    assert isinstance(error_for_status(6, "x"), kvattn.PlanMismatchError)


def test_int64_index_arrays_are_accepted(rng):
    """FlashInfer requires int32 (int64 once gave wrong results); kvattn converts host arrays exactly."""
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    o1 = w.run(q, cache)
    w.plan(indptr.astype(np.int64), indices.astype(np.int64), last.astype(np.int64), 4, 2, 16, 4,
           q_data_type="float32")
    np.testing.assert_array_equal(o1, w.run(q, cache))
    with pytest.raises(TypeError, match="integer"):
        w.plan(indptr.astype(np.float32), indices, last, 4, 2, 16, 4, q_data_type="float32")


def test_workspace_size_checks_last_page_len_length(rng):
    """workspace_size() hands last_page_len to the C library, which reads batch_size entries: a shorter array must
    raise as plan() does, not be read past its end (here into the rest of a larger buffer, which made a size come
    back for a page table the caller never gave)."""
    cache, indptr, indices, last, q = _decode_setup(rng, lens=(5, 9, 3))
    backing = np.full(16, 3, np.int32)
    short = backing[:1]  # 1 entry for 3 requests; the bytes after it are valid-looking lengths
    print("workspace_size: batch of 3, last_page_len of 1 element")
    dec = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    pre = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    qo_indptr = np.arange(4, dtype=np.int32)
    for call in (lambda: dec.workspace_size(indptr, indices, short, 4, 2, 16, 4, q_data_type="float32"),
                 lambda: dec.plan(indptr, indices, short, 4, 2, 16, 4, q_data_type="float32"),
                 lambda: pre.workspace_size(qo_indptr, indptr, indices, short, 4, 2, 16, 4, q_data_type="float32"),
                 lambda: pre.plan(qo_indptr, indptr, indices, short, 4, 2, 16, 4, q_data_type="float32")):
        with pytest.raises(ValueError, match="last_page_len has 1 elements"):
            call()
    with pytest.raises(ValueError, match="page_size"):
        dec.workspace_size(indptr, indices, last, 4, 2, 16, 0, q_data_type="float32")
    assert dec.workspace_size(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")[0] > 0


def test_page_table_as_python_lists(rng):
    """indptr and last_page_len were accepted as Python lists but indices raised AttributeError ('list' object has
    no attribute 'shape'); all three are index sequences."""
    cache, indptr, indices, last, q = _decode_setup(rng)
    print("decode plan with lists: indptr %s" % indptr.tolist())
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    o1 = w.run(q, cache)
    w.plan(indptr.tolist(), indices.tolist(), last.tolist(), 4, 2, 16, 4, q_data_type="float32")
    np.testing.assert_array_equal(o1, w.run(q, cache))
    w.plan([0], [], [], 4, 2, 16, 4, q_data_type="float32")
    assert w.run(q[:0], cache).shape == (0, 4, 16)


def test_read_only_and_overlapping_outputs_rejected(rng):
    """kvattn never writes a read-only NumPy array (out=, lse=, the cache of an append, merge_state_in_place's
    target) nor an output whose rows share storage (stride 0); the arrays stay as they were."""
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    out = np.full(q.shape, 3.0, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is a read-only array"):
        w.run(q, cache, out=out)
    assert np.all(out == 3.0)
    lse = np.full(q.shape[:2], 3.0, np.float32)
    lse.flags.writeable = False
    with pytest.raises(ValueError, match="lse is a read-only array"):
        w.run(q, cache, lse=lse, return_lse=True)
    assert np.all(lse == 3.0)
    base = np.full((1,) + q.shape[1:], 3.0, np.float32)
    shared = np.lib.stride_tricks.as_strided(base, shape=q.shape, strides=(0,) + base.strides[1:])
    with pytest.raises(ValueError, match="stride 0 in dim 0"):
        w.run(q, cache, out=shared)
    assert np.all(base == 3.0)
    # a broadcast q (an input) is fine: it is only read
    o = w.run(np.broadcast_to(q[:1], q.shape), cache)
    o1 = w.run(np.ascontiguousarray(np.broadcast_to(q[:1], q.shape)), cache)
    np.testing.assert_array_equal(o, o1)

    frozen = np.frombuffer(cache.tobytes(), dtype=cache.dtype).reshape(cache.shape)  # read-only (bytes)
    k = rng.standard_normal((1, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="k_cache is a read-only array"):
        kvattn.append_paged_kv_cache(k, k, np.array([0], np.int32), np.array([0], np.int32), frozen, indices,
                                     indptr, last)
    np.testing.assert_array_equal(frozen, cache)

    v = rng.standard_normal((3, 2, 16)).astype(np.float32)
    s = rng.standard_normal((3, 2)).astype(np.float32)
    v.flags.writeable = False
    v0 = v.copy()
    with pytest.raises(ValueError, match="read-only"):
        kvattn.merge_state_in_place(v, s, v0.copy(), s.copy())
    np.testing.assert_array_equal(v, v0)


@pytest.mark.parametrize("args,exc,what", [((4.0, 2, 16, 4), TypeError, "num_qo_heads"),
                                           ((4, 2, 16, 4.9), TypeError, "page_size"),
                                           ((4, 2, 16, True), TypeError, "page_size"),
                                           ((4, 2, 0, 4), ValueError, "head_dim"),
                                           ((4, 0, 16, 4), ValueError, "num_kv_heads"),
                                           ((4, 2, 16, 0), ValueError, "page_size")])
def test_sizes_must_be_positive_integers(rng, args, exc, what):
    """A float size is not truncated (page_size 4.9 is not 4) and a zero size is a ValueError naming it, not a
    ZeroDivisionError; NumPy integers are accepted."""
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    with pytest.raises(exc, match=what):
        w.plan(indptr, indices, last, *args, q_data_type="float32")
    w.plan(indptr, indices, last, np.int64(4), np.int32(2), np.int64(16), np.int16(4), q_data_type="float32")
    assert w.run(q, cache).shape == q.shape
    with pytest.raises(ValueError, match="head_dim 0"):
        kvattn.single_decode_with_kv_cache(np.zeros((4, 0), np.float32), np.zeros((3, 2, 0), np.float32),
                                           np.zeros((3, 2, 0), np.float32))


# ---- session-34 audit: values that would wrap in 32-bit C fields, plan-time copies, read-only workspaces ----

def test_values_that_wrap_in_int32_raise(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    for wl in (2 ** 32, 2 ** 32 + 3, 2 ** 31):
        with pytest.raises(ValueError, match="window_left"):  # would wrap to 0 / 3 / -2^31
            w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", window_left=wl)
    with pytest.raises(ValueError, match="fixed_split_size"):  # 2^27 pages x 4 tokens > 2^31 - 1 tokens
        w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", fixed_split_size=2 ** 29)
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(indptr, indices, last, 2 ** 32 + 4, 2, 16, 4, q_data_type="float32")
    with pytest.raises(ValueError, match="page_size"):
        w.plan(indptr, indices, last, 4, 2, 16, 2 ** 32 + 4, q_data_type="float32")
    for n in (-5, 2 ** 70):
        with pytest.raises(ValueError, match="num_pages"):
            w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", num_pages=n)
    r = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    with pytest.raises(ValueError, match="fixed_split_size"):
        r.plan(np.array([0, 2], np.int32), np.array([0, 9], np.int32), 4, 2, 16, q_data_type="float32",
               fixed_split_size=2 ** 32 + 5)
    with pytest.raises(ValueError, match="window_left"):
        kvattn.single_decode_with_kv_cache(q[0], cache[0, 0], cache[0, 1], window_left=2 ** 32)
    # the plan made before the failed calls is not the issue here; a valid plan still works
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", window_left=2 ** 31 - 1)
    assert np.isfinite(w.run(q, cache)).all()


def test_single_scale_that_rounds_to_zero_in_float32_raises(rng):
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((9, 2, 16)).astype(np.float32)
    v = rng.standard_normal((9, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="sm_scale"):  # 1e-46 is 0 in float32, which C reads as "default"
        kvattn.single_decode_with_kv_cache(q, k, v, sm_scale=1e-46)
    with pytest.raises(ValueError, match="sm_scale"):
        kvattn.single_prefill_with_kv_cache(q[None].repeat(3, 0), k, v, sm_scale=1e-46)
    with pytest.raises(ValueError, match="sm_scale"):  # overflows float32
        kvattn.single_decode_with_kv_cache(q, k, v, sm_scale=1e39)


def test_rope_scale_and_theta_zero_raise_instead_of_meaning_default(rng):
    """With fused RoPE a rope_scale / rope_theta of 0 (or one that rounds to 0 in float32) raises; the C descriptor
    would read 0 as its default (1, 1e4) and the call would silently use another frequency table."""
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    for kw in (dict(rope_theta=0.0), dict(rope_scale=0.0), dict(rope_theta=1e-46), dict(rope_scale=-2.0),
               dict(rope_theta=float("inf"))):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=name):
            w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", pos_encoding_mode="ROPE_LLAMA", **kw)
        with pytest.raises(ValueError, match=name):
            kvattn.single_decode_with_kv_cache(q[0], cache[0, 0], cache[0, 1], pos_encoding_mode="ROPE_LLAMA", **kw)
        with pytest.raises(ValueError, match=name):
            kvattn.single_prefill_with_kv_cache(q, cache[0, 0], cache[0, 1], pos_encoding_mode="ROPE_LLAMA", **kw)
    # forward() re-plans with its per-call value: refused the same way, the plan stays usable
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0)
    o = w.run(q, cache)
    with pytest.raises(ValueError, match="rope_theta"):
        w.forward(q, cache, rope_theta=0.0)
    assert np.array_equal(w.run(q, cache), o)
    # without fused RoPE the values have no effect and are not checked (as FlashInfer)
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", rope_theta=0.0)
    assert np.isfinite(w.run(q, cache)).all()


def test_plan_keeps_its_own_copy_of_host_page_table_metadata(rng):
    """A re-plan the wrapper makes by itself (a run on a smaller pool than planned) uses the plan-time indptr and
    last_page_len, not what the caller's persistent host buffers hold by then."""
    cache, indptr, indices, last, q = _decode_setup(rng, lens=(13, 7))
    big = np.concatenate([cache, cache[:3]])
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")
    expected = w.run(q, cache).copy()
    w.run(q, big)  # the wrapper now plans for the larger pool
    ip_buf, lpl_buf = indptr.copy(), last.copy()
    w.plan(ip_buf, indices, lpl_buf, 4, 2, 16, 4, q_data_type="float32")
    np.testing.assert_array_equal(w.run(q, big), expected)
    lpl_buf[:] = 1  # the engine refills its buffers for the next step
    ip_buf[1:] = ip_buf[-1]
    np.testing.assert_array_equal(w.run(q, cache), expected)  # smaller pool: re-plan from the plan's own copy


def test_paged_prefill_plan_keeps_its_own_qo_indptr(rng):
    cache, indptr, indices, last, _ = _decode_setup(rng, lens=(13, 7))
    qo = np.array([0, 3, 5], np.int32)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    big = np.concatenate([cache, cache[:3]])
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(qo, indptr, indices, last, 4, 2, 16, 4, causal=True, q_data_type="float32")
    expected = w.run(q, cache).copy()
    w.run(q, big)
    qo_buf = qo.copy()
    w.plan(qo_buf, indptr, indices, last, 4, 2, 16, 4, causal=True, q_data_type="float32")
    qo_buf[1] = 1
    np.testing.assert_array_equal(w.run(q, cache), expected)


def test_read_only_workspace_is_refused(tmp_path):
    ws = np.zeros(1 << 20, np.uint8)
    ws.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    f = tmp_path / "ws.bin"
    f.write_bytes(b"\0" * (1 << 20))
    with pytest.raises(ValueError, match="read-only"):
        kvattn.BatchPrefillWithPagedKVCacheWrapper(np.memmap(str(f), dtype=np.uint8, mode="r"))


def test_forward_validates_and_keeps_the_plan_on_failure(rng):
    cache, indptr, indices, last, q = _decode_setup(rng)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", sm_scale=0.5)
    expected = w.run(q, cache).copy()
    for bad in (0.0, -1.0, float("inf"), float("nan"), 1e-46):
        with pytest.raises(ValueError, match="sm_scale"):
            w.forward(q, cache, sm_scale=bad)
        np.testing.assert_array_equal(w.run(q, cache), expected)  # the plan stands
    with pytest.raises(ValueError, match="window_left"):
        w.forward(q, cache, window_left=2 ** 32)
    np.testing.assert_array_equal(w.run(q, cache), expected)
    o = w.forward(q, cache, sm_scale=0.25)  # a valid change re-plans
    assert not np.array_equal(o, expected)


def test_cascade_levels_must_cover_the_same_rows(rng):
    cache, indptr, indices, last, _ = _decode_setup(rng, lens=(13, 7))
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, workspace())
    with pytest.raises(ValueError, match="different numbers of query rows"):
        w.plan([np.array([0, 6], np.int32), np.array([0, 3, 5], np.int32)], [indptr[:2], indptr],
               [indices, indices], [last[:1], last], 4, 2, 16, 4, q_data_type="float32")


def test_run_bounds_refilled_indices_by_the_pool_it_gets(rng):
    """The run reads the indices array given to plan() (FlashInfer's contract). An engine that refills it in place
    after plan() with pages above the plan-time largest index but inside the pool given to run() gets the right
    answer, not a PageIndexOutOfRangeError against the pool size the plan inferred."""
    cache, indptr, indices, last, q = _decode_setup(rng, lens=(13, 7))
    n = int(indptr[-1])
    big = rng.standard_normal((n + 40,) + cache.shape[1:]).astype(np.float32)
    idx = np.arange(n, dtype=np.int32)  # the plan infers a pool of n pages
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    w.plan(indptr, idx, last, 4, 2, 16, 4, q_data_type="float32")
    idx[:] = np.arange(40, 40 + n, dtype=np.int32)  # refilled in place: pages of the larger pool
    out = w.run(q, big)
    w.plan(indptr, idx.copy(), last, 4, 2, 16, 4, q_data_type="float32", num_pages=big.shape[0])
    np.testing.assert_array_equal(out, w.run(q, big))
    assert np.all(np.isfinite(out)) and np.any(out != 0)


def test_packed_masks_refuse_bool_arrays(rng):
    """A bool array is one byte per element: taken as packed bits it would be a different mask. The packed-mask
    arguments refuse it (the unpacked mask goes to custom_mask)."""
    qo_lens, kv_lens = [3, 2], [5, 9]
    bits = sum(q * k for q, k in zip(qo_lens, kv_lens))
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, 4, 2, 16)
    qo_indptr = np.array([0, 3, 5], dtype=np.int32)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    with pytest.raises(TypeError, match="packed bits"):
        w.plan(qo_indptr, indptr, indices, last, 2, 2, 16, 4, q_data_type="float32",
               packed_custom_mask=np.ones(bits, dtype=bool))
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    k = rng.standard_normal((7, 2, 16)).astype(np.float32)
    with pytest.raises(TypeError, match="packed bits"):
        kvattn.single_prefill_with_kv_cache(q, k, k, packed_custom_mask=np.ones(3, dtype=bool))
    with pytest.raises(TypeError, match="custom_mask_buf"):
        kvattn.BatchPrefillWithPagedKVCacheWrapper(
            workspace(), use_cuda_graph=True, qo_indptr_buf=np.zeros(3, np.int32),
            paged_kv_indptr_buf=np.zeros(3, np.int32), paged_kv_indices_buf=np.zeros(8, np.int32),
            paged_kv_last_page_len_buf=np.zeros(2, np.int32),
            custom_mask_buf=np.zeros(64, dtype=bool), mask_indptr_buf=np.zeros(3, np.int32))


def test_graph_prefill_row_bound_comes_from_a_plan_that_succeeded(rng):
    """CUDA-graph mode: the first plan's query rows bound later plans, but only a plan that succeeded sets it."""
    kv_lens = [5, 9]
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, 4, 2, 16)
    bufs = dict(qo_indptr_buf=np.zeros(3, np.int32), paged_kv_indptr_buf=np.zeros(3, np.int32),
                paged_kv_indices_buf=np.zeros(indices.size, np.int32),
                paged_kv_last_page_len_buf=np.zeros(2, np.int32))
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True, **bufs)
    bad = indptr.copy()
    bad[1], bad[2] = bad[2], bad[1]  # decreasing: refused by the library's plan
    with pytest.raises(kvattn.PageTableMalformedError):
        w.plan(np.array([0, 1, 2], np.int32), bad, indices, last, 4, 2, 16, 4, q_data_type="float32")
    qo_indptr = np.array([0, 2, 5], np.int32)
    w.plan(qo_indptr, indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", causal=True)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    o = w.run(q, cache)
    assert np.all(np.isfinite(o))
    with pytest.raises(ValueError, match="first plan had 5"):
        w.plan(np.array([0, 3, 6], np.int32), indptr, indices, last, 4, 2, 16, 4, q_data_type="float32")


def test_float_custom_mask_is_refused(rng):
    """custom_mask is a bool mask (True = visible). A float mask is refused with TypeError: an additive mask
    (0 = visible, -inf = masked) read as "nonzero = visible" would be inverted. Integer 0/1 masks still work."""
    qo_lens, kv_lens = [3, 2], [5, 9]
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, 4, 2, 16)
    qo_indptr = np.array([0, 3, 5], dtype=np.int32)
    vis = [rng.random((a, b)) < 0.5 for a, b in zip(qo_lens, kv_lens)]
    flat = np.concatenate([m.reshape(-1) for m in vis])
    additive = np.where(flat, 0.0, -np.inf).astype(np.float32)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    with pytest.raises(TypeError, match="custom_mask must be a bool"):
        w.plan(qo_indptr, indptr, indices, last, 2, 2, 16, 4, q_data_type="float32", custom_mask=additive)
    wr = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    kv_indptr = np.array([0, 5, 14], dtype=np.int32)
    with pytest.raises(TypeError, match="custom_mask must be a bool"):
        wr.plan(qo_indptr, kv_indptr, 2, 2, 16, q_data_type="float32", custom_mask=additive)
    q = rng.standard_normal((3, 2, 16)).astype(np.float32)
    k = rng.standard_normal((5, 2, 16)).astype(np.float32)
    with pytest.raises(TypeError, match="custom_mask must be a bool"):
        kvattn.single_prefill_with_kv_cache(q, k, k, custom_mask=np.where(vis[0], 0.0, -np.inf))
    # bool and integer (0/1) masks give the same result
    w.plan(qo_indptr, indptr, indices, last, 2, 2, 16, 4, q_data_type="float32", custom_mask=flat)
    qq = rng.standard_normal((5, 2, 16)).astype(np.float32)
    o_bool = w.run(qq, cache)
    w.plan(qo_indptr, indptr, indices, last, 2, 2, 16, 4, q_data_type="float32", custom_mask=flat.astype(np.int32))
    assert np.array_equal(w.run(qq, cache), o_bool)
    assert np.array_equal(kvattn.single_prefill_with_kv_cache(q, k, k, custom_mask=vis[0].astype(np.uint8)),
                          kvattn.single_prefill_with_kv_cache(q, k, k, custom_mask=vis[0]))


def test_prefill_workspace_size_checks_its_keywords_as_plan(rng):
    """workspace_size(**kwargs) of the prefill wrappers: a keyword plan() does not take raises TypeError (it was
    ignored), and plan() arguments kvattn does not support raise as plan() raises."""
    kv_lens = [5, 9]
    cache, indptr, indices, last, _ = make_paged(rng, kv_lens, 4, 2, 16)
    qo_indptr = np.array([0, 2, 5], np.int32)
    kv_indptr = np.array([0, 5, 14], np.int32)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
    r = kvattn.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    fb, ib = w.workspace_size(qo_indptr, indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", num_pages=8)
    assert fb > 0 and ib > 0
    assert r.workspace_size(qo_indptr, kv_indptr, 4, 2, 16, q_data_type="float32")[1] > 0
    with pytest.raises(TypeError, match="causl"):
        w.workspace_size(qo_indptr, indptr, indices, last, 4, 2, 16, 4, causl=True)
    with pytest.raises(TypeError, match="causl"):
        r.workspace_size(qo_indptr, kv_indptr, 4, 2, 16, causl=True)
    with pytest.raises(NotImplementedError, match="prefix_len_ptr"):
        w.workspace_size(qo_indptr, indptr, indices, last, 4, 2, 16, 4, prefix_len_ptr=np.zeros(2, np.int32))
    with pytest.raises(NotImplementedError, match="max_item_len_ptr"):
        r.workspace_size(qo_indptr, kv_indptr, 4, 2, 16, max_item_len_ptr=np.zeros(2, np.int32))
    with pytest.raises(NotImplementedError, match="v_indptr"):
        r.workspace_size(qo_indptr, kv_indptr, 4, 2, 16, v_indptr=np.array([0, 4, 14], np.int32))


def test_decode_q_len_per_req_longer_than_kv_raises(rng):
    """q_len_per_req rows need that many keys already in the cache (as FlashInfer); empty requests (graph padding)
    are allowed."""
    cache, indptr, indices, last, _ = make_paged(rng, [6, 2, 0, 9], 4, 2, 16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(workspace())
    with pytest.raises(ValueError, match="request 1 has kv_len=2"):
        w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", q_len_per_req=3)
    cache, indptr, indices, last, _ = make_paged(rng, [6, 3, 0, 9], 4, 2, 16)
    w.plan(indptr, indices, last, 4, 2, 16, 4, q_data_type="float32", q_len_per_req=3)
    q = rng.standard_normal((4 * 3, 4, 16)).astype(np.float32)
    o = w.run(q, cache)
    assert np.all(o[6:9] == 0) and np.all(np.isfinite(o))
