"""BlockSparseAttentionWrapper with torch tensors: torch CPU tensors on the CPU backend, torch CUDA tensors on the
CUDA backend (current stream, no synchronisation in run, CUDA-graph capture and replay of a run), out= / lse=
buffers, dtype and device checks, the plan's own copies of the index and mask arrays; every result against the
float64 NumPy reference (tests/reference.py).

Skipped (with the reason shown) where torch is not installed; the CUDA cases are skipped unless
torch.cuda.is_available(). Inputs are drawn from a NumPy generator seeded by the test id; the seed is in every
failure message."""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch block-sparse tests need it")

import kvattn  # noqa: E402
from reference import TOL, assert_close, attention  # noqa: E402
from reference import bsr_dense_visible, bsr_packed_mask, bsr_random  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available (torch.cuda.is_available() is False)")

TDT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LSE_TOL = {"float32": (2e-4, 1e-4), "float16": (2e-3, 1e-3), "bfloat16": (2e-3, 1e-3)}


@pytest.fixture
def seeded(request):
    """(seed, generator), the seed derived from the test id (stable across runs and machines)."""
    seed = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    return seed, np.random.default_rng(seed)


def np64(x):
    return x.detach().float().cpu().numpy().astype(np.float64)


def ws(device, nbytes=64 << 20):
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def tensor(rng, shape, dtype, device):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device=device, dtype=TDT[dtype])


def skip_cuda_f32(device, dtype):
    if device == "cuda" and dtype == "float32":
        pytest.skip("the CUDA backend takes f16/bf16 queries (kvattn.h: q_dtype CUDA: f16, bf16)")


def check(o, lse, q, k, v, vis, dtype, tag):
    ro, rl = attention(np64(q), np64(k), np64(v), mask=vis)
    assert_close(np64(o), ro, *TOL[dtype], what="o (%s)" % tag)
    if lse is not None:
        assert_close(np64(lse), rl, *LSE_TOL[dtype], what="lse (%s)" % tag)


