"""plan() with host page tables never waits for the GPU: an engine plans step n + 1 while step n still runs (the C
library stages its plan copies through page-locked memory on the caller's stream; the Python layer's copies of the
page table to the device, and into a CUDA-graph wrapper's fixed buffers, go the same way). Each test puts ~60 ms of
GPU sleep on the current stream, plans, and requires plan() to return in well under that; the runs after it are
checked against the float64 reference, so the asynchronous copies carried the right values.

CUDA only (skipped without torch or a GPU)."""

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available (torch.cuda.is_available() is False)", allow_module_level=True)
if not hasattr(torch.cuda, "_sleep"):
    pytest.skip("this torch has no torch.cuda._sleep (the GPU work the tests queue)", allow_module_level=True)

import kvattn  # noqa: E402
from reference import TOL, assert_close, attention, gather_kv, make_paged, paged_decode  # noqa: E402

DEV = "cuda"


def np64(x):
    return x.detach().float().cpu().numpy().astype(np.float64)


def timed_plan(plan):
    """(host seconds of plan(), seconds until the GPU finished the sleep queued before it)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(int(120e6))  # ~60 ms at 2 GHz
    plan()
    t_plan = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t_plan, time.perf_counter() - t0


def check_async(plan, what):
    plan()  # first plan: allocations (plan memory, page-locked staging) may synchronise once
    t_plan, t_all = timed_plan(plan)
    assert t_all > 0.02, "%s: the GPU sleep did not take effect (%.1f ms)" % (what, t_all * 1e3)
    assert t_plan < 0.5 * t_all, "%s: plan() took %.1f ms of the %.1f ms the GPU was busy: it waited for the stream" \
        % (what, t_plan * 1e3, t_all * 1e3)


def decode_ref(q, cache, indptr, indices, lens):
    return paged_decode(np64(q), np64(cache), indptr, indices, lens)


@pytest.mark.parametrize("arrays", ["numpy", "torch_cpu", "indices_on_device"])
def test_decode_plan_does_not_wait(rng, arrays):
    lens, ps, hq, hkv, d = [300, 7, 1000, 64], 16, 8, 2, 64
    cache_np, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d)
    cache = torch.from_numpy(cache_np).to(DEV).half()
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV))
    if arrays == "numpy":
        args = (indptr, indices, last)
    elif arrays == "torch_cpu":
        args = (torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last))
    else:
        args = (torch.from_numpy(indptr), torch.from_numpy(indices).to(DEV), torch.from_numpy(last))
    check_async(lambda: w.plan(*args, hq, hkv, d, ps, q_data_type="float16", num_pages=P), "decode, " + arrays)
    q = torch.randn(len(lens), hq, d, device=DEV).half()
    o = w.run(q, cache)
    torch.cuda.synchronize()
    assert_close(np64(o), decode_ref(q, cache, indptr, indices, lens), *TOL["float16"], what="decode, " + arrays)


def test_cuda_graph_decode_plan_does_not_wait(rng):
    """A CUDA-graph wrapper's plan() copies the page table into its fixed buffers without waiting."""
    B, ps, hq, hkv, d = 3, 16, 8, 2, 64
    lens = [40, 300, 5]
    cache_np, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d, extra_pages=20)
    cache = torch.from_numpy(cache_np).to(DEV).half()
    w = kvattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(32 << 20, dtype=torch.uint8, device=DEV),
        torch.zeros(B + 1, dtype=torch.int32, device=DEV), torch.zeros(P, dtype=torch.int32, device=DEV),
        torch.zeros(B, dtype=torch.int32, device=DEV))
    check_async(lambda: w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float16", num_pages=P),
                "graph-mode decode")
    q = torch.randn(B, hq, d, device=DEV).half()
    out = torch.empty_like(q)
    w.run(q, cache, out=out)
    torch.cuda.synchronize()
    assert_close(np64(out), decode_ref(q, cache, indptr, indices, lens), *TOL["float16"], what="graph-mode decode")


def test_prefill_plans_do_not_wait(rng):
    qo, kv, ps, hq, hkv, d = [5, 1, 17], [40, 9, 17], 16, 4, 2, 64
    cache_np, indptr, indices, last, P = make_paged(rng, kv, ps, hkv, d)
    cache = torch.from_numpy(cache_np).to(DEV).half()
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=DEV)
    paged = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws)
    check_async(lambda: paged.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal=True,
                                   q_data_type="float16", num_pages=P), "paged prefill")
    ragged = kvattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=DEV))
    check_async(lambda: ragged.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, q_data_type="float16"),
                "ragged prefill")
    q = torch.randn(sum(qo), hq, d, device=DEV).half()
    k = torch.randn(sum(kv), hkv, d, device=DEV).half()
    v = torch.randn(sum(kv), hkv, d, device=DEV).half()
    o_p = paged.run(q, cache)
    o_r = ragged.run(q, k, v)
    torch.cuda.synchronize()
    c = np64(cache)
    for b in range(len(qo)):
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        kb, vb = gather_kv(c[:, 0], c[:, 1], indptr, indices, b, kv[b])
        assert_close(np64(o_p[rows]), attention(np64(q[rows]), kb, vb, causal=True)[0], *TOL["float16"],
                     what="paged prefill request %d" % b)
        ks = slice(kv_indptr[b], kv_indptr[b + 1])
        assert_close(np64(o_r[rows]), attention(np64(q[rows]), np64(k[ks]), np64(v[ks]), causal=True)[0],
                     *TOL["float16"], what="ragged prefill request %d" % b)


@pytest.mark.parametrize("graph", [False, True])
def test_plan_copies_are_private(rng, graph):
    """An engine may refill its own (page-locked) host page-table buffers as soon as plan() returns, while the GPU is
    still busy and plan()'s device copies have not run yet: the plan keeps the values it was given."""
    B, ps, hq, hkv, d = 3, 16, 8, 2, 64
    lens = [40, 300, 5]
    cache_np, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d, extra_pages=20)
    cache = torch.from_numpy(cache_np).to(DEV).half()
    h_indptr, h_indices, h_last = (torch.from_numpy(a).pin_memory() for a in (indptr, indices, last))
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=DEV)
    if graph:
        w = kvattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            ws, torch.zeros(B + 1, dtype=torch.int32, device=DEV), torch.zeros(P, dtype=torch.int32, device=DEV),
            torch.zeros(B, dtype=torch.int32, device=DEV))
    else:
        w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws)

    def plan():
        w.plan(h_indptr, h_indices, h_last, hq, hkv, d, ps, q_data_type="float16", num_pages=P)

    plan()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(120e6))
    plan()
    # the engine's next step reuses its buffers at once: other pages, other lengths
    h_indices.copy_(torch.from_numpy(np.roll(indices, 1)))
    h_last.fill_(1)
    torch.cuda.synchronize()
    q = torch.randn(B, hq, d, device=DEV).half()
    out = torch.empty_like(q)
    w.run(q, cache, out=out)
    torch.cuda.synchronize()
    assert_close(np64(out), decode_ref(q, cache, indptr, indices, lens), *TOL["float16"],
                 what="decode (graph mode %s) after the host buffers were refilled" % graph)
