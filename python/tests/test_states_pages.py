"""merge_state / merge_state_in_place / merge_states, append_paged_kv_cache and the page / packbits helpers."""

import numpy as np
import pytest

import kvattn
from reference import assert_close, merge


def _state(rng, n, h, d, empty_rows=()):
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    s = (rng.standard_normal((n, h)) * 3).astype(np.float32)
    for r in empty_rows:
        v[r] = 0
        s[r] = -np.inf
    return v, s


def test_merge_state(rng):
    va, sa = _state(rng, 7, 3, 16, empty_rows=(1, 4))
    vb, sb = _state(rng, 7, 3, 16, empty_rows=(4, 5))
    v, s = kvattn.merge_state(va, sa, vb, sb)
    rv, rs = merge(va, sa, vb, sb)
    assert_close(v, rv, 1e-5, 1e-5, "v")
    assert_close(s, rs, 1e-5, 1e-5, "s")
    assert np.all(v[4] == 0) and np.all(np.isneginf(s[4]))  # two empty states: no NaN


def test_merge_state_float16(rng):
    va, sa = _state(rng, 5, 2, 32)
    vb, sb = _state(rng, 5, 2, 32)
    v, s = kvattn.merge_state(va.astype(np.float16), sa, vb.astype(np.float16), sb)
    assert v.dtype == np.float16 and s.dtype == np.float32
    rv, rs = merge(va.astype(np.float16), sa, vb.astype(np.float16), sb)
    assert_close(v, rv, 2e-3, 2e-3)
    assert_close(s, rs, 1e-5, 1e-5)


def test_merge_state_in_place_with_mask(rng):
    va, sa = _state(rng, 6, 2, 8)
    vb, sb = _state(rng, 6, 2, 8)
    rv, rs = merge(va, sa, vb, sb)
    v, s = va.copy(), sa.copy()
    mask = np.array([True, False, True, True, False, False])
    kvattn.merge_state_in_place(v, s, vb, sb, mask=mask)
    assert_close(v[mask], rv[mask], 1e-5, 1e-5)
    assert_close(s[mask], rs[mask], 1e-5, 1e-5)
    np.testing.assert_array_equal(v[~mask], va[~mask])
    np.testing.assert_array_equal(s[~mask], sa[~mask])
    v, s = va.copy(), sa.copy()
    kvattn.merge_state_in_place(v, s, vb, sb)
    assert_close(v, rv, 1e-5, 1e-5)


def test_merge_states(rng):
    n, k, h, d = 5, 4, 3, 8
    v = rng.standard_normal((n, k, h, d)).astype(np.float32)
    s = (rng.standard_normal((n, k, h)) * 2).astype(np.float32)
    s[2, :, :] = -np.inf  # a row of empty states
    vo, so = kvattn.merge_states(v, s)
    rv, rs = v[:, 0].astype(np.float64), s[:, 0].astype(np.float64)
    for i in range(1, k):
        rv, rs = merge(rv, rs, v[:, i], s[:, i])
    assert_close(vo, rv, 1e-5, 1e-5)
    assert_close(so, rs, 1e-5, 1e-5)
    assert np.all(vo[2] == 0) and np.all(np.isneginf(so[2]))


