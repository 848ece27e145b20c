"""torch front end: torch CPU tensors on the CPU backend and torch CUDA tensors on the CUDA backend, against the
float64 reference; CUDA-graph capture -> re-plan -> replay; torch.compile through the custom ops.

Skipped (with the reason shown) where torch is not installed; the CUDA cases are skipped unless
torch.cuda.is_available()."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch front-end tests need it")

import kvattn  # noqa: E402
from reference import TOL, assert_close, attention, gather_kv, make_paged, merge, paged_decode  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available (torch.cuda.is_available() is False)")

TDT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def np64(x):
    return x.detach().float().cpu().numpy().astype(np.float64)


def ws(device, nbytes=64 << 20):
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def paged_case(rng, kv_lens, ps, hkv, d, dtype, device, layout="NHD"):
    cache, indptr, indices, last, P = make_paged(rng, kv_lens, ps, hkv, d, np.float32, layout)
    return torch.from_numpy(cache).to(device=device, dtype=dtype), indptr, indices, last, P


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_batch_decode(rng, device, dtype, layout, group):
    if device == "cuda" and dtype == "float32":
        pytest.skip("the CUDA backend takes f16/bf16 queries (kvattn.h: q_dtype CUDA: f16, bf16)")
    lens, ps, hkv, d = [0, 1, 33, 130, 16], 16, 2, 64
    cache, indptr, indices, last, _ = paged_case(rng, lens, ps, hkv, d, TDT[dtype], device, layout)
    q = torch.randn(len(lens), hkv * group, d, device=device).to(TDT[dtype])
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(device), kv_layout=layout)
    # indices on the device (like vLLM), indptr / last_page_len on the host
    w.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(device), torch.from_numpy(last), hkv * group,
           hkv, d, ps, q_data_type=TDT[dtype])
    o, lse = w.run(q, cache, return_lse=True)
    assert o.device.type == device and o.dtype == TDT[dtype]
    atol, rtol = TOL[dtype]
    c = np64(cache)
    for b, n in enumerate(lens):
        k, v = gather_kv(c[:, 0], c[:, 1], indptr, indices, b, n, layout)
        ro, rl = attention(np64(q[b:b + 1]), k, v)
        assert_close(np64(o[b]), ro[0], atol, rtol, "o[%d]" % b)
        assert_close(np64(lse[b]), rl[0], atol, rtol, "lse[%d]" % b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graph", [False, True])
def test_batch_decode_block_tables(rng, device, graph):
    """plan(block_tables=, seq_lens=): a torch [B, max_blocks] table on the device (int32, or int64 converted; a row
    slice of a wider table), lengths on the host; the same output as the CSR form, bit for bit. Graph wrappers copy
    the table into their indices buffer."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lens, ps, hkv, hq, d = [0, 1, 33, 130, 16, 0], 16, 2, 8, 64
    cache, indptr, indices, last, P = paged_case(rng, lens, ps, hkv, d, dtype, device)
    q = torch.randn(len(lens), hq, d, device=device).to(dtype)
    B = len(lens)

    def wrapper(nidx):
        if not graph:
            return kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(device))
        return kvattn.BatchDecodeWithPagedKVCacheWrapper(
            ws(device), use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(B + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(nidx, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(B, dtype=torch.int32, device=device))

    w = wrapper(len(indices) + 8)
    w.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(device), torch.from_numpy(last), hq, hkv, d, ps,
           q_data_type=dtype)
    ref = w.run(q, cache)
    pages = np.diff(indptr)
    wide = torch.full((B, int(pages.max()) + 6), -1, dtype=torch.int32)
    for b in range(B):
        wide[b, :pages[b]] = torch.from_numpy(indices[indptr[b]:indptr[b + 1]])
    for table in (wide.to(device), wide[:, :int(pages.max()) + 1].to(device), wide.to(torch.int64).to(device)):
        wb = wrapper(B * wide.shape[1])
        wb.plan(None, None, None, hq, hkv, d, ps, q_data_type=dtype, block_tables=table,
                seq_lens=torch.tensor(lens, dtype=torch.int32), num_pages=P)
        out = wb.run(q, cache)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_decode_zero_requests(rng, device):
    """A step with no decode requests (empty tensors: a NULL data pointer on CUDA) returns empty outputs."""
    dt = torch.float16 if device == "cuda" else torch.float32
    cache, indptr, indices, last, _ = paged_case(rng, [7, 40], 16, 2, 64, dt, device)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(device))
    w.plan(np.array([0], np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), 8, 2, 64, 16, q_data_type=dt)
    o, lse = w.run(torch.empty(0, 8, 64, device=device, dtype=dt), cache, return_lse=True)
    assert tuple(o.shape) == (0, 8, 64) and tuple(lse.shape) == (0, 8)
    if device == "cuda":
        torch.cuda.synchronize()
    # the wrapper then serves a real step
    q = torch.randn(2, 8, 64, device=device).to(dt)
    w.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(device), torch.from_numpy(last), 8, 2, 64, 16,
           q_data_type=dt)
    o = w.run(q, cache)
    atol, rtol = TOL["float16" if device == "cuda" else "float32"]
    assert_close(np64(o), _decode_ref(q, cache, indptr, indices, [7, 40]), atol, rtol, what="after the empty step")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_replans_in_place_and_grow(rng, device):
    """Re-plans of one wrapper go straight into the plan memory of its earlier plan when they fit and size it again
    when they do not (a batch of 600 after one of 2, then back): every step matches the reference, and the outputs of
    a step are not touched by the next plan."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    atol, rtol = TOL["bfloat16" if device == "cuda" else "float32"]
    ps, hkv, hq, d = 16, 2, 8, 64
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(device))
    small = [300, 5]
    big = [int(x) for x in rng.integers(0, 70, 600)]
    steps, sizes = [], []
    for lens in (small, big, small, big):
        cache, indptr, indices, last, _ = paged_case(rng, lens, ps, hkv, d, dt, device)
        q = torch.randn(len(lens), hq, d, device=device).to(dt)
        w.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(device), torch.from_numpy(last), hq, hkv, d, ps,
               q_data_type=dt)
        o = w.run(q, cache)
        steps.append((lens, q, cache, indptr, indices, o))
        sizes.append(w.plan_info()["device_bytes"])
    assert sizes[1] > sizes[0] and sizes[3] > sizes[2]  # the batch of 600 needed more plan memory
    for i, (lens, q, cache, indptr, indices, o) in enumerate(steps):
        assert_close(np64(o), _decode_ref(q, cache, indptr, indices, lens), atol, rtol, what="step %d" % i)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", [dict(causal=True), dict(causal=True, pos_encoding_mode="ROPE_LLAMA"),
                                     dict(causal=True, logits_soft_cap=5.0, window_left=20),
                                     dict(causal=False, pos_encoding_mode="ALIBI")])
def test_batch_prefill_paged(rng, device, feature):
    qo_lens, kv_lens, ps, hq, hkv, d = [1, 17, 0, 64], [20, 17, 5, 200], 16, 8, 2, 128
    cache, indptr, indices, last, _ = paged_case(rng, kv_lens, ps, hkv, d, torch.float16, device)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, device=device).half()
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws(device))
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.float16, **feature)
    o, lse = w.run(q, cache, return_lse=True)
    kw = {k: v for k, v in feature.items() if k != "pos_encoding_mode"}
    if "pos_encoding_mode" in feature:
        kw["pos_encoding"] = feature["pos_encoding_mode"]
    c = np64(cache)
    for b, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        k, v = gather_kv(c[:, 0], c[:, 1], indptr, indices, b, kv)
        rs = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        ro, rl = attention(np64(q[rs]), k, v, **kw)
        assert_close(np64(o[rs]), ro, *TOL["float16"], what="o[%d]" % b)
        assert_close(np64(lse[rs]), rl, *TOL["float16"], what="lse[%d]" % b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_batch_prefill_ragged(rng, device, causal):
    qo_lens, kv_lens, hq, hkv, d = [3, 0, 40, 7], [3, 9, 100, 7], 8, 8, 64
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, device=device).bfloat16()
    k = torch.randn(int(kv_indptr[-1]), hkv, d, device=device).bfloat16()
    v = torch.randn(int(kv_indptr[-1]), hkv, d, device=device).bfloat16()
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(ws(device))
    w.plan(torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr), hq, hkv, d, causal=causal,
           q_data_type="bfloat16")
    o, lse = w.run_return_lse(q, k, v)
    for b in range(len(qo_lens)):
        rs, ks = slice(int(qo_indptr[b]), int(qo_indptr[b + 1])), slice(int(kv_indptr[b]), int(kv_indptr[b + 1]))
        ro, rl = attention(np64(q[rs]), np64(k[ks]), np64(v[ks]), causal=causal)
        assert_close(np64(o[rs]), ro, *TOL["bfloat16"], what="o[%d]" % b)
        assert_close(np64(lse[rs]), rl, *TOL["bfloat16"], what="lse[%d]" % b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_decode_fp8_kv(rng, device, fp8):
    if not hasattr(torch, fp8):
        pytest.skip("this torch has no %s" % fp8)
    lens, ps, hq, hkv, d = [7, 64, 300], 16, 8, 1, 128
    cache, indptr, indices, last, _ = paged_case(rng, lens, ps, hkv, d, torch.float32, device)
    cache8 = cache.to(getattr(torch, fp8))
    q = torch.randn(len(lens), hq, d, device=device).half()
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(device))
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float16", kv_data_type=getattr(torch, fp8))
    ks, vs = 0.5, 2.0
    o = w.run(q, cache8, k_scale=ks, v_scale=vs)
    c = np64(cache8)
    for b, n in enumerate(lens):
        k, v = gather_kv(c[:, 0], c[:, 1], indptr, indices, b, n)
        ro, _ = attention(np64(q[b:b + 1]), k * ks, v * vs)
        assert_close(np64(o[b]), ro[0], 2e-2, 2e-2, "o[%d]" % b)
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q, cache.half())


@pytest.mark.parametrize("device", DEVICES)
def test_single_ops(rng, device):
    q = torch.randn(32, 128, device=device).half()
    k = torch.randn(257, 4, 128, device=device).half()
    v = torch.randn(257, 4, 128, device=device).half()
    o, lse = kvattn.single_decode_with_kv_cache(q, k, v, return_lse=True, pos_encoding_mode="ROPE_LLAMA")
    ro, rl = attention(np64(q)[None], np64(k), np64(v), pos_encoding="ROPE_LLAMA")
    assert_close(np64(o), ro[0], *TOL["float16"])
    assert_close(np64(lse), rl[0], *TOL["float16"])
    qp = torch.randn(50, 32, 128, device=device).half()
    o = kvattn.single_prefill_with_kv_cache(qp, k.transpose(0, 1), v.transpose(0, 1), kv_layout="HND", causal=True)
    ro, _ = attention(np64(qp), np64(k), np64(v), causal=True)
    assert_close(np64(o), ro, *TOL["float16"])
    mask = torch.rand(50, 257, device=device) < 0.5
    o, lse = kvattn.single_prefill_with_kv_cache_return_lse(qp, k, v, custom_mask=mask)
    ro, rl = attention(np64(qp), np64(k), np64(v), mask=mask.cpu().numpy())
    assert_close(np64(o), ro, *TOL["float16"])
    assert_close(np64(lse), rl, *TOL["float16"])


@pytest.mark.parametrize("device", DEVICES)
def test_merge_and_append(rng, device):
    n, h, d = 9, 4, 64
    va, vb = torch.randn(n, h, d, device=device).half(), torch.randn(n, h, d, device=device).half()
    sa, sb = torch.randn(n, h, device=device) * 3, torch.randn(n, h, device=device) * 3
    sa[0] = -float("inf")
    sb[0] = -float("inf")
    v, s = kvattn.merge_state(va, sa, vb, sb)
    rv, rs = merge(np64(va), np64(sa), np64(vb), np64(sb))
    assert_close(np64(v), rv, *TOL["float16"])
    assert_close(np64(s), rs, 1e-4, 1e-4)
    vi, si = va.clone(), sa.clone()
    mask = torch.tensor([True, False] * 4 + [True], device=device)
    kvattn.merge_state_in_place(vi, si, vb, sb, mask=mask)
    m = mask.cpu().numpy()
    assert_close(np64(vi)[m], rv[m], *TOL["float16"])
    assert torch.equal(vi[~mask], va[~mask])
    vs_ = torch.randn(n, 3, h, d, device=device).half()
    ss_ = torch.randn(n, 3, h, device=device)
    vo, so = kvattn.merge_states(vs_, ss_)
    rv, rs = np64(vs_[:, 0]), np64(ss_[:, 0])
    for i in range(1, 3):
        rv, rs = merge(rv, rs, np64(vs_[:, i]), np64(ss_[:, i]))
    assert_close(np64(vo), rv, *TOL["float16"])
    # append
    ps, hkv = 16, 2
    total = [20, 3]
    cache = torch.zeros(6, 2, ps, hkv, d, device=device, dtype=torch.half)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    indices = torch.tensor([4, 1, 3], dtype=torch.int32, device=device)
    last = torch.tensor([4, 3], dtype=torch.int32, device=device)
    ai = torch.tensor([0, 4, 7], dtype=torch.int32, device=device)
    seq = kvattn.get_seq_lens(indptr, last, ps)
    assert seq.tolist() == total
    bi, pos = kvattn.get_batch_indices_positions(ai, seq, 7)
    assert bi.tolist() == [0, 0, 0, 0, 1, 1, 1] and pos.tolist() == [16, 17, 18, 19, 0, 1, 2]
    ak = torch.randn(7, hkv, d, device=device).half()
    av = torch.randn(7, hkv, d, device=device).half()
    kvattn.append_paged_kv_cache(ak, av, bi, pos, cache, indices, indptr, last)
    assert torch.equal(cache[1, 0, :4], ak[:4]) and torch.equal(cache[1, 1, :4], av[:4])
    assert torch.equal(cache[3, 0, :3], ak[4:]) and torch.equal(cache[3, 1, :3], av[4:])
    packed = kvattn.packbits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], device=device, dtype=torch.bool),
                             bitorder="little")
    assert packed.tolist() == [13, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_append_by_slot(device):
    ps, hkv, d = 16, 2, 64
    cache = torch.randn(6, 2, ps, hkv, d, device=device).half()
    before = cache.clone()
    slots = torch.tensor([4 * ps + 3, -1, 0, 5 * ps + 15, 2 * ps + 7], device=device)  # int64, one padding token
    ak = torch.randn(5, hkv, d, device=device).half()
    av = torch.randn(5, hkv, d, device=device).half()
    kvattn.append_paged_kv_cache_by_slot(ak, av, slots, cache)
    expect = before.clone()
    for j, sl in enumerate(slots.tolist()):
        if sl >= 0:
            expect[sl // ps, 0, sl % ps] = ak[j]
            expect[sl // ps, 1, sl % ps] = av[j]
    assert torch.equal(cache, expect)
    # an int32 host slot mapping is converted and copied
    kvattn.append_paged_kv_cache_by_slot(av, ak, slots.cpu().to(torch.int32), cache)
    for j, sl in enumerate(slots.tolist()):
        if sl >= 0:
            expect[sl // ps, 0, sl % ps] = av[j]
            expect[sl // ps, 1, sl % ps] = ak[j]
    assert torch.equal(cache, expect)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_append_by_slot(device):
    """torch.compile (fullgraph) traces the slot append as the custom op that mutates the cache: the same cache as the
    eager call, K and V given apart (HND) and a computed slot mapping inside the traced function."""
    ps, hkv, d = 8, 2, 32
    kc = torch.randn(5, hkv, ps, d, device=device).half()
    vc = torch.randn(5, hkv, ps, d, device=device).half()
    page = torch.tensor([3, 0, 4, 1], device=device)
    off = torch.tensor([7, 2, 0, 5], device=device)
    ak = torch.randn(4, hkv, d, device=device).half()

    def step(ak, kc, vc, page, off):
        slots = torch.where(off == 0, torch.full_like(page, -1), page * ps + off)  # token 2: padding
        kvattn.append_paged_kv_cache_by_slot(ak, ak * 2, slots, (kc, vc), kv_layout="HND")
        return kc.sum()

    wk, wv = kc.clone(), vc.clone()
    want = step(ak, wk, wv, page, off)
    backend = "inductor" if device == "cuda" else "aot_eager"
    got = torch.compile(step, fullgraph=True, backend=backend)(ak, kc, vc, page, off)
    assert torch.equal(kc, wk) and torch.equal(vc, wv)
    assert torch.equal(got, want)
    assert torch.equal(kc[3, :, 7], ak[0]) and torch.equal(vc[1, :, 5], ak[3] * 2)


@pytest.mark.parametrize("device", DEVICES)
def test_append_kv_indptr_past_kv_indices(device):
    """kv_indptr reaching past kv_indices: CPU raises before writing; CUDA (the table cannot be read without a
    sync) writes the valid request's tokens and none of the request whose pages lie past the table."""
    torch.manual_seed(23)
    ps, hkv, d = 16, 2, 64
    cache = torch.randn(6, 2, ps, hkv, d, device=device).half()
    before = cache.clone()
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    indices = torch.tensor([4, 1, 3], dtype=torch.int32, device=device)[:2]  # request 1's page entry is missing
    last = torch.tensor([4, 3], dtype=torch.int32, device=device)
    bi = torch.tensor([0, 0, 1, 1], dtype=torch.int32, device=device)
    pos = torch.tensor([16, 17, 0, 1], dtype=torch.int32, device=device)
    ak = torch.randn(4, hkv, d, device=device).half()
    av = torch.randn(4, hkv, d, device=device).half()
    if device == "cpu":
        with pytest.raises(ValueError):
            kvattn.append_paged_kv_cache(ak, av, bi, pos, cache, indices, indptr, last)
        assert torch.equal(cache, before)
        return
    kvattn.append_paged_kv_cache(ak, av, bi, pos, cache, indices, indptr, last)
    torch.cuda.synchronize()
    expect = before.clone()
    expect[1, 0, :2] = ak[:2]
    expect[1, 1, :2] = av[:2]
    assert torch.equal(cache, expect)


