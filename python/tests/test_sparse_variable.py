"""VariableBlockSparseAttentionWrapper (kvattn.sparse, over kva_vbsr_*) against the float64 dense reference with
per-KV-head block masks. NumPy on the CPU backend; torch CUDA tensors when a GPU is present."""

import numpy as np
import pytest

import kvattn
from conftest import workspace
from reference import TOL, assert_close, attention


def _parts(rng, total, n, allow_zero):
    if allow_zero:
        cuts = np.sort(rng.integers(0, total + 1, size=n - 1))
    else:
        cuts = np.array([total * i // n for i in range(1, n)], dtype=np.int64)
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def _case(seed, M, N, MB, NB, hq, hkv, d, density, causal):
    rng = np.random.default_rng(seed)
    rs = np.stack([_parts(rng, M, MB, h % 2 == 0) for h in range(hkv)])
    cs = np.stack([_parts(rng, N, NB, h % 2 == 1) for h in range(hkv)])
    bm = rng.random((hkv, MB, NB)) < density
    return rng, rs, cs, bm


def _reference(q, k, v, rs, cs, bm, causal, cap):
    """q [Hq, M, D], k/v [Hkv, N, D] (HND) -> o [Hq, M, D], lse [Hq, M]."""
    hq, M, _ = q.shape
    hkv, N, _ = k.shape
    g = hq // hkv
    o = np.zeros(q.shape, np.float64)
    lse = np.zeros((hq, M), np.float64)
    for h in range(hkv):
        brow = np.repeat(np.arange(len(rs[h])), rs[h])
        bcol = np.repeat(np.arange(len(cs[h])), cs[h])
        vis = bm[h][brow[:, None], bcol[None, :]] if M and N else np.zeros((M, N), bool)
        qh = np.swapaxes(q[h * g:(h + 1) * g], 0, 1)      # [M, g, D]
        kh = np.swapaxes(k[h:h + 1], 0, 1)                  # [N, 1, D]
        vh = np.swapaxes(v[h:h + 1], 0, 1)
        ro, rl = attention(qh, kh, vh, causal=causal, mask=vis, logits_soft_cap=cap or 0.0)
        o[h * g:(h + 1) * g] = np.swapaxes(ro, 0, 1)
        lse[h * g:(h + 1) * g] = rl.T
    return o, lse


@pytest.mark.parametrize("seed,M,N,MB,NB,hq,hkv,d,density,causal,dtype,cap", [
    (1, 30, 50, 4, 5, 4, 2, 16, 0.6, False, np.float32, None),
    (2, 41, 77, 3, 7, 6, 3, 32, 0.5, True, np.float32, None),
    (3, 16, 16, 2, 2, 2, 2, 8, 1.0, True, np.float16, 5.0),
    (4, 25, 40, 5, 4, 8, 1, 16, 0.3, False, np.float32, None),
    (5, 33, 64, 3, 8, 4, 4, 16, 0.0, False, np.float32, None),  # nothing visible
])
def test_variable_block_sparse_numpy(seed, M, N, MB, NB, hq, hkv, d, density, causal, dtype, cap):
    rng, rs, cs, bm = _case(seed, M, N, MB, NB, hq, hkv, d, density, causal)
    q = rng.standard_normal((hq, M, d)).astype(dtype)
    k = rng.standard_normal((hkv, N, d)).astype(dtype)
    v = rng.standard_normal((hkv, N, d)).astype(dtype)
    name = np.dtype(dtype).name
    w = kvattn.VariableBlockSparseAttentionWrapper(workspace())
    w.plan(bm, rs, cs, hq, hkv, d, causal=causal, q_data_type=name, o_data_type=name, logits_soft_cap=cap)
    o, lse = w.run(q, k, v, return_lse=True)
    assert o.shape == (hq, M, d) and lse.shape == (hq, M)
    ro, rl = _reference(q, k, v, rs, cs, bm, causal, cap)
    atol, rtol = TOL[name]
    assert_close(o, ro, atol, rtol, "o (seed %d)" % seed)
    assert_close(lse, rl, 2e-3, 1e-4, "lse (seed %d)" % seed)
    # out= / lse= in place, and a second run of the same plan gives the same bytes
    out = np.full_like(o, np.nan)
    lse2 = np.full_like(lse, np.nan)
    w.run(q, k, v, out=out, lse=lse2)
    assert np.array_equal(out, o, equal_nan=True) and np.array_equal(lse2, lse, equal_nan=True)


def test_variable_block_sparse_errors():
    rng, rs, cs, bm = _case(9, 20, 30, 2, 3, 4, 2, 16, 0.5, False)
    w = kvattn.VariableBlockSparseAttentionWrapper(workspace())
    with pytest.raises(RuntimeError):
        w.run(np.zeros((4, 20, 16), np.float32), np.zeros((2, 30, 16), np.float32), np.zeros((2, 30, 16), np.float32))
    bad = rs.copy()
    bad[1, 0] += 1
    with pytest.raises(ValueError):
        w.plan(bm, bad, cs, 4, 2, 16, q_data_type="float32")
    with pytest.raises(ValueError):
        w.plan(bm[:1], rs, cs, 4, 2, 16, q_data_type="float32")
    with pytest.raises(NotImplementedError):
        w.plan(bm, rs, cs, 4, 2, 16, pos_encoding_mode="ROPE_LLAMA", q_data_type="float32")
    w.plan(bm, rs, cs, 4, 2, 16, q_data_type="float32", o_data_type="float32")
    q = rng.standard_normal((4, 20, 16)).astype(np.float32)
    k = rng.standard_normal((2, 30, 16)).astype(np.float32)
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q, k[:, :29], k[:, :29])
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q.astype(np.float16), k, k)


def test_variable_block_sparse_torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for seed, causal, dt in ((11, False, torch.float16), (12, True, torch.bfloat16)):
        hq, hkv, d, M, N = 8, 2, 128, 96, 200
        rng, rs, cs, bm = _case(seed, M, N, 4, 6, hq, hkv, d, 0.6, causal)
        q = torch.from_numpy(rng.standard_normal((hq, M, d)).astype(np.float32)).to("cuda", dt)
        k = torch.from_numpy(rng.standard_normal((hkv, N, d)).astype(np.float32)).to("cuda", dt)
        v = torch.from_numpy(rng.standard_normal((hkv, N, d)).astype(np.float32)).to("cuda", dt)
        ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        w = kvattn.VariableBlockSparseAttentionWrapper(ws)
        name = "float16" if dt == torch.float16 else "bfloat16"
        w.plan(torch.from_numpy(bm), torch.from_numpy(rs), torch.from_numpy(cs), hq, hkv, d, causal=causal,
               q_data_type=dt, o_data_type=dt)
        o, lse = w.run(q, k, v, return_lse=True)
        torch.cuda.synchronize()
        ro, rl = _reference(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(), rs, cs, bm,
                            causal, None)
        atol, rtol = TOL[name]
        assert_close(o.float().cpu().numpy(), ro, atol, rtol, "o (seed %d)" % seed)
        assert_close(lse.cpu().numpy(), rl, 2e-3, 1e-4, "lse (seed %d)" % seed)
