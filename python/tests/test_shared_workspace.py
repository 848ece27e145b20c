"""Wrappers sharing one float workspace buffer, as engines use FlashInfer (vLLM: one buffer for its prefill, decode
and cascade wrappers; SGLang: one global buffer, and two decode wrappers for sliding-window models). The batch
wrappers keep their plans in their own plan memory and only their split-KV partials in the float workspace (the C
workspace's scratch region); the block-sparse planners keep their plans in the float workspace, so a run of theirs
must not use a work list another wrapper's plan or run wrote over."""

import numpy as np
import pytest

import kvattn
from conftest import workspace
from reference import TOL, assert_close, attention, gather_kv, make_paged

HQ, HKV, D, PS = 8, 2, 32, 16


def _window_table(indptr, indices, lens):
    """A second page table over the same pool: the first pages of each request (a shorter KV length)."""
    ip, ix, last = [0], [], []
    for b, n in enumerate(lens):
        pages = (n + PS - 1) // PS
        ix += list(indices[indptr[b]:indptr[b] + pages])
        ip.append(len(ix))
        last.append((n - 1) % PS + 1 if n else 1)
    return np.array(ip, np.int32), np.array(ix, np.int32), np.array(last, np.int32)


def _check_decode(o, lse, q, cache, indptr, indices, lens, what):
    atol, rtol = TOL["float32"]
    for b, n in enumerate(lens):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, n)
        ro, rl = attention(q[b:b + 1], k, v)
        assert_close(o[b], ro[0], atol, rtol, "%s o[%d]" % (what, b))
        assert_close(lse[b], rl[0], atol, rtol, "%s lse[%d]" % (what, b))


def test_two_decode_wrappers_with_the_same_batch_size_share_a_workspace(rng):
    # Same batch size and work-item counts: the second plan's work list fits the first plan's checks, so the first
    # wrapper's runs used to attend over the second table's KV ranges (wrong output, no error).
    full, part = [100, 50, 30], [20, 10, 5]
    print("shared workspace: decode over kv lens %s and %s, one float workspace" % (full, part))
    cache, indptr, indices, last, _ = make_paged(rng, full, PS, HKV, D)
    ip2, ix2, last2 = _window_table(indptr, indices, part)
    ws = workspace()
    a = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    b = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    a.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type="float32")
    b.plan(ip2, ix2, last2, HQ, HKV, D, PS, q_data_type="float32")
    q = rng.standard_normal((3, HQ, D)).astype(np.float32)
    for step in range(2):  # layer after layer, alternating wrappers
        o, lse = a.run(q, cache, return_lse=True)
        _check_decode(o, lse, q, cache, indptr, indices, full, "wrapper a, layer %d" % step)
        o, lse = b.run(q, cache, return_lse=True)
        _check_decode(o, lse, q, cache, ip2, ix2, part, "wrapper b, layer %d" % step)


