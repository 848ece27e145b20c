"""FlashInfer-style tests of the "formats" half of the API: MultiLevelCascadeAttentionWrapper (shared-prefix
cascades over one paged pool), BlockSparseAttentionWrapper / VariableBlockSparseAttentionWrapper (BSR and
per-head variable blocks), the page helpers (append_paged_kv_cache, get_batch_indices_positions, get_seq_lens),
packbits / segment_packbits and the enums of kvattn.utils, called the way code written against FlashInfer calls
them (argument names, positional order, defaults, the examples of FlashInfer's own docstrings).

Every output is compared with a float64 reference from the math in reference.py (base-2 LSE, bottom-right causal,
little bit order for packed masks); page helpers and bit packing are compared exactly. CPU backend, NumPy arrays;
torch is not needed. test_flashinfer_style.py covers batch decode / batch prefill / single / merge_state.

Differences from FlashInfer that are intentional are pinned by tests named test_documented_difference_* (and
described in python/README.md)."""

import numpy as np
import pytest

import kvattn
from conftest import workspace
from reference import (LN2, TOL, alibi_slopes, assert_close, attention, bsr_dense_visible, bsr_random, gather_kv,
                       merge)

LSE_TOL = (2e-3, 1e-3)


def _name(dtype):
    return np.dtype(dtype).name


# ------------------------------------------------------------------------------------------------------------------
# MultiLevelCascadeAttentionWrapper
#
# A cascade of L levels over one paged pool: level 0 is one shared prefix over every request, a middle level (L = 3)
# a prefix shared by a contiguous group of requests, the last level each request's own KV. Level l groups the query
# rows by its own qo_indptr; only the last level is causal. Request b's full KV is the concatenation of its groups'
# KV across the levels.


