"""The prepared run: eager runs of one plan whose torch tensors keep their shapes, strides, dtypes and devices reuse
the previous run's C arguments and set only data pointers, scales, stream and PDL flag (kvattn/_core.py FastRun).
These tests change everything the prepared arguments must follow (new tensors of the same shapes, the paged cache's K
and V from one tensor or two, outputs given or allocated, scales, streams) and everything that must send a run back
through the checks (shapes, dtypes, strides, a new plan, a pool of another size, run-time scalars), each against the
float64 reference.

torch CPU tensors run on the CPU backend and, where CUDA is available, torch CUDA tensors on the CUDA backend."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the prepared run exists for torch tensors only")

import kvattn  # noqa: E402
from reference import TOL, assert_close, attention, gather_kv, make_paged  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available (torch.cuda.is_available() is False)")


def np64(x):
    return x.detach().float().cpu().numpy().astype(np.float64)


def dtype_for(device):
    return torch.float16 if device == "cuda" else torch.float32


def tol(device):
    return TOL["float16" if device == "cuda" else "float32"]


def ws(device, nbytes=64 << 20):
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Case:
    """A decode step: lens, page table, and a pool filled with random K/V (the same pool shape for every draw)."""

    def __init__(self, rng, device, lens=(5, 40, 17), ps=16, hkv=2, group=4, d=64, layout="NHD", extra_pages=3):
        self.device, self.lens, self.ps, self.hkv, self.hq, self.d, self.layout = \
            device, list(lens), ps, hkv, hkv * group, d, layout
        cache, self.indptr, self.indices, self.last, self.P = make_paged(rng, self.lens, ps, hkv, d, np.float32,
                                                                         layout, extra_pages=extra_pages)
        self.cache_shape = cache.shape
        self.dt = dtype_for(device)

    def cache(self, rng):
        x = rng.standard_normal(self.cache_shape).astype(np.float32)
        return torch.from_numpy(x).to(device=self.device, dtype=self.dt)

    def q(self):
        return torch.randn(len(self.lens), self.hq, self.d, device=self.device).to(self.dt)

    def wrapper(self, **plan_kw):
        w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(self.device), kv_layout=self.layout)
        w.plan(torch.from_numpy(self.indptr), torch.from_numpy(self.indices).to(self.device),
               torch.from_numpy(self.last), self.hq, self.hkv, self.d, self.ps, q_data_type=self.dt, **plan_kw)
        return w

    def ref(self, q, k_pool, v_pool, sm_scale=None):
        kc, vc = np64(k_pool), np64(v_pool)
        outs, lses = [], []
        for b, n in enumerate(self.lens):
            k, v = gather_kv(kc, vc, self.indptr, self.indices, b, n, self.layout)
            o, lse = attention(np64(q[b:b + 1]), k, v, sm_scale=sm_scale)
            outs.append(o[0])
            lses.append(lse[0])
        return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_new_tensors_each_run(rng, device, layout):
    """Fresh q and pool tensors of the same shapes on every run (the serving pattern): each run reads its own."""
    c = Case(rng, device, layout=layout)
    w = c.wrapper()
    atol, rtol = tol(device)
    for i in range(4):
        q, cache = c.q(), c.cache(rng)
        o, lse = w.run(q, cache, return_lse=True)
        sync(device)
        ro, rl = c.ref(q, cache[:, 0], cache[:, 1])
        assert_close(np64(o), ro, atol, rtol, "o, run %d" % i)
        assert_close(np64(lse), rl, atol, rtol, "lse, run %d" % i)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_pair_from_separate_tensors(rng, device):
    """A (K, V) pair: K and V come from their own tensors on every run, also when the pairs are mixed."""
    c = Case(rng, device)
    w = c.wrapper()
    atol, rtol = tol(device)
    pools = [(c.cache(rng)[:, 0].contiguous(), c.cache(rng)[:, 1].contiguous()) for _ in range(2)]
    for i, (k, v) in enumerate([(pools[0][0], pools[0][1]), (pools[1][0], pools[1][1]),
                                (pools[0][0], pools[1][1]), (pools[1][0], pools[0][1])]):
        q = c.q()
        o = w.run(q, (k, v))
        sync(device)
        assert_close(np64(o), c.ref(q, k, v)[0], atol, rtol, "o, pair %d" % i)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_given_then_allocated(rng, device):
    """out= / lse= given, then other given buffers, then allocated ones: every run writes where it was told, and
    only there."""
    c = Case(rng, device)
    w = c.wrapper()
    atol, rtol = tol(device)
    q, cache = c.q(), c.cache(rng)
    ro, rl = c.ref(q, cache[:, 0], cache[:, 1])
    outs = [torch.full((len(c.lens), c.hq, c.d), float("nan"), device=device, dtype=c.dt) for _ in range(3)]
    lses = [torch.full((len(c.lens), c.hq), float("nan"), device=device, dtype=torch.float32) for _ in range(3)]
    w.run(q, cache, out=outs[0], lse=lses[0])
    w.run(q, cache, out=outs[1], lse=lses[1])
    sync(device)
    for i in range(2):
        assert_close(np64(outs[i]), ro, atol, rtol, "out %d" % i)
        assert_close(np64(lses[i]), rl, atol, rtol, "lse %d" % i)
    assert torch.isnan(outs[2]).all() and torch.isnan(lses[2]).all()
    o1 = w.run(q, cache)
    o2, l2 = w.run(q, cache, return_lse=True)
    o3 = w.run(q, cache, out=outs[2])
    sync(device)
    assert o1.data_ptr() != o2.data_ptr()
    for name, got in (("o1", o1), ("o2", o2), ("o3", o3)):
        assert_close(np64(got), ro, atol, rtol, name)
    assert_close(np64(l2), rl, atol, rtol, "l2")
    assert o3 is outs[2]
    assert torch.isnan(lses[2]).all()  # not asked for: untouched


@pytest.mark.parametrize("device", DEVICES)
def test_scales_follow_each_run(rng, device):
    """q_scale, k_scale and v_scale of each run (FlashInfer folds q_scale * k_scale into the logits scale and
    multiplies the output by v_scale)."""
    c = Case(rng, device)
    w = c.wrapper()
    atol, rtol = tol(device)
    q, cache = c.q(), c.cache(rng)
    sm = 1.0 / np.sqrt(c.d)
    for qs, ks, vs in ((None, None, None), (None, 0.5, 2.0), (None, None, None), (0.25, 2.0, 0.75), (None, None, 1.5)):
        o = w.run(q, cache, q_scale=qs, k_scale=ks, v_scale=vs)
        sync(device)
        ro, _ = c.ref(q, cache[:, 0], cache[:, 1], sm_scale=sm * (qs or 1.0) * (ks or 1.0))
        assert_close(np64(o), ro * (vs or 1.0), atol, rtol, "scales %r" % ((qs, ks, vs),))
    with pytest.raises(ValueError, match="finite"):
        w.run(q, cache, v_scale=float("inf"))


@pytest.mark.parametrize("device", DEVICES)
def test_changed_arguments_are_checked(rng, device):
    """After prepared runs, anything the plan does not fit is still refused with the checked path's errors."""
    c = Case(rng, device)
    w = c.wrapper()
    q, cache = c.q(), c.cache(rng)
    w.run(q, cache)
    w.run(q, cache)
    other = torch.float16 if c.dt != torch.float16 else torch.bfloat16
    with pytest.raises(kvattn.PlanMismatchError, match="dtype"):
        w.run(q.to(other), cache)
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q[:-1], cache)
    with pytest.raises(kvattn.PlanMismatchError, match="dtype"):
        w.run(q, cache.to(other))
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q, cache, out=torch.empty(len(c.lens), c.hq, c.d + 1, device=device, dtype=c.dt))
    with pytest.raises(ValueError, match="stride 0"):
        w.run(q, cache, out=torch.empty(1, c.hq, c.d, device=device, dtype=c.dt).expand(len(c.lens), -1, -1))
    with pytest.raises(kvattn.PlanMismatchError, match="sm_scale"):
        w.run(q, cache, sm_scale=0.5)
    with pytest.raises(kvattn.PlanMismatchError, match="window_left"):
        w.run(q, cache, window_left=3)
    # a q view with other strides (same shape) takes the checked path and reads through its strides
    big = torch.randn(len(c.lens), c.hq, 2 * c.d, device=device).to(c.dt)
    qv = big[:, :, :c.d]
    o = w.run(qv, cache)
    sync(device)
    assert_close(np64(o), c.ref(qv, cache[:, 0], cache[:, 1])[0], *tol(device), what="strided q")
    o = w.run(q, cache)
    sync(device)
    assert_close(np64(o), c.ref(q, cache[:, 0], cache[:, 1])[0], *tol(device), what="back to contiguous q")