def test_merge_of_split_attention_equals_full(rng):
    """Attention over [0, n) == merge(attention over [0, m), attention over [m, n)) (base-2 LSE)."""
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    k = rng.standard_normal((20, 4, 16)).astype(np.float32)
    v = rng.standard_normal((20, 4, 16)).astype(np.float32)
    o, lse = kvattn.single_prefill_with_kv_cache(q, k, v, return_lse=True)
    o1, l1 = kvattn.single_prefill_with_kv_cache(q, k[:7], v[:7], return_lse=True)
    o2, l2 = kvattn.single_prefill_with_kv_cache(q, k[7:], v[7:], return_lse=True)
    om, lm = kvattn.merge_state(o1, l1, o2, l2)
    assert_close(om, o, 1e-5, 1e-4)
    assert_close(lm, lse, 1e-5, 1e-4)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_append_paged_kv_cache(rng, layout, page_size):
    hkv, d = 2, 8
    old = [0, 5, 16, 3]
    new = [4, 1, 7, 0]
    total = [a + b for a, b in zip(old, new)]
    pages = [(n + page_size - 1) // page_size for n in total]
    P = sum(pages) + 2
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(P)[: indptr[-1]].astype(np.int32)
    last = np.array([((n - 1) % page_size) + 1 if n else 1 for n in total], np.int32)
    shape = (P, 2, page_size, hkv, d) if layout == "NHD" else (P, 2, hkv, page_size, d)
    cache = np.zeros(shape, np.float32)
    append_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    nnz = int(append_indptr[-1])
    ak = rng.standard_normal((nnz, hkv, d)).astype(np.float32)
    av = rng.standard_normal((nnz, hkv, d)).astype(np.float32)
    seq_lens = kvattn.get_seq_lens(indptr, last, page_size)
    np.testing.assert_array_equal(seq_lens, total)
    bi, pos = kvattn.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    kvattn.append_paged_kv_cache(ak, av, bi, pos, cache, indices, indptr, last, kv_layout=layout)
    expect = np.zeros_like(cache)
    for j in range(nnz):
        b, p = int(bi[j]), int(pos[j])
        page = indices[indptr[b] + p // page_size]
        if layout == "NHD":
            expect[page, 0, p % page_size] = ak[j]
            expect[page, 1, p % page_size] = av[j]
        else:
            expect[page, 0, :, p % page_size] = ak[j]
            expect[page, 1, :, p % page_size] = av[j]
    np.testing.assert_array_equal(cache, expect)
    # the (K, V) tuple form writes the same
    kc, vc = np.zeros_like(cache[:, 0]), np.zeros_like(cache[:, 1])
    kvattn.append_paged_kv_cache(ak, av, bi, pos, (kc, vc), indices, indptr, last, kv_layout=layout)
    np.testing.assert_array_equal(kc, expect[:, 0])
    np.testing.assert_array_equal(vc, expect[:, 1])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_append_paged_kv_cache_by_slot(rng, layout, page_size):
    """The slot form writes what the page-table form writes for the same tokens; negative slots are skipped."""
    hkv, d, P = 2, 8, 7
    slots_all = rng.permutation(P * page_size)[:11].astype(np.int64)
    pad = np.array([-1, -(2 ** 40), np.iinfo(np.int64).min], np.int64)
    slots = np.concatenate([slots_all, pad])
    order = rng.permutation(len(slots))
    slots = slots[order]
    ak = rng.standard_normal((len(slots), hkv, d)).astype(np.float32)
    av = rng.standard_normal((len(slots), hkv, d)).astype(np.float32)
    shape = (P, 2, page_size, hkv, d) if layout == "NHD" else (P, 2, hkv, page_size, d)
    cache = rng.standard_normal(shape).astype(np.float32)
    expect = cache.copy()
    for j, sl in enumerate(slots):
        if sl < 0:
            continue
        page, off = int(sl) // page_size, int(sl) % page_size
        if layout == "NHD":
            expect[page, 0, off], expect[page, 1, off] = ak[j], av[j]
        else:
            expect[page, 0, :, off], expect[page, 1, :, off] = ak[j], av[j]
    kvattn.append_paged_kv_cache_by_slot(ak, av, slots, cache, kv_layout=layout)
    np.testing.assert_array_equal(cache, expect)
    # int32 slot mappings are converted; the (K, V) tuple form writes the same
    kc, vc = np.zeros_like(cache[:, 0]), np.zeros_like(cache[:, 1])
    keep = slots >= 0
    kvattn.append_paged_kv_cache_by_slot(ak[keep], av[keep], slots[keep].astype(np.int32), (kc, vc),
                                         kv_layout=layout)
    e2 = np.zeros_like(cache)
    for j in np.nonzero(keep)[0]:
        page, off = int(slots[j]) // page_size, int(slots[j]) % page_size
        if layout == "NHD":
            e2[page, 0, off], e2[page, 1, off] = ak[j], av[j]
        else:
            e2[page, 0, :, off], e2[page, 1, :, off] = ak[j], av[j]
    np.testing.assert_array_equal(kc, e2[:, 0])
    np.testing.assert_array_equal(vc, e2[:, 1])


def test_append_by_slot_refuses_and_writes_nothing(rng):
    cache = rng.standard_normal((2, 2, 4, 1, 4)).astype(np.float32)
    before = cache.copy()
    ak = np.ones((2, 1, 4), np.float32)
    with pytest.raises(kvattn.PageIndexOutOfRangeError):
        kvattn.append_paged_kv_cache_by_slot(ak, ak, np.array([1, 8], np.int64), cache)  # slot 8: page 2 of 2
    np.testing.assert_array_equal(cache, before)
    with pytest.raises(ValueError):
        kvattn.append_paged_kv_cache_by_slot(ak, ak, np.array([1], np.int64), cache)  # fewer slots than rows
    with pytest.raises(TypeError):
        kvattn.append_paged_kv_cache_by_slot(ak, ak, np.array([1.0, 2.0]), cache)
    with pytest.raises(ValueError):
        kvattn.append_paged_kv_cache_by_slot(ak, ak, np.array([[1, 2]], np.int64), cache)
    np.testing.assert_array_equal(cache, before)


def test_append_out_of_range_raises_and_writes_nothing(rng):
    cache = np.zeros((2, 2, 4, 1, 4), np.float32)
    indptr = np.array([0, 1], np.int32)
    indices = np.array([5], np.int32)  # outside the pool of 2 pages
    last = np.array([2], np.int32)
    ak = np.ones((1, 1, 4), np.float32)
    with pytest.raises(kvattn.PageIndexOutOfRangeError):
        kvattn.append_paged_kv_cache(ak, ak, np.array([0], np.int32), np.array([1], np.int32), cache, indices,
                                     indptr, last)
    assert not cache.any()


def test_append_kv_indptr_past_kv_indices_raises_and_writes_nothing():
    """kv_indptr claims more page-table entries than kv_indices holds: the entry past the end must not be read (it
    was: whatever followed the array in memory was taken as a page index, and a token was written into that page,
    or the process crashed)."""
    backing = np.array([1, 2, 0, 0], np.int32)  # the table's 2 entries, then bytes that look like page 0
    indices = backing[:2]
    indptr = np.array([0, 3], np.int32)  # 3 pages
    last = np.array([1], np.int32)
    cache = np.zeros((4, 2, 4, 1, 4), np.float32)
    ak = np.ones((1, 1, 4), np.float32)
    print("append: kv_indptr %s, kv_indices %s, position 8 (page-table entry 2)" % (indptr.tolist(), indices.tolist()))
    with pytest.raises(ValueError, match="kv_indices has 2 elements"):
        kvattn.append_paged_kv_cache(ak, ak, np.array([0], np.int32), np.array([8], np.int32), cache, indices,
                                     indptr, last)
    assert not cache.any()
    kvattn.append_paged_kv_cache(ak, ak, np.array([0], np.int32), np.array([4], np.int32), cache, indices,
                                 np.array([0, 2], np.int32), np.array([1], np.int32))
    assert cache[2, :, 0].all() and np.count_nonzero(cache) == 8


def test_get_batch_indices_positions():
    append_indptr = np.array([0, 2, 2, 5], np.int32)
    seq_lens = np.array([10, 3, 4], np.int32)
    bi, pos = kvattn.get_batch_indices_positions(append_indptr, seq_lens, 5)
    assert bi.dtype == np.int32 and pos.dtype == np.int32
    assert bi.tolist() == [0, 0, 2, 2, 2]
    assert pos.tolist() == [8, 9, 1, 2, 3]
    bo, po = np.zeros(5, np.int32), np.zeros(5, np.int32)
    r = kvattn.get_batch_indices_positions(append_indptr, seq_lens, 5, bo, po)
    assert r[0] is bo and po.tolist() == [8, 9, 1, 2, 3]


def test_get_seq_lens():
    lens = kvattn.get_seq_lens(np.array([0, 2, 2, 3]), np.array([3, 1, 16]), 16)
    assert lens.tolist() == [19, 0, 16]



def test_page_helpers_refuse_per_request_arrays_of_the_wrong_length():
    """A per-request array shorter than the batch (length 1 would broadcast) raises ValueError naming the arrays;
    get_batch_indices_positions accepts a longer seq_lens buffer (it reads the first batch_size entries)."""
    with pytest.raises(ValueError, match="kv_last_page_len"):
        kvattn.get_seq_lens(np.array([0, 2, 3], np.int32), np.array([5], np.int32), 4)
    with pytest.raises(ValueError, match="kv_last_page_len"):
        kvattn.get_seq_lens(np.array([0, 2, 3], np.int32), np.array([1, 2, 3], np.int32), 4)
    with pytest.raises(ValueError, match="seq_lens"):
        kvattn.get_batch_indices_positions(np.array([0, 2, 3], np.int32), np.array([5], np.int32), 3)
    bi, pos = kvattn.get_batch_indices_positions(np.array([0, 2, 3], np.int32), np.array([5, 4, 99], np.int32), 3)
    assert bi.tolist() == [0, 0, 1] and pos.tolist() == [3, 4, 3]

@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 77])
def test_packbits_matches_numpy(rng, bitorder, n):
    x = rng.random(n) < 0.5
    np.testing.assert_array_equal(kvattn.packbits(x, bitorder=bitorder), np.packbits(x, bitorder=bitorder))
    assert kvattn.packbits(x).tolist() == np.packbits(x).tolist()  # default "big"