def _groups(L, B):
    """Per level, the contiguous groups of requests [start, end)."""
    levels = [[(0, B)]]
    if L == 3:
        k = max(1, B // 2)
        levels.append([(0, k), (k, B)] if k < B else [(0, B)])
    levels.append([(b, b + 1) for b in range(B)])
    return levels


def _cascade(rng, L, qo_lens, kv_lens, ps, hkv, d, dtype, layout, form, empty_last=(0, 1)):
    """kv_lens[l][g]: KV length of group g of level l. Returns (paged cache, plan arrays per level, per-level
    per-group K/V in float64, groups). Empty groups get last_page_len empty_last[g % 2] (0 or 1: both mean
    length 0)."""
    B = len(qo_lens)
    groups = _groups(L, B)
    pages = [[(n + ps - 1) // ps for n in lv] for lv in kv_lens]
    P = sum(sum(p) for p in pages) + 3
    perm = rng.permutation(P).astype(np.int32)
    shape = (P, 2, ps, hkv, d) if layout == "NHD" else (P, 2, hkv, ps, d)
    cache = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    kpool, vpool = cache[:, 0], cache[:, 1]
    paged = (np.ascontiguousarray(kpool), np.ascontiguousarray(vpool)) if form == "tuple" else cache
    qo_cum = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    arrs = {"qo": [], "indptr": [], "indices": [], "last": []}
    kv = []
    off = 0
    for l, lv in enumerate(groups):
        arrs["qo"].append(np.array([qo_cum[s] for s, _ in lv] + [qo_cum[lv[-1][1]]], np.int32))
        indptr = np.concatenate([[0], np.cumsum(pages[l])]).astype(np.int32)
        indices = perm[off:off + int(indptr[-1])]
        off += int(indptr[-1])
        last = np.array([((n - 1) % ps) + 1 if n > 0 else empty_last[g % len(empty_last)]
                         for g, n in enumerate(kv_lens[l])], np.int32)
        arrs["indptr"].append(indptr)
        arrs["indices"].append(indices)
        arrs["last"].append(last)
        kv.append([gather_kv(kpool, vpool, indptr, indices, g, n, layout) for g, n in enumerate(kv_lens[l])])
    return paged, arrs, kv, groups


def _flat_reference(q, qo_lens, kv, groups, **kw):
    """Attention of every request over the concatenation of its groups' KV (causal bottom-right over the whole)."""
    os_, ls_ = [], []
    r0 = 0
    for b, n in enumerate(qo_lens):
        ks, vs = [], []
        for l, lv in enumerate(groups):
            g = next(i for i, (s, e) in enumerate(lv) if s <= b < e)
            ks.append(kv[l][g][0])
            vs.append(kv[l][g][1])
        o, s = attention(q[r0:r0 + n], np.concatenate(ks), np.concatenate(vs), **kw)
        os_.append(o)
        ls_.append(s)
        r0 += n
    return np.concatenate(os_), np.concatenate(ls_)


def _per_level_reference(q, arrs, kv, groups, causal, **kw):
    """FlashInfer's composition: each level is a batch prefill whose requests are the level's groups (query rows
    qo_indptr[g]:qo_indptr[g+1], positions bottom-right within the group's own KV), merged through base-2 LSE."""
    o = np.zeros(q.shape[:2] + (kv[0][0][1].shape[-1],))
    s = np.full(q.shape[:2], -np.inf)
    for l, lv in enumerate(groups):
        qo = arrs["qo"][l]
        for g in range(len(lv)):
            rs = slice(int(qo[g]), int(qo[g + 1]))
            if rs.stop == rs.start:
                continue
            og, sg = attention(q[rs], kv[l][g][0], kv[l][g][1], causal=causal and l == len(groups) - 1, **kw)
            o[rs], s[rs] = merge(o[rs], s[rs], og, sg)
    return o, s


def _random_kv_lens(rng, L, B, qo_lens, ps, causal):
    groups = _groups(L, B)
    kvl = []
    for l, lv in enumerate(groups):
        if l == len(groups) - 1:
            # causal: the unique KV holds at least the request's own query rows (cascade == flat only then)
            kvl.append([int(rng.integers(qo_lens[b] if causal else 0, 3 * ps + 2)) + (1 if causal else 0)
                        for b in range(B)])
        else:
            kvl.append([int(rng.integers(1, 5 * ps + 3)) for _ in lv])
    return kvl


CASCADE_CASES = [(L, layout, form, mode) for L in (2, 3) for layout in ("NHD", "HND") for form in ("5d", "tuple")
                 for mode in ("decode", "prefill_causal", "prefill")]


@pytest.mark.parametrize("L,layout,form,mode", CASCADE_CASES)
def test_cascade_shared_prefix_equals_flat_attention(rng, L, layout, form, mode):
    i = CASCADE_CASES.index((L, layout, form, mode))
    ps = (1, 4, 16)[i % 3]
    B = (1, 5, 7)[(i // 3) % 3]
    hkv, g, d = [(2, 2, 64), (1, 4, 128), (2, 3, 64), (4, 1, 128)][i % 4]
    dtype = np.float16 if i % 2 else np.float32
    causal = mode == "prefill_causal"
    qo_lens = [1] * B if mode == "decode" else [int(x) for x in rng.integers(1, 6, size=B)]
    kv_lens = _random_kv_lens(rng, L, B, qo_lens, ps, causal)
    case = "L=%d %s %s %s ps=%d B=%d hkv=%d g=%d d=%d %s qo=%s kv=%s" % (
        L, layout, form, mode, ps, B, hkv, g, d, _name(dtype), qo_lens, kv_lens)
    paged, arrs, kv, groups = _cascade(rng, L, qo_lens, kv_lens, ps, hkv, d, dtype, layout, form)
    q = rng.standard_normal((sum(qo_lens), hkv * g, d)).astype(dtype)
    w = kvattn.MultiLevelCascadeAttentionWrapper(L, workspace(), layout)
    w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], hkv * g, hkv, d, ps, causal=causal,
           q_data_type=_name(dtype))
    o = w.run(q, paged)
    assert not isinstance(o, tuple) and o.dtype == dtype and o.shape == q.shape, case
    ro, _ = _flat_reference(np.asarray(q, np.float64), qo_lens, kv, groups, causal=causal)
    atol, rtol = TOL[_name(dtype)]
    assert_close(o, ro, atol, rtol, case)
    # the plan serves every layer: a second q on the same plan
    q2 = rng.standard_normal(q.shape).astype(dtype)
    ro2, _ = _flat_reference(np.asarray(q2, np.float64), qo_lens, kv, groups, causal=causal)
    assert_close(w.run(q2, paged), ro2, atol, rtol, case + " (second layer)")


def test_cascade_levels_share_the_float_workspace(rng):
    """FlashInfer gives every level's wrapper the whole float workspace buffer; so does kvattn (each level's plan is
    in its wrapper's own plan memory, the buffer holds a run's split-KV partials only while that run executes). A
    buffer that fits the largest level's needs serves all three levels."""
    L, B, ps, hkv, g, d = 3, 4, 16, 2, 4, 64
    qo_lens = [1, 3, 2, 1]
    kv_lens = [[700], [300, 90], [40, 7, 160, 3]]
    paged, arrs, kv, groups = _cascade(rng, L, qo_lens, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    need = 0
    for l in range(L):
        probe = kvattn.BatchPrefillWithPagedKVCacheWrapper(workspace())
        fb, _ = probe.workspace_size(arrs["qo"][l], arrs["indptr"][l], arrs["indices"][l], arrs["last"][l],
                                     hkv * g, hkv, d, ps, causal=l == L - 1, q_data_type="float32")
        need = max(need, fb)
    buf = np.zeros(need + 256, np.uint8)  # + the 256-byte alignment of the buffer's start
    w = kvattn.MultiLevelCascadeAttentionWrapper(L, buf, "NHD")
    w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], hkv * g, hkv, d, ps, causal=True,
           q_data_type="float32")
    q = rng.standard_normal((sum(qo_lens), hkv * g, d)).astype(np.float32)
    ro, _ = _flat_reference(np.asarray(q, np.float64), qo_lens, kv, groups, causal=True)
    assert_close(w.run(q, paged), ro, *TOL["float32"], "cascade in a %d-byte buffer" % buf.size)


def test_cascade_flashinfer_docstring_call(rng):
    """FlashInfer's docstring example, shrunk: 2 levels, shared pages 0..S-1 (full last page), unique pages
    S..S+U-1 with indptr [0, 17, 29, ...], every argument positional as FlashInfer lists it, q_data_type left at
    its float16 default, one plan for several layers (the example's kv_cache_at_layer loop)."""
    ps, hq, hkv, d, B = 4, 8, 2, 64, 7
    S = 9
    unique_indptr = np.array([0, 5, 7, 10, 11, 13, 17, 20], np.int32)
    U = int(unique_indptr[-1])
    unique_last = np.array([1, 3, 4, 2, 3, 1, 4], np.int32)
    layers = [rng.standard_normal((S + U, 2, ps, hkv, d)).astype(np.float16) for _ in range(3)]
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, workspace(), "NHD")
    w.plan([np.array([0, B], np.int32), np.arange(B + 1, dtype=np.int32)],
           [np.array([0, S], np.int32), unique_indptr],
           [np.arange(S, dtype=np.int32), np.arange(S, S + U, dtype=np.int32)],
           [np.array([ps], np.int32), unique_last],
           hq, hkv, d, ps)
    for li, cache in enumerate(layers):
        q = rng.standard_normal((B, hq, d)).astype(np.float16)
        o = w.run(q, cache)
        assert o.shape == (B, hq, d) and o.dtype == np.float16
        for b in range(B):
            pages = np.concatenate([np.arange(S), S + np.arange(unique_indptr[b], unique_indptr[b + 1])])
            n = (len(pages) - 1) * ps + int(unique_last[b])
            k = cache[pages, 0].astype(np.float64).reshape(-1, hkv, d)[:n]
            v = cache[pages, 1].astype(np.float64).reshape(-1, hkv, d)[:n]
            ro, _ = attention(q[b:b + 1], k, v)
            assert_close(o[b:b + 1], ro, *TOL["float16"], "layer %d request %d" % (li, b))


def test_cascade_plan_positional_flashinfer_order(rng):
    """plan(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len, num_qo_heads,
    num_kv_heads, head_dim, page_size, causal, pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left,
    logits_soft_cap, rope_scale, rope_theta, q_data_type, kv_data_type) all positional; sm_scale and soft cap
    do not depend on positions, so the cascade still equals flat attention; begin_forward / forward /
    end_forward are the deprecated aliases."""
    L, ps, hkv, g, d = 3, 4, 2, 2, 64
    qo_lens = [2, 3, 1, 4]
    kv_lens = _random_kv_lens(rng, L, len(qo_lens), qo_lens, ps, True)
    paged, arrs, kv, groups = _cascade(rng, L, qo_lens, kv_lens, ps, hkv, d, np.float32, "HND", "5d")
    q = rng.standard_normal((sum(qo_lens), hkv * g, d)).astype(np.float32)
    w = kvattn.MultiLevelCascadeAttentionWrapper(L, workspace(), "HND")
    w.begin_forward(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], hkv * g, hkv, d, ps,
                    True, "NONE", False, 0.07, -1, 3.0, None, None, "float32", "float32")
    o = w.forward(q, paged)
    w.end_forward()
    ro, _ = _flat_reference(q, qo_lens, kv, groups, causal=True, sm_scale=0.07, logits_soft_cap=3.0)
    assert_close(o, ro, *TOL["float32"], "positional plan, kv_lens=%s" % kv_lens)