# (M, N, R, C): vector sparsity (C = 1), single-row blocks (R = 1), short last block rows, square blocks
SHAPES = [(37, 64, 1, 16), (50, 96, 16, 16), (19, 40, 3, 1), (70, 48, 16, 3), (130, 256, 64, 16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M%d-N%d-R%d-C%d" % s)
@pytest.mark.parametrize("mode", ["blocks", "mask", "packed_mask", "causal"])
def test_matches_reference(seeded, device, dtype, shape, mode):
    skip_cuda_f32(device, dtype)
    seed, rng = seeded
    M, N, R, C = shape
    hq, hkv, d = 8, 2, 64
    indptr, indices = bsr_random(rng, M, N, R, C, 0.5)
    nnz = int(indptr[-1])
    mask = rng.random((nnz, R, C)) < 0.7
    q, k, v = tensor(rng, (M, hq, d), dtype, device), tensor(rng, (N, hkv, d), dtype, device), \
        tensor(rng, (N, hkv, d), dtype, device)
    kw = {}
    if mode == "mask":
        kw["mask"] = torch.from_numpy(mask).to(device)  # a bool tensor on the wrapper's device
    elif mode == "packed_mask":
        kw["packed_mask"] = torch.from_numpy(bsr_packed_mask(mask, indptr, M, R, C)).to(device)
    elif mode == "causal":
        kw["causal"] = True
    w = kvattn.BlockSparseAttentionWrapper(ws(device))
    # indptr on the host (NumPy), indices as a device tensor: plan copies what it needs
    w.plan(indptr, torch.from_numpy(indices).to(device), M, N, R, C, hq, hkv, d, q_data_type=TDT[dtype],
           o_data_type=TDT[dtype], **kw)
    o, lse = w.run(q, k, v, return_lse=True)
    tag = "seed %d, %s" % (seed, mode)
    assert o.device.type == device and o.dtype == TDT[dtype] and tuple(o.shape) == (M, hq, d), tag
    assert lse.device.type == device and lse.dtype == torch.float32 and tuple(lse.shape) == (M, hq), tag
    vis = bsr_dense_visible(indptr, indices, M, N, R, C, mask if mode in ("mask", "packed_mask") else None,
                            causal=mode == "causal")
    check(o, lse, q, k, v, vis, dtype, tag)


@pytest.mark.parametrize("device", DEVICES)
def test_quest_like_decode_row(seeded, device):
    """The C2 benchmark's shape: one decode row (M = R = 1), pages of 16 (C = 16), MHA 32/32, D 128, bf16; a
    sorted random page budget that always includes the last page."""
    seed, rng = seeded
    npages, budget, hq, d = 128, 24, 32, 128
    N = npages * 16
    sel = np.sort(np.concatenate([rng.choice(npages - 1, budget - 1, replace=False), [npages - 1]]))
    indptr = np.array([0, budget], np.int32)
    q, k, v = tensor(rng, (1, hq, d), "bfloat16", device), tensor(rng, (N, hq, d), "bfloat16", device), \
        tensor(rng, (N, hq, d), "bfloat16", device)
    w = kvattn.BlockSparseAttentionWrapper(ws(device))
    w.plan(torch.from_numpy(indptr), torch.from_numpy(sel.astype(np.int32)), 1, N, 1, 16, hq, hq, d,
           q_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
    o, lse = w.run(q, k, v, return_lse=True)
    vis = bsr_dense_visible(indptr, sel, 1, N, 1, 16)
    assert vis.sum() == budget * 16
    check(o, lse, q, k, v, vis, "bfloat16", "seed %d" % seed)


@pytest.mark.parametrize("device", DEVICES)
def test_out_lse_buffers_and_strided_views(seeded, device):
    """out= / lse= are written in place and returned (lse= alone fills it without returning it); q, k, v and out
    may be strided views (k and v of one fused [N, 2, H, D] tensor, out inside a wider buffer)."""
    seed, rng = seeded
    M, N, R, C, hq, hkv, d = 33, 64, 8, 16, 4, 2, 64
    indptr, indices = bsr_random(rng, M, N, R, C, 0.6)
    kv = tensor(rng, (N, 2, hkv, d), "float16", device)
    k, v = kv[:, 0], kv[:, 1]
    qbuf = tensor(rng, (M, hq, 2 * d), "float16", device)
    q = qbuf[:, :, d:]
    w = kvattn.BlockSparseAttentionWrapper(ws(device))
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, causal=True, q_data_type="float16", o_data_type="float16")
    vis = bsr_dense_visible(indptr, indices, M, N, R, C, causal=True)
    obuf = torch.full((M, hq, 2 * d), float("nan"), dtype=torch.float16, device=device)
    out = obuf[:, :, :d]
    lse = torch.full((M, hq), float("nan"), dtype=torch.float32, device=device)
    o, l = w.run(q, k, v, out=out, lse=lse, return_lse=True)
    assert o is out and l is lse, "seed %d" % seed
    check(out, lse, q, k, v, vis, "float16", "seed %d, out=/lse=" % seed)
    assert torch.isnan(obuf[:, :, d:]).all(), "seed %d: run wrote outside the out view" % seed
    lse2 = torch.full((M, hq), float("nan"), dtype=torch.float32, device=device)
    res = w.run(q, k, v, lse=lse2)
    assert isinstance(res, torch.Tensor), "seed %d: lse= without return_lse returns out only" % seed
    check(res, lse2, q, k, v, vis, "float16", "seed %d, lse= only" % seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("o_data_type", [None, "float32", "bfloat16"])
def test_o_data_type(seeded, device, o_data_type):
    """bf16 q/kv with each output dtype; o_data_type defaults to float16 as in FlashInfer."""
    seed, rng = seeded
    M, N, R, C, hq, hkv, d = 20, 48, 4, 16, 8, 8, 128
    indptr, indices = bsr_random(rng, M, N, R, C, 0.7)
    q, k, v = tensor(rng, (M, hq, d), "bfloat16", device), tensor(rng, (N, hkv, d), "bfloat16", device), \
        tensor(rng, (N, hkv, d), "bfloat16", device)
    w = kvattn.BlockSparseAttentionWrapper(ws(device))
    kw = {} if o_data_type is None else {"o_data_type": o_data_type}
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, q_data_type="bfloat16", **kw)
    o = w.run(q, k, v)
    want = torch.float16 if o_data_type is None else TDT[o_data_type]
    assert o.dtype == want, "seed %d: o dtype %s, expected %s" % (seed, o.dtype, want)
    # the tolerance of the coarser of bf16 inputs and the output dtype
    check(o, None, q, k, v, bsr_dense_visible(indptr, indices, M, N, R, C), "bfloat16", "seed %d" % seed)


@pytest.mark.parametrize("device", DEVICES)
def test_plan_owns_its_copies(seeded, device):
    """After plan(), overwriting (and freeing) the caller's indptr / indices / mask tensors does not change what
    run() computes: the wrapper keeps its own host and backend copies alive."""
    seed, rng = seeded
    M, N, R, C, hq, hkv, d = 40, 80, 8, 16, 4, 4, 64
    indptr, indices = bsr_random(rng, M, N, R, C, 0.5)
    mask = rng.random((int(indptr[-1]), R, C)) < 0.6
    vis = bsr_dense_visible(indptr, indices, M, N, R, C, mask)
    t_indptr = torch.from_numpy(indptr.copy()).to(device)
    t_indices = torch.from_numpy(indices.copy()).to(device)
    t_mask = torch.from_numpy(mask.copy()).to(device)
    q, k, v = tensor(rng, (M, hq, d), "float16", device), tensor(rng, (N, hkv, d), "float16", device), \
        tensor(rng, (N, hkv, d), "float16", device)
    w = kvattn.BlockSparseAttentionWrapper(ws(device))
    w.plan(t_indptr, t_indices, M, N, R, C, hq, hkv, d, mask=t_mask, q_data_type="float16")
    t_indices.copy_((t_indices + 1) % (N // C))
    t_indptr[1:] = int(indptr[-1])
    t_mask.logical_not_()
    del t_indptr, t_indices, t_mask
    if device == "cuda":
        torch.cuda.empty_cache()
        junk = [torch.full((4096,), -7, dtype=torch.int32, device=device) for _ in range(64)]  # reuse freed memory
        del junk
    check(w.run(q, k, v), None, q, k, v, vis, "float16", "seed %d" % seed)


@pytest.mark.parametrize("device", DEVICES)
def test_dtype_and_argument_errors(seeded, device):
    seed, rng = seeded
    M, N, R, C, hq, hkv, d = 16, 32, 4, 16, 4, 2, 64
    indptr, indices = bsr_random(rng, M, N, R, C, 1.0)
    w = kvattn.BlockSparseAttentionWrapper(ws(device))
    with pytest.raises(TypeError, match="mask"):
        w.plan(indptr, indices, M, N, R, C, hq, hkv, d, mask=torch.ones(int(indptr[-1]), R, C, device=device))
    with pytest.raises(TypeError, match="packed_mask"):
        w.plan(indptr, indices, M, N, R, C, hq, hkv, d,
               packed_mask=torch.zeros(64, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="indices"):
        w.plan(indptr, torch.from_numpy(indices).float(), M, N, R, C, hq, hkv, d)
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, q_data_type=torch.bfloat16, o_data_type=torch.float16)
    q, k, v = tensor(rng, (M, hq, d), "bfloat16", device), tensor(rng, (N, hkv, d), "bfloat16", device), \
        tensor(rng, (N, hkv, d), "bfloat16", device)
    with pytest.raises(kvattn.PlanMismatchError, match="q_data_type"):
        w.run(q.half(), k, v)
    with pytest.raises(kvattn.PlanMismatchError, match="kv_data_type"):
        w.run(q, k, v.half())
    with pytest.raises(kvattn.PlanMismatchError, match="o_data_type"):
        w.run(q, k, v, out=torch.empty(M, hq, d, dtype=torch.bfloat16, device=device))
    with pytest.raises(kvattn.PlanMismatchError, match="float32"):
        w.run(q, k, v, lse=torch.empty(M, hq, dtype=torch.float16, device=device))
    with pytest.raises(kvattn.PlanMismatchError, match="shape"):
        w.run(q, k, v, lse=torch.empty(M, hq + 1, dtype=torch.float32, device=device))
    with pytest.raises(kvattn.PlanMismatchError, match="shape"):
        w.run(q[:-1], k, v)
    with pytest.raises(TypeError, match="float64"):
        w.run(q.double(), k, v)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        w.run(q, k.transpose(1, 2).contiguous().transpose(1, 2), v)
    with pytest.raises(NotImplementedError):
        w.run(q, k, v, scale_q=torch.ones(hq, device=device))
    if device == "cuda":
        with pytest.raises(ValueError, match="workspace is on cuda"):
            w.run(q.cpu(), k, v)
        with pytest.raises(kvattn.UnsupportedError, match="f16 or bf16"):
            w.plan(indptr, indices, M, N, R, C, hq, hkv, d, q_data_type="float32")
    else:
        o = w.run(q, k, v)  # the failed calls left the plan usable
        check(o, None, q, k, v, bsr_dense_visible(indptr, indices, M, N, R, C), "bfloat16", "seed %d" % seed)


# ---- CUDA only -----------------------------------------------------------------------------------


def _cuda_case(rng, M=96, N=512, R=16, C=16, hq=8, hkv=2, d=128, dtype="bfloat16"):
    indptr, indices = bsr_random(rng, M, N, R, C, 0.4)
    mask = rng.random((int(indptr[-1]), R, C)) < 0.8
    q, k, v = tensor(rng, (M, hq, d), dtype, "cuda"), tensor(rng, (N, hkv, d), dtype, "cuda"), \
        tensor(rng, (N, hkv, d), dtype, "cuda")
    w = kvattn.BlockSparseAttentionWrapper(ws("cuda"))
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, mask=mask, q_data_type=TDT[dtype], o_data_type=TDT[dtype])
    return w, q, k, v, bsr_dense_visible(indptr, indices, M, N, R, C, mask)


@needs_cuda
def test_cuda_run_does_not_synchronize(seeded):
    seed, rng = seeded
    w, q, k, v, vis = _cuda_case(rng)
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising torch call inside run() raises
    try:
        o, lse = w.run(q, k, v, return_lse=True)
        o2 = torch.empty_like(o)
        w.run(q, k, v, out=o2)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    check(o, lse, q, k, v, vis, "bfloat16", "seed %d" % seed)
    assert torch.equal(o, o2), "seed %d: two runs of one plan differ" % seed


@needs_cuda
def test_cuda_runs_on_the_current_stream(seeded):
    seed, rng = seeded
    w, q, k, v, vis = _cuda_case(rng)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        v2 = v * 2.0  # produced on s: the run must be ordered after it on s
        o, lse = w.run(q, k, v2, return_lse=True)
    s.synchronize()
    check(o, lse, q, k, v2, vis, "bfloat16", "seed %d" % seed)


@needs_cuda
def test_cuda_graph_capture_and_replay(seeded):
    """A run captured into a CUDA graph replays the same plan over whatever q/k/v hold at replay time."""
    seed, rng = seeded
    M, N, hq, hkv, d = 96, 512, 8, 2, 128
    w, q, k, v, vis = _cuda_case(rng, M=M, N=N, hq=hq, hkv=hkv, d=d)
    out = torch.empty(M, hq, d, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(M, hq, dtype=torch.float32, device="cuda")
    w.run(q, k, v, out=out, lse=lse)  # warm-up outside capture
    torch.cuda.synchronize()
    check(out, lse, q, k, v, vis, "bfloat16", "seed %d, eager" % seed)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, k, v, out=out, lse=lse)
    for i in range(3):
        q.copy_(tensor(rng, (M, hq, d), "bfloat16", "cuda"))
        k.copy_(tensor(rng, (N, hkv, d), "bfloat16", "cuda"))
        v.copy_(tensor(rng, (N, hkv, d), "bfloat16", "cuda"))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out, lse, q, k, v, vis, "bfloat16", "seed %d, replay %d" % (seed, i))
    # the captured run's backend arrays stay alive with the wrapper even after a new plan; a fresh capture then
    # runs the new plan
    indptr2, indices2 = bsr_random(rng, M, N, 16, 16, 0.3)
    w.plan(indptr2, indices2, M, N, 16, 16, hq, hkv, d, causal=True, q_data_type="bfloat16",
           o_data_type="bfloat16")
    w.run(q, k, v, out=out, lse=lse)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        w.run(q, k, v, out=out, lse=lse)
    out.fill_(float("nan"))
    g2.replay()
    torch.cuda.synchronize()
    check(out, lse, q, k, v, bsr_dense_visible(indptr2, indices2, M, N, 16, 16, causal=True), "bfloat16",
          "seed %d, second plan" % seed)


@needs_cuda
def test_cuda_matches_dense_sdpa_with_the_boolean_mask(seeded):
    """kvattn's block-sparse decode row equals SDPA (math backend, float32) with the equivalent boolean mask."""
    seed, rng = seeded
    npages, budget, h, d = 256, 64, 32, 128
    N = npages * 16
    sel = np.sort(np.concatenate([rng.choice(npages - 1, budget - 1, replace=False), [npages - 1]]))
    q, k, v = tensor(rng, (1, h, d), "bfloat16", "cuda"), tensor(rng, (N, h, d), "bfloat16", "cuda"), \
        tensor(rng, (N, h, d), "bfloat16", "cuda")
    w = kvattn.BlockSparseAttentionWrapper(ws("cuda"))
    w.plan(np.array([0, budget], np.int32), sel.astype(np.int32), 1, N, 1, 16, h, h, d,
           q_data_type="bfloat16", o_data_type="bfloat16")
    o = w.run(q, k, v)
    page_vis = torch.zeros(npages, dtype=torch.bool, device="cuda")
    page_vis[torch.from_numpy(sel).cuda()] = True
    mask = page_vis.repeat_interleave(16)[None, None, None, :]  # [1, 1, 1, N]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
        attn_mask=mask)[0].transpose(0, 1)
    err = (o.float() - ref).abs().max().item()
    assert err < 2e-2, "seed %d: max |kvattn - SDPA| = %g" % (seed, err)