@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_segment_packbits(rng, bitorder):
    lens = [3, 0, 8, 13, 1]
    indptr = np.concatenate([[0], np.cumsum(lens)])
    x = rng.random(indptr[-1]) < 0.5
    packed, new_indptr = kvattn.segment_packbits(x, indptr, bitorder=bitorder)
    expect = [np.packbits(x[indptr[i]:indptr[i + 1]], bitorder=bitorder) for i in range(len(lens))]
    assert new_indptr.tolist() == np.concatenate([[0], np.cumsum([len(e) for e in expect])]).tolist()
    np.testing.assert_array_equal(packed, np.concatenate(expect))
    with pytest.raises(ValueError):
        kvattn.packbits(x, bitorder="middle")


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("lens", [[8, 16, 5], [3, 0, 8, 13, 1], [0], [], [24, 0, 8]])
def test_segment_packbits_shapes(rng, bitorder, lens):
    """Segments of multiples of 8 (packed in one piece), ragged ones (one by one), an indptr ending before x's
    end; NumPy and, where torch is importable, torch CPU tensors give np.packbits' bytes per segment."""
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    x = rng.random(int(indptr[-1]) + 3) < 0.5
    expect = [np.packbits(x[indptr[i]:indptr[i + 1]], bitorder=bitorder) for i in range(len(lens))]
    want = np.concatenate(expect) if expect else np.zeros(0, np.uint8)
    want_ip = np.concatenate([[0], np.cumsum([len(e) for e in expect])]).tolist()
    packed, new_indptr = kvattn.segment_packbits(x, indptr, bitorder=bitorder)
    np.testing.assert_array_equal(packed, want)
    assert new_indptr.tolist() == want_ip
    try:
        import torch
    except ImportError:
        return
    pt, ipt = kvattn.segment_packbits(torch.from_numpy(x), torch.from_numpy(indptr), bitorder=bitorder)
    np.testing.assert_array_equal(pt.numpy(), want)
    assert ipt.tolist() == want_ip
    np.testing.assert_array_equal(kvattn.packbits(torch.from_numpy(x), bitorder=bitorder).numpy(),
                                  np.packbits(x, bitorder=bitorder))


