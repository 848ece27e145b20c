"""BlockSparseAttentionWrapper (kvattn.sparse, over the C block-sparse API) on the CPU backend (NumPy) against the
float64 dense reference with the block mask."""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvattn
from kvattn import sparse as S
from kvattn import sparse_variable as SV
from conftest import workspace
from reference import TOL, assert_close, attention
from reference import bsr_dense_visible as _dense_visible
from reference import bsr_packed_mask as _packed_flashinfer_layout
from reference import bsr_random as _bsr

REPO = Path(__file__).resolve().parents[2]
HEADER_DIR = REPO / "include"


def _run_case(rng, M, N, R, C, hq=4, hkv=2, d=16, density=0.5, use_mask=False, causal=False, dtype=np.float32,
              return_lse=True, cap=None):
    indptr, indices = _bsr(rng, M, N, R, C, density)
    nnz = int(indptr[-1])
    mask = rng.random((nnz, R, C)) < 0.7 if use_mask else None
    q = rng.standard_normal((M, hq, d)).astype(dtype)
    k = rng.standard_normal((N, hkv, d)).astype(dtype)
    v = rng.standard_normal((N, hkv, d)).astype(dtype)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    name = np.dtype(dtype).name
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, mask=mask, causal=causal, q_data_type=name, o_data_type=name,
           logits_soft_cap=cap)
    res = w.run(q, k, v, return_lse=return_lse)
    o, lse = res if return_lse else (res, None)
    vis = _dense_visible(indptr, indices, M, N, R, C, mask, causal=causal and mask is None)
    ro, rl = attention(q, k, v, mask=vis, logits_soft_cap=cap or 0.0)
    atol, rtol = TOL[name]
    assert_close(o, ro, atol, rtol, "o")
    if return_lse:
        assert_close(lse, rl, 2e-3, 1e-4, "lse")
    return o, lse


