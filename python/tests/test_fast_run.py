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