def test_prefill_decode_ragged_and_block_sparse_share_a_workspace(rng):
    # vLLM-style: prefill and decode wrappers planned for one step, then run layer after layer; plus the ragged and
    # block-sparse wrappers on the same buffer. Each used to fail with PlanMismatchError after another's plan.
    dec_lens, pre_lens = [70, 5, 130], [40, 90]
    print("shared workspace: decode %s, paged prefill %s, ragged, block-sparse" % (dec_lens, pre_lens))
    cache, indptr, indices, last, _ = make_paged(rng, dec_lens + pre_lens, PS, HKV, D)
    d_ip, d_last = indptr[:4], last[:3]
    d_ix = indices[:d_ip[-1]]
    p_ip, p_last = (indptr[3:] - indptr[3]).astype(np.int32), last[3:]
    p_ix = indices[indptr[3]:indptr[-1]]
    qo = np.array([0, 7, 30], np.int32)
    kvi = np.array([0, 12, 40], np.int32)
    ws = workspace()
    dec = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    pre = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws)
    rag = kvattn.BatchPrefillWithRaggedKVCacheWrapper(ws)
    bsr = kvattn.BlockSparseAttentionWrapper(ws)
    dec.plan(d_ip, d_ix, d_last, HQ, HKV, D, PS, q_data_type="float32")
    pre.plan(qo, p_ip, p_ix, p_last, HQ, HKV, D, PS, causal=True, q_data_type="float32")
    rag.plan(qo, kvi, HQ, HKV, D, causal=True, q_data_type="float32")
    bip, bix = np.array([0, 1, 3], np.int32), np.array([0, 0, 1], np.int32)
    bsr.plan(bip, bix, 32, 32, 16, 16, HQ, HKV, D, causal=True, q_data_type="float32", o_data_type="float32")
    qd = rng.standard_normal((3, HQ, D)).astype(np.float32)
    qp = rng.standard_normal((30, HQ, D)).astype(np.float32)
    k = rng.standard_normal((40, HKV, D)).astype(np.float32)
    v = rng.standard_normal((40, HKV, D)).astype(np.float32)
    qs = rng.standard_normal((32, HQ, D)).astype(np.float32)
    atol, rtol = TOL["float32"]
    for step in range(2):
        o, lse = dec.run(qd, cache, return_lse=True)
        _check_decode(o, lse, qd, cache, d_ip, d_ix, dec_lens, "decode, layer %d" % step)
        o = pre.run(qp, cache)
        for b, n in enumerate(pre_lens):
            kk, vv = gather_kv(cache[:, 0], cache[:, 1], p_ip, p_ix, b, n)
            ro, _ = attention(qp[qo[b]:qo[b + 1]], kk, vv, causal=True)
            assert_close(o[qo[b]:qo[b + 1]], ro, atol, rtol, "paged prefill request %d, layer %d" % (b, step))
        o = rag.run(qp, k, v)
        for b in range(2):
            ro, _ = attention(qp[qo[b]:qo[b + 1]], k[kvi[b]:kvi[b + 1]], v[kvi[b]:kvi[b + 1]], causal=True)
            assert_close(o[qo[b]:qo[b + 1]], ro, atol, rtol, "ragged request %d, layer %d" % (b, step))
        o = bsr.run(qs, k[:32], v[:32])
        ro, _ = attention(qs, k[:32], v[:32], causal=True)
        assert_close(o, ro, atol, rtol, "block-sparse, layer %d" % step)


def test_variable_block_sparse_shares_a_workspace_with_decode(rng):
    lens = [60, 9]
    cache, indptr, indices, last, _ = make_paged(rng, lens, PS, HKV, D)
    ws = workspace()
    dec = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    vb = kvattn.VariableBlockSparseAttentionWrapper(ws)
    M = N = 24
    bm = np.ones((HKV, 2, 3), bool)
    rs = np.full((HKV, 2), 12, np.int32)
    cs = np.full((HKV, 3), 8, np.int32)
    vb.plan(bm, rs, cs, HQ, HKV, D, causal=True, q_data_type="float32", o_data_type="float32")
    dec.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type="float32")
    q = rng.standard_normal((HQ, M, D)).astype(np.float32)
    k = rng.standard_normal((HKV, N, D)).astype(np.float32)
    v = rng.standard_normal((HKV, N, D)).astype(np.float32)
    qd = rng.standard_normal((2, HQ, D)).astype(np.float32)
    g = HQ // HKV
    atol, rtol = TOL["float32"]
    for step in range(2):
        o = vb.run(q, k, v)
        for h in range(HQ):
            ro, _ = attention(q[h][:, None], k[h // g][:, None], v[h // g][:, None], causal=True)
            assert_close(o[h], ro[:, 0], atol, rtol, "variable block-sparse head %d, layer %d" % (h, step))
        o, lse = dec.run(qd, cache, return_lse=True)
        _check_decode(o, lse, qd, cache, indptr, indices, lens, "decode, layer %d" % step)


def test_disjoint_slices_do_not_replan(rng):
    # Wrappers on separate slices of one buffer (as the cascade wrapper makes) keep their plans: no re-plan at run.
    lens = [33, 7]
    cache, indptr, indices, last, _ = make_paged(rng, lens, PS, HKV, D)
    buf = workspace()
    half = buf.size // 2
    a = kvattn.BatchDecodeWithPagedKVCacheWrapper(buf[:half])
    b = kvattn.BatchDecodeWithPagedKVCacheWrapper(buf[half:])
    a.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type="float32")
    b.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type="float32")
    commit_a, commit_b = a._state.commit, b._state.commit
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    for _ in range(2):
        a.run(q, cache)
        b.run(q, cache)
    assert a._state.commit is commit_a and b._state.commit is commit_b