def test_segment_packbits_memory_is_linear():
    """A 64 Mbit mask packs without [bytes, 8] int64 temporaries (the NumPy path is np.packbits per segment)."""
    import resource
    x = np.ones(1 << 26, bool)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    packed, ip = kvattn.segment_packbits(x, np.array([0, 3, 1 << 26]), bitorder="little")
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert packed.size == 1 + (((1 << 26) - 3 + 7) // 8) and ip.tolist() == [0, 1, packed.size]
    assert grew_mb < 256, grew_mb  # the old vectorised form needed ~1.2 GB here


def test_multilevel_cascade_equals_flat(rng):
    """Two levels (a shared prefix of whole pages + unique suffixes) == flat paged prefill over prefix+suffix."""
    ps, hq, hkv, d = 4, 4, 2, 16
    prefix_pages = [7, 2, 5]  # 12 prefix tokens
    uniq_lens = [5, 9, 1]
    qo_lens = [2, 3, 1]
    P = 40
    perm = rng.permutation(P).astype(np.int32)
    uniq_pages, off = [], len(prefix_pages)
    for n in uniq_lens:
        k = (n + ps - 1) // ps
        uniq_pages.append(perm[off:off + k])
        off += k
    cache = rng.standard_normal((P, 2, ps, hkv, d)).astype(np.float32)
    nnz = sum(qo_lens)
    q = rng.standard_normal((nnz, hq, d)).astype(np.float32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    last = np.array([((n - 1) % ps) + 1 for n in uniq_lens], np.int32)
    # level 0: every query of the batch is one "request" over the shared prefix
    lvl0 = (np.array([0, nnz], np.int32), np.array([0, 3], np.int32), np.array(prefix_pages, np.int32),
            np.array([ps], np.int32))
    lvl1 = (qo_indptr, np.concatenate([[0], np.cumsum([len(p) for p in uniq_pages])]).astype(np.int32),
            np.concatenate(uniq_pages).astype(np.int32), last)
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, np.zeros(8 << 20, np.uint8))
    w.plan([lvl0[0], lvl1[0]], [lvl0[1], lvl1[1]], [lvl0[2], lvl1[2]], [lvl0[3], lvl1[3]], hq, hkv, d, ps,
           causal=True, q_data_type="float32")
    o = w.run(q, cache)
    flat = kvattn.BatchPrefillWithPagedKVCacheWrapper(np.zeros(8 << 20, np.uint8))
    flat_pages = [np.concatenate([prefix_pages, p]) for p in uniq_pages]
    flat.plan(qo_indptr, np.concatenate([[0], np.cumsum([len(p) for p in flat_pages])]).astype(np.int32),
              np.concatenate(flat_pages).astype(np.int32), last, hq, hkv, d, ps, causal=True, q_data_type="float32")
    assert_close(o, flat.run(q, cache), 2e-5, 2e-5)