def _decode_ref(q, cache, indptr, indices, lens):
    return paged_decode(np64(q), np64(cache), indptr, indices, lens)


@needs_cuda
def test_cuda_graph_capture_replan_replay(rng):
    """Capture run() once, then plan other lengths (same batch size) and replay: the replay uses the new plan."""
    B, ps, hq, hkv, d, P = 4, 16, 32, 8, 128, 64
    dev = "cuda"
    indptr_buf = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    indices_buf = torch.zeros(P, dtype=torch.int32, device=dev)
    last_buf = torch.zeros(B, dtype=torch.int32, device=dev)
    w = kvattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(dev), indptr_buf, indices_buf, last_buf)
    cache = torch.randn(P, 2, ps, hkv, d, device=dev).half()
    q = torch.randn(B, hq, d, device=dev).half()
    out = torch.empty(B, hq, d, device=dev, dtype=torch.half)
    lse = torch.empty(B, hq, device=dev, dtype=torch.float32)

    def table(lens):
        pages = [(n + ps - 1) // ps for n in lens]
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = rng.permutation(P)[: indptr[-1]].astype(np.int32)
        last = np.array([((n - 1) % ps) + 1 if n else 1 for n in lens], np.int32)
        return indptr, indices, last

    lens_a = [5, 100, 17, 1]
    ta = table(lens_a)
    w.plan(*ta, hq, hkv, d, ps, q_data_type=torch.float16)
    w.run(q, cache, out=out, lse=lse)  # warm-up outside capture (kernels loaded, pool size learnt)
    torch.cuda.synchronize()
    assert_close(np64(out), _decode_ref(q, cache, ta[0], ta[1], lens_a), *TOL["float16"], what="eager A")

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out, lse=lse)
    for lens in ([700, 0, 33, 260], [1, 1, 1, 1], lens_a):
        t = table(lens)
        w.plan(*t, hq, hkv, d, ps, q_data_type=torch.float16)
        q.copy_(torch.randn(B, hq, d, device=dev).half())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(np64(out), _decode_ref(q, cache, t[0], t[1], lens), *TOL["float16"], what="replay %s" % lens)