@pytest.mark.parametrize("feature", [dict(window_left=5), dict(pos_encoding_mode="ROPE_LLAMA"),
                                     dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5, rope_scale=2.0),
                                     dict(window_left=3, logits_soft_cap=4.0)])
def test_cascade_position_features_apply_per_level(rng, feature):
    """window_left and fused RoPE see each level as its own paged prefill (as FlashInfer composes the cascade):
    a level's query rows sit bottom-right in that level's KV, so the result is the per-level attention merged by
    LSE, not attention over the concatenated KV."""
    L, ps, hkv, g, d = 3, 4, 2, 2, 64
    qo_lens = [1, 3, 2, 2, 1]
    kv_lens = _random_kv_lens(rng, L, len(qo_lens), qo_lens, ps, True)
    paged, arrs, kv, groups = _cascade(rng, L, qo_lens, kv_lens, ps, hkv, d, np.float32, "NHD", "tuple")
    q = rng.standard_normal((sum(qo_lens), hkv * g, d)).astype(np.float32)
    w = kvattn.MultiLevelCascadeAttentionWrapper(L, workspace())
    w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], hkv * g, hkv, d, ps, causal=True,
           q_data_type="float32", **feature)
    o = w.run(q, paged)
    ref_kw = dict(feature)
    if "pos_encoding_mode" in ref_kw:
        ref_kw["pos_encoding"] = ref_kw.pop("pos_encoding_mode")
    ro, _ = _per_level_reference(q, arrs, kv, groups, True, **ref_kw)
    assert_close(o, ro, *TOL["float32"], "%s kv_lens=%s" % (feature, kv_lens))


def test_cascade_empty_groups_and_levels(rng):
    """A group with no pages (indptr entries equal; last_page_len 0 or 1) contributes nothing: its rows keep the
    other levels' attention; a whole empty level changes nothing; rows without any key get o = 0."""
    ps, hkv, g, d = 4, 2, 2, 64
    qo_lens = [1, 2, 1, 3]
    # level 0: empty shared prefix; level 1: group 1 empty; level 2: requests 0 and 2 have no unique KV
    kv_lens = [[0], [9, 0], [0, 5, 0, 7]]
    paged, arrs, kv, groups = _cascade(rng, 3, qo_lens, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    q = rng.standard_normal((sum(qo_lens), hkv * g, d)).astype(np.float32)
    w = kvattn.MultiLevelCascadeAttentionWrapper(3, workspace())
    w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], hkv * g, hkv, d, ps, q_data_type="float32")
    o = w.run(q, paged)
    ro, _ = _flat_reference(q, qo_lens, kv, groups)
    assert_close(o, ro, *TOL["float32"], "empty groups, last_page_len 0/1 for empty, kv=%s" % kv_lens)
    rows_req2 = slice(sum(qo_lens[:2]), sum(qo_lens[:3]))  # request 2: group 1 of level 1 (empty) + nothing
    assert np.all(o[rows_req2] == 0) and np.all(np.isfinite(o))
    # the same batch with the empty prefix level dropped (2 levels) gives the same output
    w2 = kvattn.MultiLevelCascadeAttentionWrapper(2, workspace())
    w2.plan(arrs["qo"][1:], arrs["indptr"][1:], arrs["indices"][1:], arrs["last"][1:], hkv * g, hkv, d, ps,
            q_data_type="float32")
    assert_close(w2.run(q, paged), o, 1e-6, 1e-6, "2 levels vs 3 with an empty level 0")


def test_cascade_shared_prefix_with_partial_last_page_and_replan(rng):
    """The shared level may end in a partial page (last_page_len < page_size); a re-plan for the next step (one
    more token per request, the decode loop) reuses the wrapper."""
    ps, hkv, g, d = 16, 1, 8, 128
    qo_lens = [1] * 6
    paged, arrs, kv, groups = _cascade(rng, 2, qo_lens, [[37], [5, 16, 17, 1, 33, 0]], ps, hkv, d, np.float16,
                                       "HND", "tuple")
    assert arrs["last"][0].tolist() == [5]
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, workspace(), "HND")
    for step in range(2):
        if step:
            paged, arrs, kv, groups = _cascade(rng, 2, qo_lens, [[37], [6, 17, 18, 2, 34, 1]], ps, hkv, d,
                                               np.float16, "HND", "tuple")
        q = rng.standard_normal((6, hkv * g, d)).astype(np.float16)
        w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], hkv * g, hkv, d, ps)
        ro, _ = _flat_reference(q, qo_lens, kv, groups)
        assert_close(w.run(q, paged), ro, *TOL["float16"], "step %d" % step)


def test_cascade_long_shared_prefix_decode(rng):
    """A 4096-token shared prefix (split over several KV chunks inside level 0) over a decode batch, float16 with
    the default q_data_type: equal to flat attention over prefix + unique pages."""
    ps, hkv, g, d, B = 16, 2, 4, 128, 4
    S = 4096 // ps
    unique_last = np.array([3, 16, 1, 9], np.int32)
    cache = rng.standard_normal((S + 2 * B + 2, 2, ps, hkv, d)).astype(np.float16)
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, workspace(64 << 20))
    w.plan([np.array([0, B], np.int32), np.arange(B + 1, dtype=np.int32)],
           [np.array([0, S], np.int32), np.arange(0, 2 * B + 1, 2, dtype=np.int32)],
           [np.arange(S, dtype=np.int32), np.arange(S, S + 2 * B, dtype=np.int32)],
           [np.array([ps], np.int32), unique_last], hkv * g, hkv, d, ps)
    q = rng.standard_normal((B, hkv * g, d)).astype(np.float16)
    o = w.run(q, cache)
    for b in range(B):
        pages = np.concatenate([np.arange(S), S + 2 * b + np.arange(2)])
        n = (len(pages) - 1) * ps + int(unique_last[b])
        k = cache[pages, 0].astype(np.float64).reshape(-1, hkv, d)[:n]
        v = cache[pages, 1].astype(np.float64).reshape(-1, hkv, d)[:n]
        ro, _ = attention(q[b:b + 1], k, v)
        assert_close(o[b:b + 1], ro, *TOL["float16"], "request %d (kv_len %d)" % (b, n))