@pytest.mark.parametrize("R", [1, 3, 16])
@pytest.mark.parametrize("C", [1, 3, 16])
@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_bsr_matches_dense(rng, R, C, use_mask, causal):
    M = int(rng.integers(1, 60))
    N = C * int(rng.integers(max(1, (M + C - 1) // C), 80 // C + 3))
    _run_case(rng, M, N, R, C, use_mask=use_mask, causal=causal)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_bsr_gqa_dtypes_and_cap(rng, dtype):
    _run_case(rng, 45, 64, 5, 4, hq=8, hkv=2, d=32, density=0.6, dtype=dtype, cap=5.0)
    _run_case(rng, 33, 33, 1, 1, hq=4, hkv=1, d=8, density=1.0, causal=True, dtype=dtype, return_lse=False)


@pytest.mark.parametrize("o_name", ["bfloat16", "float32", "float16"])
def test_bsr_numpy_bfloat16(rng, o_name):
    """bfloat16 q/k/v as ml_dtypes NumPy arrays, each output dtype (o_data_type)."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="NumPy bfloat16 needs ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    M, N, R, C, hq, hkv, d = 29, 48, 4, 8, 4, 2, 32
    indptr, indices = _bsr(rng, M, N, R, C, 0.6)
    q = rng.standard_normal((M, hq, d)).astype(bf16)
    k = rng.standard_normal((N, hkv, d)).astype(bf16)
    v = rng.standard_normal((N, hkv, d)).astype(bf16)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, causal=True, q_data_type="bfloat16", o_data_type=o_name)
    o, lse = w.run(q, k, v, return_lse=True)
    assert o.dtype.name == o_name and lse.dtype == np.float32
    ro, rl = attention(q, k, v, mask=_dense_visible(indptr, indices, M, N, R, C, causal=True))
    assert_close(o, ro, *TOL["bfloat16"], what="o")
    assert_close(lse, rl, 2e-3, 1e-4, what="lse")
    with pytest.raises(kvattn.PlanMismatchError, match="kv_data_type"):
        w.run(q, k.astype(np.float32), v)
    with pytest.raises(kvattn.PlanMismatchError, match="float32"):
        w.run(q, k, v, lse=np.zeros((M, hq), np.float16))


def test_flashinfer_docstring_example():
    """The example of FlashInfer's docstring: 3x3 BSR with R = C = 1 equals dense attention with the mask."""
    rng = np.random.default_rng(0)
    hq, hkv, d = 8, 2, 16
    indptr = np.array([0, 1, 3, 5], dtype=np.int32)
    indices = np.array([2, 0, 2, 1, 2], dtype=np.int32)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(indptr, indices, 3, 3, 1, 1, hq, hkv, d, q_data_type="float32", o_data_type="float32")
    q = rng.standard_normal((3, hq, d)).astype(np.float32)
    k = rng.standard_normal((3, hkv, d)).astype(np.float32)
    v = rng.standard_normal((3, hkv, d)).astype(np.float32)
    o = w.run(q, k, v)
    dense = np.array([[0, 0, 1], [1, 0, 1], [0, 1, 1]], dtype=bool)
    o_single = kvattn.single_prefill_with_kv_cache(q, k, v, custom_mask=dense)
    ro, _ = attention(q, k, v, mask=dense)
    assert_close(o, ro, *TOL["float32"], what="o")
    assert_close(o, o_single, *TOL["float32"], what="o vs single_prefill")
    assert (w.M, w.N, w.R, w.C) == (3, 3, 1, 1)


def test_packed_mask_equals_mask_and_overrides_causal(rng):
    M, N, R, C = 37, 48, 5, 4
    indptr, indices = _bsr(rng, M, N, R, C, 0.6)
    mask = rng.random((int(indptr[-1]), R, C)) < 0.6
    q = rng.standard_normal((M, 4, 16)).astype(np.float32)
    k = rng.standard_normal((N, 2, 16)).astype(np.float32)
    v = rng.standard_normal((N, 2, 16)).astype(np.float32)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(indptr, indices, M, N, R, C, 4, 2, 16, mask=mask, causal=True, q_data_type="float32",
           o_data_type="float32")
    o1, l1 = w.run(q, k, v, return_lse=True)
    packed = _packed_flashinfer_layout(mask, indptr, M, R, C)
    w.plan(indptr, indices, M, N, R, C, 4, 2, 16, packed_mask=packed, q_data_type="float32", o_data_type="float32")
    o2, l2 = w.run(q, k, v, return_lse=True)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    # the mask wins over causal (FlashInfer semantics): compare with the mask alone
    ro, rl = attention(q, k, v, mask=_dense_visible(indptr, indices, M, N, R, C, mask))
    assert_close(o1, ro, *TOL["float32"], what="o")


def test_empty_rows_out_and_lse_buffers(rng):
    M, N, R, C = 10, 16, 4, 8
    indptr = np.array([0, 1, 1, 2], dtype=np.int32)  # block row 1 lists nothing
    indices = np.array([1, 0], dtype=np.int32)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(indptr, indices, M, N, R, C, 2, 2, 8, q_data_type="float32", o_data_type="float32")
    q = rng.standard_normal((M, 2, 8)).astype(np.float32)
    k = rng.standard_normal((N, 2, 8)).astype(np.float32)
    v = rng.standard_normal((N, 2, 8)).astype(np.float32)
    out = np.full((M, 2, 8), np.nan, dtype=np.float32)
    lse = np.full((M, 2), np.nan, dtype=np.float32)
    o, l = w.run(q, k, v, out=out, lse=lse, return_lse=True)
    assert o is out and l is lse
    assert np.all(out[4:8] == 0) and np.all(np.isneginf(lse[4:8]))
    ro, rl = attention(q, k, v, mask=_dense_visible(indptr, indices, M, N, R, C))
    assert_close(out, ro, *TOL["float32"], what="o")
    assert_close(lse, rl, 2e-3, 1e-4, what="lse")


def test_plan_owns_its_index_and_mask_copies(rng):
    """Overwriting the caller's indptr / indices / mask after plan() does not change what run() computes."""
    M, N, R, C = 24, 64, 4, 8
    indptr, indices = _bsr(rng, M, N, R, C, 0.5)
    mask = rng.random((int(indptr[-1]), R, C)) < 0.6
    q = rng.standard_normal((M, 2, 16)).astype(np.float32)
    k = rng.standard_normal((N, 2, 16)).astype(np.float32)
    v = rng.standard_normal((N, 2, 16)).astype(np.float32)
    ro, _ = attention(q, k, v, mask=_dense_visible(indptr, indices, M, N, R, C, mask))
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(indptr, indices, M, N, R, C, 2, 2, 16, mask=mask, q_data_type="float32", o_data_type="float32")
    indices[:] = (indices + 1) % (N // C)
    indptr[1:] = indptr[-1]
    mask[:] = ~mask
    assert_close(w.run(q, k, v), ro, *TOL["float32"], what="o")


def test_default_output_dtype_is_float16(rng):
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(np.array([0, 1], np.int32), np.array([0], np.int32), 2, 4, 2, 4, 2, 2, 8, q_data_type="float32")
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((4, 2, 8)).astype(np.float32)
    assert w.run(q, kv, kv).dtype == np.float16


def test_errors(rng):
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    q = np.zeros((8, 2, 8), np.float32)
    kv = np.zeros((16, 2, 8), np.float32)
    with pytest.raises(RuntimeError):
        w.run(q, kv, kv)
    ip = np.array([0, 1, 2], np.int32)
    with pytest.raises(kvattn.InvalidArgumentError):  # column block twice in one row
        w.plan(np.array([0, 2, 2], np.int32), np.array([1, 1], np.int32), 8, 16, 4, 4, 2, 2, 8)
    with pytest.raises(kvattn.PageIndexOutOfRangeError):
        w.plan(ip, np.array([0, 4], np.int32), 8, 16, 4, 4, 2, 2, 8)
    with pytest.raises(kvattn.PageTableMalformedError):
        w.plan(np.array([0, 2, 1], np.int32), np.array([0, 1], np.int32), 8, 16, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError):  # indptr length does not match ceil(M / R) + 1
        w.plan(np.array([0, 1], np.int32), np.array([0], np.int32), 8, 16, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError):  # N not a multiple of C
        w.plan(ip, np.array([0, 1], np.int32), 8, 15, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError):  # mask of the wrong shape
        w.plan(ip, np.array([0, 1], np.int32), 8, 16, 4, 4, 2, 2, 8, mask=np.ones((2, 4, 3), bool))
    with pytest.raises(NotImplementedError):
        w.plan(ip, np.array([0, 1], np.int32), 8, 16, 4, 4, 2, 2, 8, pos_encoding_mode="ROPE_LLAMA")
    w.plan(ip, np.array([0, 1], np.int32), 8, 16, 4, 4, 2, 2, 8, q_data_type="float32", o_data_type="float32")
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q.astype(np.float16), kv, kv)
    with pytest.raises(kvattn.PlanMismatchError):
        w.run(q, kv[:12], kv[:12])
    with pytest.raises(NotImplementedError):
        w.run(q, kv, kv, scale_q=np.ones(2, np.float32))
    o = w.run(q, kv, kv)
    assert o.shape == (8, 2, 8) and o.dtype == np.float32


def test_forward_per_call_parameters_must_match_the_plan(rng):
    # The deprecated forward() takes sm_scale / logits_soft_cap per call; one that differs from the plan used to be
    # dropped silently (the run used the planned values). It must raise; equal (or None) values run the plan.
    M, N, R, C, H, D = 8, 8, 4, 4, 2, 16
    indptr, indices = np.array([0, 2, 4], np.int32), np.array([0, 1, 0, 1], np.int32)
    print("forward: M=%d N=%d R=%d C=%d heads=%d head_dim=%d" % (M, N, R, C, H, D))
    q = rng.standard_normal((M, H, D)).astype(np.float32)
    k = rng.standard_normal((N, H, D)).astype(np.float32)
    v = rng.standard_normal((N, H, D)).astype(np.float32)
    w = kvattn.BlockSparseAttentionWrapper(workspace())
    w.plan(indptr, indices, M, N, R, C, H, H, D, q_data_type="float32", o_data_type="float32", sm_scale=0.3,
           logits_soft_cap=5.0)
    ro, rl = attention(q, k, v, sm_scale=0.3, logits_soft_cap=5.0)
    out = np.full((M, H, D), 7.0, np.float32)
    for kw in (dict(sm_scale=0.01), dict(logits_soft_cap=1.0), dict(logits_soft_cap=0.0)):
        with pytest.raises(kvattn.PlanMismatchError):
            w.forward(q, k, v, **kw)
    assert_close(w.forward(q, k, v), ro, 2e-4, 2e-4, "o")
    assert_close(w.forward(q, k, v, sm_scale=0.3, logits_soft_cap=5.0), ro, 2e-4, 2e-4, "o")
    o, lse = w.forward_return_lse(q, k, v, sm_scale=0.3)
    assert_close(o, ro, 2e-4, 2e-4, "o")
    assert_close(lse, rl, 2e-3, 1e-4, "lse")
    with pytest.raises(kvattn.PlanMismatchError):
        w.forward_return_lse(q, k, v, sm_scale=0.5)


def _cc():
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(not (HEADER_DIR / "kvattn.h").exists(), reason="include/kvattn.h not found (installed copy?)")
def test_struct_layouts_match_header(tmp_path):
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler on PATH to compile the layout probe")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include \"kvattn.h\"", "int main(void) {"]
    structs = dict(S.STRUCTS, **SV.STRUCTS)
    for name, cls in structs.items():
        lines.append('printf("%s %%zu\\n", sizeof(%s));' % (name, name))
        for field, _ in cls._fields_:
            lines.append('printf("%s.%s %%zu\\n", offsetof(%s, %s));' % (name, field, name, field))
    lines += ["return 0;", "}"]
    src = tmp_path / "probe.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "probe"
    subprocess.run([cc, "-std=c11", "-I", str(HEADER_DIR), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c_layout = dict((k, int(v)) for k, v in (line.split() for line in out.splitlines()))
    bad = []
    for name, cls in structs.items():
        if ctypes.sizeof(cls) != c_layout[name]:
            bad.append("sizeof(%s): C %d, ctypes %d" % (name, c_layout[name], ctypes.sizeof(cls)))
        for field, _ in cls._fields_:
            if getattr(cls, field).offset != c_layout["%s.%s" % (name, field)]:
                bad.append("%s.%s" % (name, field))
    assert not bad, "\n".join(bad)