@needs_cuda
def test_cuda_graph_prefill_paged_replan_replay(rng):
    B, ps, hq, hkv, d, P = 3, 16, 8, 2, 128, 48
    dev = "cuda"
    bufs = dict(qo_indptr_buf=torch.zeros(B + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=torch.zeros(B + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buf=torch.zeros(P, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buf=torch.zeros(B, dtype=torch.int32, device=dev))
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws(dev), use_cuda_graph=True, **bufs)
    cache = torch.randn(P, 2, ps, hkv, d, device=dev).half()
    max_rows = 24
    q = torch.randn(max_rows, hq, d, device=dev).half()
    out = torch.zeros(max_rows, hq, d, device=dev, dtype=torch.half)

    def case(qo_lens, kv_lens):
        pages = [(n + ps - 1) // ps for n in kv_lens]
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = rng.permutation(P)[: indptr[-1]].astype(np.int32)
        last = np.array([((n - 1) % ps) + 1 if n else 1 for n in kv_lens], np.int32)
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        return qo_indptr, indptr, indices, last

    def check(c, qo_lens, kv_lens):
        cc = np64(cache)
        for b in range(B):
            k, v = gather_kv(cc[:, 0], cc[:, 1], c[1], c[2], b, kv_lens[b])
            rs = slice(int(c[0][b]), int(c[0][b + 1]))
            ro, _ = attention(np64(q[rs]), k, v, causal=True)
            assert_close(np64(out[rs]), ro, *TOL["float16"], what="req %d" % b)

    first = case([8, 8, 8], [40, 8, 200])  # the first plan's rows bound later plans
    w.plan(*first, hq, hkv, d, ps, causal=True, q_data_type="float16")
    w.run(q, cache, out=out)
    torch.cuda.synchronize()
    check(first, [8, 8, 8], [40, 8, 200])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out)
    for qo_lens, kv_lens in (([1, 20, 3], [1, 300, 3]), ([0, 0, 24], [0, 5, 600])):
        c = case(qo_lens, kv_lens)
        w.plan(*c, hq, hkv, d, ps, causal=True, q_data_type="float16")
        g.replay()
        torch.cuda.synchronize()
        check(c, qo_lens, kv_lens)


@needs_cuda
def test_capture_of_non_graph_wrapper_raises(rng):
    cache, indptr, indices, last, _ = paged_case(rng, [5, 9], 16, 2, 64, torch.half, "cuda")
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws("cuda"))
    w.plan(indptr, indices, last, 4, 2, 64, 16, q_data_type="float16")
    q = torch.randn(2, 4, 64, device="cuda").half()
    out = torch.empty_like(q)
    w.run(q, cache, out=out)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(kvattn.CaptureActiveError, match="use_cuda_graph"):
        with torch.cuda.graph(g):
            w.run(q, cache, out=out)


@needs_cuda
def test_runs_on_the_current_stream(rng):
    lens = [300, 1000]
    cache, indptr, indices, last, _ = paged_case(rng, lens, 16, 2, 128, torch.half, "cuda")
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws("cuda"))
    w.plan(indptr, indices, last, 16, 2, 128, 16, q_data_type="float16")
    q = torch.randn(2, 16, 128, device="cuda").half()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o = w.run(q, cache)
    s.synchronize()
    assert_close(np64(o), _decode_ref(q, cache, indptr, indices, lens), *TOL["float16"])