def test_cascade_argument_errors_and_workspace(rng):
    """Level lists of the wrong length raise ValueError (FlashInfer: zip(strict=True)); reset_workspace_buffer
    takes FlashInfer's (float_workspace_buffer, int_workspace_buffers) and the plan must be made again."""
    ps, hkv, d = 4, 1, 64
    paged, arrs, kv, groups = _cascade(rng, 2, [1, 1], [[6], [3, 2]], ps, hkv, d, np.float16, "NHD", "5d")
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, workspace())
    with pytest.raises(ValueError):
        w.plan(arrs["qo"][:1], arrs["indptr"], arrs["indices"], arrs["last"], 2, hkv, d, ps)
    with pytest.raises(ValueError):
        w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"] + [arrs["last"][0]], 2, hkv, d, ps)
    assert not w.is_cuda_graph_enabled
    w.reset_workspace_buffer(workspace(), [np.zeros(1 << 20, np.uint8)] * 2)
    w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], 2, hkv, d, ps)
    q = rng.standard_normal((2, 2, d)).astype(np.float16)
    ro, _ = _flat_reference(q, [1, 1], kv, groups)
    assert_close(w.run(q, paged), ro, *TOL["float16"], "after reset_workspace_buffer")


def test_documented_difference_cascade_alibi_merges_kvattn_lse(rng):
    """ALiBi per level: every level's output is FlashInfer's, but kvattn's LSE has no per-level offset
    slope * (kv_len - qo_len) / ln 2 (see test_flashinfer_style.test_documented_difference_alibi_lse_offset), so the
    levels are merged with other weights than FlashInfer's. kvattn's result is the per-level merge of its own
    convention (bias slope * (j - q_pos), q_pos bottom-right in the level)."""
    ps, hkv, g, d = 4, 2, 2, 64
    qo_lens = [1, 2, 1]
    kv_lens = _random_kv_lens(rng, 2, 3, qo_lens, ps, True)
    paged, arrs, kv, groups = _cascade(rng, 2, qo_lens, kv_lens, ps, hkv, d, np.float32, "NHD", "5d")
    q = rng.standard_normal((sum(qo_lens), hkv * g, d)).astype(np.float32)
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, workspace())
    w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], hkv * g, hkv, d, ps, causal=True,
           pos_encoding_mode="ALIBI", q_data_type="float32")
    o = w.run(q, paged)
    ro, _ = _per_level_reference(q, arrs, kv, groups, True, pos_encoding="ALIBI")
    assert_close(o, ro, *TOL["float32"], "ALiBi cascade, kv=%s" % kv_lens)
    # FlashInfer's merge: each level's LSE shifted by slope * (kv_len - qo_len) / ln 2 of its group
    slopes = alibi_slopes(hkv * g)
    of = np.zeros(o.shape)
    sf = np.full(o.shape[:2], -np.inf)
    for l, lv in enumerate(groups):
        qo = arrs["qo"][l]
        for gi in range(len(lv)):
            rs = slice(int(qo[gi]), int(qo[gi + 1]))
            og, sg = attention(q[rs], kv[l][gi][0], kv[l][gi][1], causal=l == 1, pos_encoding="ALIBI")
            shift = slopes[None, :] * (kv[l][gi][0].shape[0] - (rs.stop - rs.start)) / LN2
            of[rs], sf[rs] = merge(of[rs], sf[rs], og, sg + shift)
    assert np.abs(of - ro).max() > 1e-3  # the two conventions do give different outputs here


# ------------------------------------------------------------------------------------------------------------------
# BlockSparseAttentionWrapper