def test_split_kv_wrappers_share_the_float_workspace_without_replanning(rng):
    """Decode wrappers with split KV (partials in the shared float workspace) and a paged prefill wrapper, run
    alternately layer after layer: every run is right and no wrapper plans again (its plan is in its own memory)."""
    lens, part = [300, 170, 9], [120, 40, 9]
    print("shared workspace, split KV: decode over %s and %s (fixed split of 2 pages), paged prefill" % (lens, part))
    cache, indptr, indices, last, _ = make_paged(rng, lens, PS, HKV, D)
    ip2, ix2, last2 = _window_table(indptr, indices, part)
    ws = workspace()
    a = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    b = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    pre = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws)
    a.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type="float32", fixed_split_size=2)
    b.plan(ip2, ix2, last2, HQ, HKV, D, PS, q_data_type="float32", fixed_split_size=3)
    qo = np.array([0, 5, 8, 9], np.int32)
    pre.plan(qo, indptr, indices, last, HQ, HKV, D, PS, causal=True, q_data_type="float32", fixed_split_size=2)
    for w in (a, b, pre):
        assert w._state.scratch_bytes > 0, "the plan should have split-KV partials in the float workspace"
    commits = [w._state.commit for w in (a, b, pre)]
    q = rng.standard_normal((3, HQ, D)).astype(np.float32)
    qp = rng.standard_normal((9, HQ, D)).astype(np.float32)
    atol, rtol = TOL["float32"]
    for step in range(3):
        o, lse = a.run(q, cache, return_lse=True)
        _check_decode(o, lse, q, cache, indptr, indices, lens, "wrapper a, layer %d" % step)
        o = pre.run(qp, cache)
        for r in range(3):
            kk, vv = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, r, lens[r])
            ro, _ = attention(qp[qo[r]:qo[r + 1]], kk, vv, causal=True)
            assert_close(o[qo[r]:qo[r + 1]], ro, atol, rtol, "prefill request %d, layer %d" % (r, step))
        o, lse = b.run(q, cache, return_lse=True)
        _check_decode(o, lse, q, cache, ip2, ix2, part, "wrapper b, layer %d" % step)
    assert [w._state.commit for w in (a, b, pre)] == commits, "a wrapper planned again"


def test_block_sparse_plan_is_rewritten_after_split_kv_runs_in_its_bytes(rng):
    """A block-sparse plan lives in the float workspace; a decode run with split KV writes its partials there: the
    block-sparse run then writes its plan again (and is right), the decode wrapper keeps its plan."""
    lens = [400, 64]
    cache, indptr, indices, last, _ = make_paged(rng, lens, PS, HKV, D)
    ws = workspace()
    bsr = kvattn.BlockSparseAttentionWrapper(ws)
    dec = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    bip, bix = np.array([0, 1, 3], np.int32), np.array([0, 0, 1], np.int32)
    bsr.plan(bip, bix, 32, 32, 16, 16, HQ, HKV, D, causal=True, q_data_type="float32", o_data_type="float32")
    dec.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type="float32", fixed_split_size=2)
    dcommit = dec._state.commit
    qs = rng.standard_normal((32, HQ, D)).astype(np.float32)
    k = rng.standard_normal((32, HKV, D)).astype(np.float32)
    v = rng.standard_normal((32, HKV, D)).astype(np.float32)
    qd = rng.standard_normal((2, HQ, D)).astype(np.float32)
    atol, rtol = TOL["float32"]
    ro, _ = attention(qs, k, v, causal=True)
    for step in range(2):
        o, lse = dec.run(qd, cache, return_lse=True)
        _check_decode(o, lse, qd, cache, indptr, indices, lens, "decode, layer %d" % step)
        assert_close(bsr.run(qs, k, v), ro, atol, rtol, "block-sparse, layer %d" % step)
    assert dec._state.commit is dcommit


def test_block_sparse_plan_state_is_freed_with_its_wrapper():
    """The process-wide record of who wrote the float workspace holds a token, not the plan: a dropped block-sparse
    wrapper's plan state (with its index and mask copies) is freed at once."""
    import gc
    import weakref

    ws = workspace()
    refs = []
    for cls, plan in ((kvattn.BlockSparseAttentionWrapper,
                       lambda w: w.plan(np.array([0, 1, 3], np.int32), np.array([0, 0, 1], np.int32), 32, 32, 16, 16,
                                        HQ, HKV, D, q_data_type="float32", o_data_type="float32")),
                      (kvattn.VariableBlockSparseAttentionWrapper,
                       lambda w: w.plan(np.ones((HKV, 2, 2), bool), np.full((HKV, 2), 16, np.int32),
                                        np.full((HKV, 2), 16, np.int32), HQ, HKV, D, q_data_type="float32",
                                        o_data_type="float32"))):
        w = cls(ws)
        plan(w)
        refs.append(weakref.ref(w._state))
        del w
    gc.collect()
    assert all(r() is None for r in refs)