needs_two_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2,
                                    reason="needs two CUDA devices (torch.cuda.device_count() < 2)")


@needs_two_gpus
def test_second_device_while_current_is_first(rng):
    """Tensors on cuda:1 while torch's current device is cuda:0 (a serving engine's second worker): plan and run
    go to cuda:1's context and stream, match the reference, and leave the current device alone; then a CUDA graph
    captured on cuda:1 replays a re-plan."""
    torch.cuda.set_device(0)
    dev = "cuda:1"
    lens, ps, hq, hkv, d = [0, 1, 77, 700, 2500], 16, 28, 4, 128  # group 7, split-KV on the long request
    cache, indptr, indices, last, _ = paged_case(rng, lens, ps, hkv, d, torch.bfloat16, dev)
    q = torch.randn(len(lens), hq, d, device=dev).to(torch.bfloat16)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(dev))
    w.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(dev), torch.from_numpy(last), hq, hkv, d, ps,
           q_data_type=torch.bfloat16)
    o, lse = w.run(q, cache, return_lse=True)
    assert o.device == torch.device(dev) and lse.device == torch.device(dev)
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(dev)
    assert_close(np64(o), _decode_ref(q, cache, indptr, indices, lens), *TOL["bfloat16"], what="cuda:1 decode")
    assert np.all(np.isneginf(np64(lse[0]))) and np.all(np64(o[0]) == 0), "empty request: o = 0, lse = -inf"

    # paged prefill (causal) on cuda:1
    qo_lens = [3, 1, 20, 5, 9]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    qp = torch.randn(int(qo_indptr[-1]), hq, d, device=dev).to(torch.bfloat16)
    lens_p = [3, 1, 77, 700, 2500]
    cache_p, indptr_p, indices_p, last_p, _ = paged_case(rng, lens_p, ps, hkv, d, torch.bfloat16, dev)
    wp = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws(dev))
    wp.plan(torch.from_numpy(qo_indptr), torch.from_numpy(indptr_p), torch.from_numpy(indices_p).to(dev),
            torch.from_numpy(last_p), hq, hkv, d, ps, causal=True, q_data_type=torch.bfloat16)
    op = wp.run(qp, cache_p)
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(dev)
    cc = np64(cache_p)
    for b, n in enumerate(lens_p):
        k, v = gather_kv(cc[:, 0], cc[:, 1], indptr_p, indices_p, b, n)
        rs = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        ro, _ = attention(np64(qp[rs]), k, v, causal=True)
        assert_close(np64(op[rs]), ro, *TOL["bfloat16"], what="cuda:1 prefill req %d" % b)

    # graph capture on cuda:1, re-plan, replay
    B, P = 3, 80
    with torch.cuda.device(1):
        bufs = [torch.zeros(B + 1, dtype=torch.int32, device=dev), torch.zeros(P, dtype=torch.int32, device=dev),
                torch.zeros(B, dtype=torch.int32, device=dev)]
        wg = kvattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(dev), *bufs)
        gcache = torch.randn(P, 2, ps, hkv, d, device=dev).half()
        gq = torch.randn(B, hq, d, device=dev).half()
        gout = torch.empty(B, hq, d, device=dev, dtype=torch.half)

        def table(ls):
            pages = [(n + ps - 1) // ps for n in ls]
            ip = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
            return ip, rng.permutation(P)[: ip[-1]].astype(np.int32), \
                np.array([((n - 1) % ps) + 1 if n else 1 for n in ls], np.int32)

        t = table([9, 300, 40])
        wg.plan(*t, hq, hkv, d, ps, q_data_type=torch.float16)
        wg.run(gq, gcache, out=gout)
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        # torch.cuda.graph's default side stream is created once per process, on the device current at the first
        # capture (an earlier test's cuda:0): capture on a stream of cuda:1
        with torch.cuda.graph(g, stream=torch.cuda.Stream(device=dev)):
            wg.run(gq, gcache, out=gout)
        for ls in ([1000, 0, 7], [16, 17, 1200]):
            t = table(ls)
            wg.plan(*t, hq, hkv, d, ps, q_data_type=torch.float16)
            gout.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize(dev)
            assert_close(np64(gout), _decode_ref(gq, gcache, t[0], t[1], ls), *TOL["float16"],
                         what="cuda:1 graph replay %s" % ls)
    assert torch.cuda.current_device() == 0

    # kvattn's capture check asks about the tensors' device: a capture on cuda:0 is not one on cuda:1
    from kvattn import _context
    g0 = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda:0")
    with torch.cuda.graph(g0, stream=torch.cuda.Stream(device="cuda:0")):
        capturing = (_context.is_capturing(("cuda", 0)), _context.is_capturing(("cuda", 1)))
        x.add_(1)
    assert capturing == (True, False)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_enable_pdl_layer_chain(rng, device):
    """Layers back to back where each run's q is the previous run's output (directly, or through a torch op):
    with enable_pdl on (the default) and off the chain gives the same bits, eagerly and, on CUDA, in a graph."""
    lens, ps, hq, hkv, d = [700, 3, 1500, 40], 16, 16, 4, 128
    B = len(lens)
    cache, indptr, indices, last, _ = paged_case(rng, lens, ps, hkv, d, torch.bfloat16, device)
    q0 = torch.randn(B, hq, d, device=device).to(torch.bfloat16)

    def chain(wr, pdl, outs):
        x = q0
        for layer in range(outs.shape[0]):
            wr.run(x if layer % 2 else x * 1.5, cache, out=outs[layer], enable_pdl=pdl)
            x = outs[layer]
        return outs

    def fresh():
        return torch.full((6, B, hq, d), float("nan"), device=device, dtype=torch.bfloat16)

    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(device))
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="bfloat16")
    off = chain(w, False, fresh())
    assert torch.equal(chain(w, True, fresh()), off)
    assert torch.equal(chain(w, None, fresh()), off)
    assert_close(np64(off[0]), _decode_ref(q0 * 1.5, cache, indptr, indices, lens), *TOL["bfloat16"])
    if device == "cuda":
        bufs = [torch.from_numpy(a).to(device) for a in (indptr, indices, last)]
        wg = kvattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(device), *bufs)
        wg.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="bfloat16")
        want = chain(wg, False, fresh())  # a graph-mode plan may split otherwise than the eager one
        torch.cuda.synchronize()
        got = fresh()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(wg, True, got)
        got.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile(rng, device):
    lens, ps, hq, hkv, d = [5, 77, 16], 16, 8, 2, 64
    cache, indptr, indices, last, _ = paged_case(rng, lens, ps, hkv, d, torch.half, device)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(device))
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float16")
    q = torch.randn(len(lens), hq, d, device=device).half()
    eager = w.run(q, cache)

    def step(q, cache, out):
        w.run(q * 1.0, cache, out=out)
        o2 = w.run(q, cache)
        return out + 0, o2

    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out = torch.empty_like(q)
    r1, r2 = compiled(q, cache, out)
    assert torch.equal(r1, eager) and torch.equal(r2, eager) and torch.equal(out, eager)
    # a new plan (other lengths) is picked up by the compiled function without recompiling for the op
    lens2 = [40, 2, 100]
    cache2, indptr2, indices2, last2, _ = paged_case(rng, lens2, ps, hkv, d, torch.half, device)
    w.plan(indptr2, indices2, last2, hq, hkv, d, ps, q_data_type="float16")
    r1, _ = compiled(q, cache2, torch.empty_like(q))
    assert_close(np64(r1), _decode_ref(q, cache2, indptr2, indices2, lens2), *TOL["float16"])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_run(rng, device):
    opcheck = getattr(torch.library, "opcheck", None)
    if opcheck is None:
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    lens, ps, hq, hkv, d = [5, 40], 16, 4, 2, 64
    cache, indptr, indices, last, _ = paged_case(rng, lens, ps, hkv, d, torch.half, device)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws(device))
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type="float16")
    q = torch.randn(2, hq, d, device=device).half()
    out = torch.empty_like(q)
    lse = torch.empty(2, hq, device=device)
    opcheck(torch.ops.kvattn.run.default, (w._handle, q, cache[:, 0], cache[:, 1], out, lse, 1.0, 1.0),
            test_utils=("test_schema", "test_faketensor"))


@needs_cuda
def test_readme_decode_loop_example():
    """The README's vLLM-style decode loop runs as written, and its last replay matches a fresh eager run."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## A vLLM-style decode loop\s+```python\n(.*?)```", text, re.S).group(1)
    env = {}
    exec(compile(block, "README.md", "exec"), env)
    graph_out = env["out"].clone()
    env["decode"].run(env["q"], env["kv_caches"][-1], out=env["out"])
    torch.cuda.synchronize()
    assert torch.equal(graph_out, env["out"])