@pytest.mark.parametrize("device", DEVICES)
def test_new_plan_and_new_pool(rng, device):
    """A new plan (other lengths) and a pool of another size after prepared runs: the runs follow both."""
    c = Case(rng, device, lens=(5, 40, 17))
    w = c.wrapper()
    atol, rtol = tol(device)
    q, cache = c.q(), c.cache(rng)
    for _ in range(2):
        o = w.run(q, cache)
    sync(device)
    assert_close(np64(o), c.ref(q, cache[:, 0], cache[:, 1])[0], atol, rtol, "first plan")
    c2 = Case(rng, device, lens=(33, 1, 70), extra_pages=9)  # same batch, other lengths and pool size
    w.plan(torch.from_numpy(c2.indptr), torch.from_numpy(c2.indices).to(device), torch.from_numpy(c2.last),
           c2.hq, c2.hkv, c2.d, c2.ps, q_data_type=c2.dt)
    cache2 = c2.cache(rng)
    for _ in range(2):
        o = w.run(q, cache2)
    sync(device)
    assert_close(np64(o), c2.ref(q, cache2[:, 0], cache2[:, 1])[0], atol, rtol, "second plan")
    # the same page table in a larger pool (FlashInfer's plan never sees the pool: kvattn plans again for it)
    bigger = torch.cat([cache2, c2.cache(rng)[:4]], dim=0)
    for _ in range(2):
        o = w.run(q, bigger)
    sync(device)
    assert_close(np64(o), c2.ref(q, bigger[:, 0], bigger[:, 1])[0], atol, rtol, "larger pool")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_prefill_new_tensors(rng, device, layout):
    """Ragged prefill: fresh q, k, v of the same shapes each run (HND K/V are transposed views of the inputs)."""
    qo, kv, hq, hkv, d = [3, 0, 9], [7, 4, 20], 4, 2, 64
    dt = dtype_for(device)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(ws(device), kv_layout=layout)
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, q_data_type=dt)
    atol, rtol = tol(device)
    for i in range(3):
        q = torch.randn(sum(qo), hq, d, device=device).to(dt)
        shape = (sum(kv), hkv, d) if layout == "NHD" else (hkv, sum(kv), d)
        k = torch.randn(*shape, device=device).to(dt)
        v = torch.randn(*shape, device=device).to(dt)
        o, lse = w.run(q, k, v, return_lse=True)
        sync(device)
        kn, vn = (np64(k), np64(v)) if layout == "NHD" else (np64(k).transpose(1, 0, 2), np64(v).transpose(1, 0, 2))
        for b in range(len(qo)):
            qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
            if qo[b] == 0:
                continue
            ro, rl = attention(np64(q[qs]), kn[ks], vn[ks], causal=True)
            assert_close(np64(o[qs]), ro, atol, rtol, "o, run %d, request %d" % (i, b))
            assert_close(np64(lse[qs]), rl, atol, rtol, "lse, run %d, request %d" % (i, b))