def _flashinfer_packed_bsr_mask(mask, indptr, M, R, C):
    """FlashInfer's plan(): the BSR mask [nnz, R, C] in its flattened layout (per block row,
    mask[e0:e1].transpose(1, 0, 2)), then kvattn.segment_packbits over the per-block-row bit segments of
    qo_len * kv_len bits (qo_len = R, or what is left of M for the last block row)."""
    flat = np.concatenate([mask[indptr[b]:indptr[b + 1]].transpose(1, 0, 2).reshape(-1)
                           for b in range(len(indptr) - 1)]) if mask.size else np.zeros(0, bool)
    seg = [min(R, M - b * R) * int(indptr[b + 1] - indptr[b]) * C for b in range(len(indptr) - 1)]
    mask_indptr = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
    packed, new_indptr = kvattn.segment_packbits(flat, mask_indptr, bitorder="little")
    assert new_indptr.dtype == np.int32 and new_indptr.tolist() == np.concatenate(
        [[0], np.cumsum([(s + 7) // 8 for s in seg])]).tolist()
    return packed


BSR_SHAPES = [(1, 1), (16, 16), (4, 8), (1, 16), (8, 4), (3, 5)]


@pytest.mark.parametrize("R,C", BSR_SHAPES)
@pytest.mark.parametrize("variant", ["plain", "mask", "packed_mask", "causal"])
def test_bsr_block_shapes_against_dense(rng, R, C, variant):
    i = BSR_SHAPES.index((R, C)) * 4 + ["plain", "mask", "packed_mask", "causal"].index(variant)
    M = R * int(rng.integers(1, 5)) + (0 if i % 3 == 0 else int(rng.integers(1, R + 1)) % R)
    M = max(M, 1)
    N = C * int(rng.integers(max(1, (M + C - 1) // C), max(2, (M + C - 1) // C) + 4))
    hkv, g, d = [(2, 2, 64), (1, 4, 128), (2, 1, 64)][i % 3]
    dtype = [np.float32, np.float16][i % 2]
    sm_scale = [None, 0.05, 0.2][i % 3]
    cap = [None, 6.0][(i // 2) % 2]
    indptr, indices = bsr_random(rng, M, N, R, C, 0.6)
    nnz = int(indptr[-1])
    emask = rng.random((nnz, R, C)) < 0.7 if variant in ("mask", "packed_mask") else None
    case = "R=%d C=%d %s M=%d N=%d hkv=%d g=%d d=%d %s sm_scale=%s cap=%s" % (
        R, C, variant, M, N, hkv, g, d, _name(dtype), sm_scale, cap)
    q = rng.standard_normal((M, hkv * g, d)).astype(dtype)
    k = rng.standard_normal((N, hkv, d)).astype(dtype)
    v = rng.standard_normal((N, hkv, d)).astype(dtype)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    kw = dict(causal=variant == "causal", logits_soft_cap=cap, sm_scale=sm_scale, q_data_type=_name(dtype),
              o_data_type=_name(dtype))
    if variant == "mask":
        kw["mask"] = emask
    elif variant == "packed_mask":
        kw["packed_mask"] = _flashinfer_packed_bsr_mask(emask, indptr, M, R, C)
        kw["causal"] = True  # a mask takes precedence over causal
    w.plan(indptr, indices, M, N, R, C, hkv * g, hkv, d, **kw)
    o, lse = w.run(q, k, v, return_lse=True)
    assert (w.M, w.N, w.R, w.C) == (M, N, R, C)
    vis = bsr_dense_visible(indptr, indices, M, N, R, C, emask, causal=variant == "causal")
    ro, rl = attention(q, k, v, mask=vis, sm_scale=sm_scale, logits_soft_cap=cap or 0.0)
    assert_close(o, ro, *TOL[_name(dtype)], case + ": o")
    assert_close(lse, rl, *LSE_TOL, case + ": lse")


def _flashinfer_gathered_causal(indptr, indices, M, N, R, C):
    """FlashInfer's fa2 causal for BSR: block row b is a request of qo_len rows over its gathered keys
    (indices in listed order, kv_len = blocks * C), causal bottom-right within that request."""
    vis = np.zeros((M, N), bool)
    for b in range(len(indptr) - 1):
        rows = min(R, M - b * R)
        cols = np.concatenate([np.arange(c * C, (c + 1) * C) for c in indices[indptr[b]:indptr[b + 1]]]) \
            if indptr[b + 1] > indptr[b] else np.zeros(0, int)
        kvl = cols.size
        for r in range(rows):
            seen = cols[:max(0, r + kvl - rows + 1)]
            vis[b * R + r, seen] = True
    return vis


def test_bsr_causal_lower_triangular_pattern_agrees_with_flashinfer(rng):
    """The usual causal block pattern (R == C, M == N, block row b lists column blocks 0..b in order): kvattn's
    dense causal mask and FlashInfer's per-block-row gathered causal mask coincide."""
    R = C = 8
    MB = 5
    M = N = R * MB
    indptr = np.concatenate([[0], np.cumsum(np.arange(1, MB + 1))]).astype(np.int32)
    indices = np.concatenate([np.arange(b + 1) for b in range(MB)]).astype(np.int32)
    dense = bsr_dense_visible(indptr, indices, M, N, R, C, causal=True)
    assert np.array_equal(dense, _flashinfer_gathered_causal(indptr, indices, M, N, R, C))
    q = rng.standard_normal((M, 4, 64)).astype(np.float16)
    k = rng.standard_normal((N, 2, 64)).astype(np.float16)
    v = rng.standard_normal((N, 2, 64)).astype(np.float16)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(indptr, indices, M, N, R, C, 4, 2, 64, causal=True)  # float16 defaults (q and o)
    o = w.run(q, k, v)
    assert o.dtype == np.float16
    ro, _ = attention(q, k, v, causal=True)
    assert_close(o, ro, *TOL["float16"], "lower-triangular BSR == dense causal")


def test_documented_difference_bsr_causal_is_over_the_dense_matrix(rng):
    """causal=True masks the dense [M, N] matrix bottom-right (key j visible to row i iff j <= i + N - M).
    FlashInfer applies causal per block row over the gathered keys, which differs when a block row does not list
    every column block up to its diagonal in order (here block row 1 lists only block 0, block row 2 lists
    blocks 2, 0 out of order): FlashInfer would hide keys that the dense causal mask shows."""
    R = C = 4
    M = N = 12
    indptr = np.array([0, 1, 2, 4], np.int32)
    indices = np.array([0, 0, 2, 0], np.int32)
    dense = bsr_dense_visible(indptr, indices, M, N, R, C, causal=True)
    fi = _flashinfer_gathered_causal(indptr, indices, M, N, R, C)
    assert not np.array_equal(dense, fi)
    q = rng.standard_normal((M, 2, 64)).astype(np.float32)
    k = rng.standard_normal((N, 2, 64)).astype(np.float32)
    v = rng.standard_normal((N, 2, 64)).astype(np.float32)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(indptr, indices, M, N, R, C, 2, 2, 64, causal=True, q_data_type="float32", o_data_type="float32")
    o, lse = w.run_return_lse(q, k, v)
    ro, rl = attention(q, k, v, mask=dense)
    assert_close(o, ro, *TOL["float32"], "dense causal")
    assert_close(lse, rl, *LSE_TOL, "dense causal lse")


def test_bsr_decode_like_rows_and_plan_positional(rng):
    """R = 1 (one query row per block row, FlashInfer's CUDA-core decode path when R * group < 4) with every plan
    argument positional in FlashInfer's order (indptr, indices, M, N, R, C, num_qo_heads, num_kv_heads, head_dim,
    mask, packed_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, sm_scale, rope_scale,
    rope_theta, q_data_type, kv_data_type, o_data_type, non_blocking); run(q, k, v, scale_q, scale_k, scale_v,
    out, lse, return_lse) positional; an empty block row gives o = 0, lse = -inf."""
    M, N, R, C, hq, hkv, d = 6, 64, 1, 16, 2, 1, 128
    indptr = np.array([0, 2, 2, 3, 7, 8, 10], np.int32)
    indices = np.array([3, 0, 1, 0, 1, 2, 3, 2, 1, 3], np.int32)
    q = rng.standard_normal((M, hq, d)).astype(np.float32)
    k = rng.standard_normal((N, hkv, d)).astype(np.float32)
    v = rng.standard_normal((N, hkv, d)).astype(np.float32)
    w = kvattn.BlockSparseAttentionWrapper(workspace(), "auto")
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, None, None, False, "NONE", False, 8.0, 0.1, None, None,
           "float32", "float32", "float32", True)
    out = np.full((M, hq, d), np.nan, np.float32)
    lse = np.full((M, hq), np.nan, np.float32)
    res = w.run(q, k, v, None, None, None, out, lse, True)
    assert res[0] is out and res[1] is lse
    vis = bsr_dense_visible(indptr, indices, M, N, R, C)
    ro, rl = attention(q, k, v, mask=vis, sm_scale=0.1, logits_soft_cap=8.0)
    assert_close(out, ro, *TOL["float32"], "R=1 o")
    assert_close(lse, rl, *LSE_TOL, "R=1 lse")
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)


def test_bsr_out_of_range_column_block_raises():
    """A column-block index >= N / C raises ValueError at plan() (FlashInfer: "indices out of bound")."""
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    with pytest.raises(ValueError):
        w.plan(np.array([0, 1], np.int32), np.array([2], np.int32), 4, 8, 4, 4, 2, 2, 16)
    with pytest.raises(ValueError):
        w.plan(np.array([0, 1], np.int32), np.array([-1], np.int32), 4, 8, 4, 4, 2, 2, 16)


def test_documented_difference_bsr_repeated_column_block_raises():
    """A column block listed twice in one block row raises InvalidArgumentError (a ValueError) at plan():
    FlashInfer would gather its keys twice (counting them twice in the softmax)."""
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    with pytest.raises(ValueError):
        w.plan(np.array([0, 2], np.int32), np.array([1, 1], np.int32), 4, 8, 4, 4, 1, 1, 16)


@pytest.mark.parametrize("mode", ["ROPE_LLAMA", "ALIBI"])
def test_documented_difference_bsr_no_fused_pos_encoding(mode):
    """FlashInfer's fa2 block-sparse path accepts ROPE_LLAMA / ALIBI; kvattn refuses them at plan()
    (NotImplementedError) rather than use positions it does not have (apply RoPE to q and k first)."""
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    with pytest.raises(NotImplementedError):
        w.plan(np.array([0, 1], np.int32), np.array([0], np.int32), 4, 4, 4, 4, 2, 2, 16, pos_encoding_mode=mode)
    v = kvattn.VariableBlockSparseAttentionWrapper(workspace())
    with pytest.raises(NotImplementedError):
        v.plan(np.ones((1, 1, 1), bool), np.array([[4]]), np.array([[4]]), 1, 1, 16, pos_encoding_mode=mode)


# ------------------------------------------------------------------------------------------------------------------
# VariableBlockSparseAttentionWrapper


def _vbsr_reference(q, k, v, rs, cs, bm, causal=False, **kw):
    """q [Hq, M, D], k/v [Hkv, N, D] (HND) -> o [Hq, M, D], lse [Hq, M], dense mask per KV head."""
    hq, M, _ = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    o = np.zeros(q.shape)
    lse = np.zeros((hq, M))
    for h in range(hkv):
        vis = bm[h][np.repeat(np.arange(len(rs[h])), rs[h])[:, None], np.repeat(np.arange(len(cs[h])), cs[h])[None]]
        ro, rl = attention(np.swapaxes(q[h * g:(h + 1) * g], 0, 1), np.swapaxes(k[h:h + 1], 0, 1),
                           np.swapaxes(v[h:h + 1], 0, 1), causal=causal, mask=vis, **kw)
        o[h * g:(h + 1) * g] = np.swapaxes(ro, 0, 1)
        lse[h * g:(h + 1) * g] = rl.T
    return o, lse


def test_variable_bsr_flashinfer_docstring_example(rng):
    """FlashInfer's docstring example: block_mask_map [[0,0,1],[1,0,1],[0,1,1]], block_row_sz [1,2,3],
    block_col_sz [3,1,2], seq_len 6, float16 by default (the output follows q's dtype)."""
    bm = np.array([[[0, 0, 1], [1, 0, 1], [0, 1, 1]]], bool)
    rs = np.array([[1, 2, 3]], np.int32)
    cs = np.array([[3, 1, 2]], np.int32)
    d = 128
    w = kvattn.VariableBlockSparseAttentionWrapper(workspace())
    w.plan(bm, rs, cs, 1, 1, d)
    q = rng.standard_normal((1, 6, d)).astype(np.float16)
    k = rng.standard_normal((1, 6, d)).astype(np.float16)
    v = rng.standard_normal((1, 6, d)).astype(np.float16)
    o = w.run(q, k, v)
    assert o.dtype == np.float16 and o.shape == (1, 6, d)
    ro, _ = _vbsr_reference(q, k, v, rs, cs, bm)
    assert_close(o, ro, *TOL["float16"], "docstring example")
    # the dense mask of the example, written out
    dense = np.array([[0, 0, 0, 0, 1, 1], [1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 1, 1],
                      [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]], bool)
    ro2, _ = attention(np.swapaxes(q, 0, 1), np.swapaxes(k, 0, 1), np.swapaxes(v, 0, 1), mask=dense)
    assert_close(o, np.swapaxes(ro2, 0, 1), *TOL["float16"], "docstring example (dense mask)")


def test_variable_bsr_positional_gqa_features(rng):
    """plan(block_mask_map, block_row_sz, block_col_sz, num_qo_heads, num_kv_heads, head_dim, causal,
    pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, sm_scale, rope_scale, rope_theta, non_blocking,
    q_data_type, kv_data_type) positional; query heads h*g .. h*g+g-1 follow KV head h's pattern; zero-sized
    blocks; return_lse gives lse [num_qo_heads, qo_len]."""
    hkv, g, d, M, N = 3, 2, 64, 23, 31
    rs = np.array([[5, 0, 10, 8], [6, 6, 6, 5], [23, 0, 0, 0]], np.int32)
    cs = np.array([[10, 11, 10], [1, 0, 30], [16, 8, 7]], np.int32)
    bm = rng.random((hkv, 4, 3)) < 0.6
    bm[2, 0] = [False, False, False]  # every row of head 2 sees nothing
    q = rng.standard_normal((hkv * g, M, d)).astype(np.float32)
    k = rng.standard_normal((hkv, N, d)).astype(np.float32)
    v = rng.standard_normal((hkv, N, d)).astype(np.float32)
    w = kvattn.VariableBlockSparseAttentionWrapper(workspace())
    w.plan(bm, rs, cs, hkv * g, hkv, d, False, "NONE", False, 5.0, 0.09, None, None, True, "float32", "float32")
    o, lse = w.run(q, k, v, return_lse=True)
    assert lse.shape == (hkv * g, M)
    ro, rl = _vbsr_reference(q, k, v, rs, cs, bm, sm_scale=0.09, logits_soft_cap=5.0)
    assert_close(o, ro, *TOL["float32"], "variable BSR o")
    assert_close(lse, rl, *LSE_TOL, "variable BSR lse")
    assert np.all(o[2 * g:] == 0) and np.all(lse[2 * g:] == -np.inf)


def test_documented_difference_variable_bsr_causal_is_over_the_dense_matrix(rng):
    """kvattn's causal=True is the dense bottom-right causal mask (intersected with the block map). FlashInfer
    makes each (KV head, block row) a request over its gathered key blocks and applies causal within it, which
    differs unless the row's gathered keys end at its diagonal."""
    bm = np.array([[[1, 0], [1, 1]]], bool)
    rs = np.array([[4, 4]], np.int32)
    cs = np.array([[4, 4]], np.int32)
    q = rng.standard_normal((1, 8, 32)).astype(np.float32)
    k = rng.standard_normal((1, 8, 32)).astype(np.float32)
    v = rng.standard_normal((1, 8, 32)).astype(np.float32)
    w = kvattn.VariableBlockSparseAttentionWrapper(workspace())
    w.plan(bm, rs, cs, 1, 1, 32, causal=True, q_data_type="float32")
    o = w.run(q, k, v)
    ro, _ = _vbsr_reference(q, k, v, rs, cs, bm, causal=True)
    assert_close(o, ro, *TOL["float32"], "variable BSR dense causal")
    # this pattern is the lower-triangular one: FlashInfer's gathered causal agrees (block row 1 gathers 0..7)
    fi = _flashinfer_gathered_causal(np.array([0, 1, 3]), np.array([0, 0, 1]), 8, 8, 4, 4)
    assert np.array_equal(fi, bsr_dense_visible(np.array([0, 1, 3]), np.array([0, 0, 1]), 8, 8, 4, 4, causal=True))
    # but a block row that gathers only block 0 (row block 1 without its diagonal) does not
    fi = _flashinfer_gathered_causal(np.array([0, 1, 2]), np.array([0, 0]), 8, 8, 4, 4)
    assert not np.array_equal(fi, bsr_dense_visible(np.array([0, 1, 2]), np.array([0, 0]), 8, 8, 4, 4,
                                                    causal=True))


# ------------------------------------------------------------------------------------------------------------------
# Page helpers


def test_get_batch_indices_positions_flashinfer_docstring():
    """FlashInfer's docstring: append_indptr [0, 1, 3, 6, 10], seq_lens [5, 5, 5, 5] (lengths after the append),
    nnz 10 -> request of every new token and its absolute position seq_len - append_len + offset."""
    bi, pos = kvattn.get_batch_indices_positions(np.array([0, 1, 3, 6, 10], np.int32),
                                                 np.array([5, 5, 5, 5], np.int32), 10)
    assert bi.dtype == np.int32 and pos.dtype == np.int32
    assert bi.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]


def test_get_seq_lens_matches_flashinfer_formula():
    """(num_pages - 1) * page_size + last_page_len for requests with pages, int32."""
    indptr = np.array([0, 3, 4, 6, 8, 9], np.int32)
    last = np.array([13, 8, 9, 6, 16], np.int32)
    lens = kvattn.get_seq_lens(indptr, last, 16)
    assert lens.dtype == np.int32 and lens.tolist() == [45, 8, 25, 22, 16]


def test_get_seq_lens_refuses_a_length_past_int32():
    """A length that would wrap in int32 is a ValueError naming the request; INT32_MAX itself is returned."""
    ps = 1 << 20
    indptr = np.array([0, 1, 2049], np.int32)  # request 1: 2048 pages of 2^20 tokens
    lens = kvattn.get_seq_lens(indptr, np.array([5, ps - 1], np.int32), ps)
    assert lens.dtype == np.int32 and lens.tolist() == [5, 2147483647]
    with pytest.raises(ValueError, match="request 1 has 2147483648 KV tokens"):
        kvattn.get_seq_lens(indptr, np.array([5, ps], np.int32), ps)


def test_documented_difference_get_seq_lens_of_a_request_without_pages():
    """FlashInfer computes clamp(num_pages - 1, min=0) * page_size + last_page_len, so a request without pages gets
    its last_page_len (often 1 by convention) as length; kvattn returns 0, the length the attention wrappers use
    for such a request."""
    lens = kvattn.get_seq_lens(np.array([0, 0, 2, 2], np.int32), np.array([1, 3, 0], np.int32), 4)
    assert lens.tolist() == [0, 7, 0]  # FlashInfer: [1, 7, 0]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["5d", "tuple"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_append_paged_kv_cache_flashinfer_docstring(rng, layout, form, dtype):
    """FlashInfer's append example: 100 new tokens in requests of 45, 8, 25, 22 on pages of 16 (3, 1, 2, 2 pages,
    last_page_len 13, 8, 9, 6, here over a shuffled page table); every new token lands at its request's position
    bit for bit, and nothing else of the pool changes (other pages, slots past last_page_len)."""
    hkv, d, ps = 2, 8, 16
    lens = [45, 8, 25, 22]
    append_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kv_indptr = np.array([0, 3, 4, 6, 8], np.int32)
    kv_last = np.array([13, 8, 9, 6], np.int32)
    P = 12
    kv_indices = rng.permutation(P)[:8].astype(np.int32)
    nnz = 100
    k_app = rng.standard_normal((nnz, hkv, d)).astype(dtype)
    v_app = rng.standard_normal((nnz, hkv, d)).astype(dtype)
    shape = (P, 2, ps, hkv, d) if layout == "NHD" else (P, 2, hkv, ps, d)
    cache = rng.standard_normal(shape).astype(dtype)
    before = cache.copy()
    if form == "tuple":
        kc, vc = np.ascontiguousarray(cache[:, 0]), np.ascontiguousarray(cache[:, 1])
        paged = (kc, vc)
    else:
        paged = cache
        kc, vc = cache[:, 0], cache[:, 1]
    seq_lens = kvattn.get_seq_lens(kv_indptr, kv_last, ps)
    assert seq_lens.tolist() == lens
    bi, pos = kvattn.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    kvattn.append_paged_kv_cache(k_app, v_app, bi, pos, paged, kv_indices, kv_indptr, kv_last, layout)
    expect_k, expect_v = before[:, 0].copy(), before[:, 1].copy()
    for t in range(nnz):
        b, p = int(bi[t]), int(pos[t])
        page = kv_indices[kv_indptr[b] + p // ps]
        if layout == "NHD":
            expect_k[page, p % ps], expect_v[page, p % ps] = k_app[t], v_app[t]
        else:
            expect_k[page, :, p % ps], expect_v[page, :, p % ps] = k_app[t], v_app[t]
    case = "%s %s %s" % (layout, form, _name(dtype))
    assert np.array_equal(kc, expect_k), case
    assert np.array_equal(vc, expect_v), case


# ------------------------------------------------------------------------------------------------------------------
# packbits / segment_packbits


def test_packbits_flashinfer_docstring_and_truthiness():
    """packbits([1, 0, 1, 1, 0, 0, 1, 1]) == 0b10110011 (big bit order by default); "little" reverses the bits;
    any nonzero value (2, -1, 0.5, NaN) is a 1 bit, as FlashInfer's x.to(bool)."""
    x = np.array([1, 0, 1, 1, 0, 0, 1, 1], bool)
    assert kvattn.packbits(x).tolist() == [0b10110011]
    assert kvattn.packbits(x, bitorder="little").tolist() == [0b11001101]
    assert kvattn.packbits(x, "little").tolist() == [0b11001101]
    vals = np.array([2, -1, 0.5, np.nan, 0, 0, 0, 0, 3])
    out = kvattn.packbits(vals)
    assert out.dtype == np.uint8 and out.tolist() == [0b11110000, 0b10000000]


def test_segment_packbits_flashinfer_docstring():
    """x = [1,0,1,1, 0,0,1, 1,1,0,1], indptr [0, 4, 7, 11], big -> ['0b10110000', '0b100000', '0b11010000'],
    new_indptr [0, 1, 2, 3] (int32)."""
    x = np.array([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], bool)
    packed, new_indptr = kvattn.segment_packbits(x, np.array([0, 4, 7, 11], np.int32), bitorder="big")
    assert [bin(b) for b in packed.tolist()] == ["0b10110000", "0b100000", "0b11010000"]
    assert new_indptr.dtype == np.int32 and new_indptr.tolist() == [0, 1, 2, 3]


def test_segment_packbits_little_boundaries(rng):
    """Segments of 0, 1, 7, 8, 9, 16, 17 bits (and int64 indptr): each starts on a byte boundary, packed little;
    new_indptr[i+1] - new_indptr[i] == (len_i + 7) // 8."""
    lens = [0, 1, 7, 8, 0, 9, 16, 17, 3]
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    x = rng.random(int(indptr[-1])) < 0.5
    packed, new_indptr = kvattn.segment_packbits(x, indptr, bitorder="little")
    assert new_indptr.dtype == np.int32
    assert np.diff(new_indptr).tolist() == [(n + 7) // 8 for n in lens]
    for i, n in enumerate(lens):
        seg = packed[new_indptr[i]:new_indptr[i + 1]]
        bits = np.unpackbits(seg, bitorder="little")[:n] if n else np.zeros(0, np.uint8)
        assert bits.astype(bool).tolist() == x[indptr[i]:indptr[i + 1]].tolist(), "segment %d (len %d)" % (i, n)
        if n % 8:
            assert np.unpackbits(seg, bitorder="little")[n:].sum() == 0, "segment %d padding" % i


def test_segment_packbits_indptr_not_starting_at_zero(rng):
    """FlashInfer reads segment i from x[indptr[i]:indptr[i+1]] whatever indptr[0] is (new_indptr starts at 0):
    a sub-range of x packs like the same segments of the sliced x."""
    x = rng.random(40) < 0.5
    indptr = np.array([5, 9, 20, 20, 33], np.int32)
    packed, new_indptr = kvattn.segment_packbits(x, indptr, bitorder="little")
    ref, ref_indptr = kvattn.segment_packbits(x[5:], indptr - 5, bitorder="little")
    assert new_indptr.tolist() == ref_indptr.tolist() == [0, 1, 3, 3, 5]
    assert packed.tolist() == ref.tolist()
    # all-multiple-of-8 segments (packed in one piece) too
    packed8, _ = kvattn.segment_packbits(x, np.array([3, 11, 19, 27], np.int32), bitorder="big")
    assert packed8.tolist() == np.packbits(x[3:27]).tolist()


# ------------------------------------------------------------------------------------------------------------------
# kvattn.utils enums, top-level names, error types


def test_utils_enums_have_flashinfer_names_and_values(rng):
    from kvattn.utils import MaskMode, PosEncodingMode, TensorLayout
    assert {m.name: m.value for m in PosEncodingMode} == {"NONE": 0, "ROPE_LLAMA": 1, "ALIBI": 2}
    assert {m.name: m.value for m in TensorLayout} == {"NHD": 0, "HND": 1}
    assert {m.name: m.value for m in MaskMode}["NON_CAUSAL"] == 0
    assert MaskMode.CAUSAL.value == 1 and MaskMode.CUSTOM.value == 2
    assert kvattn.PosEncodingMode is PosEncodingMode and kvattn.utils.TensorLayout is TensorLayout
    # FlashInfer's own idiom: PosEncodingMode[mode].value, TensorLayout[layout].value
    assert PosEncodingMode["ROPE_LLAMA"].value == 1 and TensorLayout["HND"].value == 1
    # the enum members (and their .name strings) are accepted where FlashInfer takes the mode string
    ps, hkv, d = 4, 1, 64
    paged, arrs, kv, groups = _cascade(rng, 2, [1, 1], [[6], [3, 2]], ps, hkv, d, np.float32, "HND", "5d")
    q = rng.standard_normal((2, 2, d)).astype(np.float32)
    outs = []
    for layout, pos in ((TensorLayout.HND, PosEncodingMode.ROPE_LLAMA), ("HND", PosEncodingMode.ROPE_LLAMA.name)):
        w = kvattn.MultiLevelCascadeAttentionWrapper(2, workspace(), layout)
        w.plan(arrs["qo"], arrs["indptr"], arrs["indices"], arrs["last"], 2, hkv, d, ps, pos_encoding_mode=pos,
               q_data_type="float32")
        outs.append(w.run(q, paged))
    assert np.array_equal(outs[0], outs[1])


def test_flashinfer_module_paths_and_error_types():
    """The names a FlashInfer user imports exist at the same paths; kvattn's errors derive from the builtin
    exception types FlashInfer code catches (ValueError / NotImplementedError / RuntimeError / MemoryError)."""
    for mod, names in (("cascade", ["MultiLevelCascadeAttentionWrapper", "merge_state", "merge_state_in_place",
                                    "merge_states"]),
                       ("sparse", ["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper"]),
                       ("page", ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]),
                       ("quantization", ["packbits", "segment_packbits"]),
                       ("utils", ["PosEncodingMode", "TensorLayout", "MaskMode"])):
        m = getattr(kvattn, mod)
        for n in names:
            assert getattr(m, n) is getattr(kvattn, n), "%s.%s" % (mod, n)
    assert issubclass(kvattn.InvalidArgumentError, ValueError)
    assert issubclass(kvattn.PageIndexOutOfRangeError, ValueError)
    assert issubclass(kvattn.PlanMismatchError, ValueError)
    assert issubclass(kvattn.WorkspaceTooSmallError, ValueError)
    assert issubclass(kvattn.UnsupportedError, NotImplementedError)
    assert issubclass(kvattn.BackendError, RuntimeError)
    assert issubclass(kvattn.KvattnOutOfMemoryError, MemoryError)
    assert issubclass(kvattn.LibraryNotFoundError, ImportError)
    for cls in (kvattn.InvalidArgumentError, kvattn.UnsupportedError, kvattn.BackendError):
        assert issubclass(cls, kvattn.KvattnError)