@needs_cuda
def test_stream_of_each_run(rng):
    """A prepared run launches on the stream current at that call."""
    c = Case(rng, "cuda", lens=(300, 1000))
    w = c.wrapper()
    q, cache = c.q(), c.cache(rng)
    w.run(q, cache)
    w.run(q, cache)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q2 = c.q()
        o = w.run(q2, cache)
        done = torch.cuda.Event()
        done.record(s)
    done.synchronize()  # only the side stream: o must be complete on it
    assert_close(np64(o), c.ref(q2, cache[:, 0], cache[:, 1])[0], *tol("cuda"), what="side stream")


# ---- prepared appends (CUDA: eager appends whose tensors keep their signatures reuse the checked C arguments) ----

def _append_ref(pool_k, pool_v, k, v, bi, pos, indptr, indices, ps):
    """Expected pools after the append (NHD [P, ps, H, D] K and V), in float64 on the host."""
    pk, pv = np64(pool_k).copy(), np64(pool_v).copy()
    kk, vv = np64(k), np64(v)
    for i in range(kk.shape[0]):
        b, p = int(bi[i]), int(pos[i])
        page = int(indices[int(indptr[b]) + p // ps])
        pk[page, p % ps] = kk[i]
        pv[page, p % ps] = vv[i]
    return pk, pv


@needs_cuda
@pytest.mark.parametrize("form", ["5d", "tuple"])
def test_prepared_append_follows_every_tensor(rng, form):
    """Repeated appends with tensors of the same signatures: new K/V rows, new pools, new positions and batch
    indices each time; every write lands where that call's tensors say, and nowhere else."""
    dev, ps, H, D = "cuda", 4, 2, 64
    lens = [9, 3, 14]  # the page table already includes the appended tokens
    pages = [(n + ps - 1) // ps for n in lens]
    P = sum(pages) + 2
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(P)[: indptr[-1]].astype(np.int32)
    last = np.array([(n - 1) % ps + 1 for n in lens], np.int32)
    t_indices = torch.from_numpy(indices).to(dev)
    t_indptr = torch.from_numpy(indptr).to(dev)
    t_last = torch.from_numpy(last).to(dev)

    def pools():
        if form == "5d":
            x = torch.randn(P, 2, ps, H, D, device=dev).half()
            return x, x[:, 0], x[:, 1]
        k_, v_ = torch.randn(P, ps, H, D, device=dev).half(), torch.randn(P, ps, H, D, device=dev).half()
        return (k_, v_), k_, v_

    cache_a = pools()
    cache_b = pools()
    rounds = [  # (pool, batch indices, positions) of one token per request
        (cache_a, [0, 1, 2], [8, 2, 13]),
        (cache_a, [0, 1, 2], [7, 0, 12]),
        (cache_b, [2, 0, 1], [4, 5, 1]),
        (cache_a, [1, 2, 0], [1, 10, 0]),
    ]
    for r, ((arg, pk, pv), bi, pos) in enumerate(rounds):
        other = cache_b if arg is cache_a[0] else cache_a
        before_other = (np64(other[1]).copy(), np64(other[2]).copy())
        k = torch.randn(3, H, D, device=dev).half()
        v = torch.randn(3, H, D, device=dev).half()
        t_bi = torch.tensor(bi, dtype=torch.int32, device=dev)
        t_pos = torch.tensor(pos, dtype=torch.int32, device=dev)
        ek, ev = _append_ref(pk, pv, k, v, bi, pos, indptr, indices, ps)
        kvattn.append_paged_kv_cache(k, v, t_bi, t_pos, arg, t_indices, t_indptr, t_last)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(np64(pk), ek, err_msg="K pool, round %d" % r)
        np.testing.assert_array_equal(np64(pv), ev, err_msg="V pool, round %d" % r)
        np.testing.assert_array_equal(np64(other[1]), before_other[0], err_msg="the other K pool, round %d" % r)
        np.testing.assert_array_equal(np64(other[2]), before_other[1], err_msg="the other V pool, round %d" % r)


@needs_cuda
def test_prepared_append_changed_arguments_are_checked(rng):
    """After prepared appends, arguments the checks refuse are still refused; float32 rows (converted into the
    pool's dtype) and converted index arrays (int64, host) still work."""
    dev, ps, H, D = "cuda", 4, 2, 64
    cache = torch.randn(4, 2, ps, H, D, device=dev).half()
    idx = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=dev)
    last = torch.tensor([3, 2], dtype=torch.int32, device=dev)
    bi = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    pos = torch.tensor([6, 1], dtype=torch.int32, device=dev)
    k = torch.randn(2, H, D, device=dev).half()
    for _ in range(2):
        kvattn.append_paged_kv_cache(k, k, bi, pos, cache, idx, indptr, last)
    with pytest.raises(ValueError):  # head dim 32 against the pool's 64
        kvattn.append_paged_kv_cache(k[:, :, :32].contiguous(), k[:, :, :32].contiguous(), bi, pos, cache, idx,
                                     indptr, last)
    kf = torch.randn(2, H, D, device=dev)  # float32 rows into the float16 pool: converted, as the C library does
    kvattn.append_paged_kv_cache(kf, kf, bi, pos, cache, idx, indptr, last)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(np64(cache[3, 1, 1]), np64(kf[1].half()))
    with pytest.raises(ValueError, match="nnz"):
        kvattn.append_paged_kv_cache(k, k, bi[:1], pos[:1], cache, idx, indptr, last)
    with pytest.raises(ValueError, match="is on cpu"):
        kvattn.append_paged_kv_cache(k.cpu(), k.cpu(), bi, pos, cache, idx, indptr, last)
    k2 = torch.randn(2, H, D, device=dev).half()
    kvattn.append_paged_kv_cache(k2, k2, bi.long(), pos.cpu(), cache, idx.long(), indptr, last)
    torch.cuda.synchronize()
    # request 0, position 6: its second page (idx[1] = 0), slot 2; request 1, position 1: page idx[2] = 3, slot 1
    np.testing.assert_array_equal(np64(cache[0, 0, 2]), np64(k2[0]))
    np.testing.assert_array_equal(np64(cache[3, 1, 1]), np64(k2[1]))


@pytest.mark.parametrize("device", DEVICES)
def test_merges_with_remembered_checks(rng, device):
    """merge_state / merge_state_in_place skip the argument checks for signatures that passed them before: new
    tensors of those signatures merge correctly, and other signatures are still checked."""
    from reference import merge
    dt = dtype_for(device)
    atol, rtol = tol(device)
    for i in range(3):
        va, vb = (torch.randn(5, 3, 32, device=device).to(dt) for _ in range(2))
        sa, sb = (torch.randn(5, 3, device=device) * 4 for _ in range(2))
        rv, rs = merge(np64(va), np64(sa), np64(vb), np64(sb))
        v, s = kvattn.merge_state(va, sa, vb, sb)
        sync(device)
        assert_close(np64(v), rv, atol, rtol, "merge_state v, call %d" % i)
        assert_close(np64(s), rs, atol, rtol, "merge_state s, call %d" % i)
        kvattn.merge_state_in_place(va, sa, vb, sb)
        sync(device)
        assert_close(np64(va), rv, atol, rtol, "merge_state_in_place v, call %d" % i)
        assert_close(np64(sa), rs, atol, rtol, "merge_state_in_place s, call %d" % i)
    with pytest.raises(TypeError, match="float32"):
        kvattn.merge_state(va, sa.half(), vb, sb)
    with pytest.raises(ValueError, match="differ in shape"):
        kvattn.merge_state(va, sa, vb[:4], sb[:4])
    with pytest.raises(TypeError, match="float32"):
        kvattn.merge_state_in_place(va, sa, vb, sb.half())


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_append_and_merge_after_eager_calls(rng, device):
    """Eager calls first (so their prepared / checked entries exist), then the same calls traced by torch.compile
    (fullgraph): the traced path takes the custom ops and gives the eager results."""
    dt = dtype_for(device)
    ps, H, D = 4, 2, 32
    cache = torch.randn(4, 2, ps, H, D, device=device).to(dt)
    idx = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    last = torch.tensor([3, 2], dtype=torch.int32, device=device)
    bi = torch.tensor([0, 1], dtype=torch.int32, device=device)
    pos = torch.tensor([6, 1], dtype=torch.int32, device=device)
    k = torch.randn(2, H, D, device=device).to(dt)
    va, vb = (torch.randn(5, 3, 32, device=device).to(dt) for _ in range(2))
    sa, sb = (torch.randn(5, 3, device=device) for _ in range(2))

    def step(k, cache, va, sa, vb, sb):
        kvattn.append_paged_kv_cache(k * 1.0, k, bi, pos, cache, idx, indptr, last)
        return kvattn.merge_state(va, sa, vb, sb)

    want_cache = cache.clone()
    for _ in range(2):
        want = step(k, want_cache, va, sa, vb, sb)
    sync(device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    got = torch.compile(step, fullgraph=True, backend=backend)(k, cache, va, sa, vb, sb)
    sync(device)
    assert torch.equal(cache, want_cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
