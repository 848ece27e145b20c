"""Block-sparse attention (``flashinfer.sparse``) over kvattn's C block-sparse API (``kva_bsr_*``).

``BlockSparseAttentionWrapper`` has FlashInfer's ``__init__`` / ``plan`` / ``run`` signature. The attention matrix
``[M, N]`` is a block-sparse (BSR, scipy ``bsr_matrix``) matrix of ``R x C`` blocks: block row ``i`` attends to the
column blocks ``indices[indptr[i]:indptr[i+1]]``; ``mask [nnz, R, C]`` (bool, optional) masks elements inside
the listed blocks. The C library composes it from its paged-prefill op (block rows = requests, column blocks =
pages of size C, K/V = the page pool), so it runs on every backend.

Semantics follow FlashInfer where FlashInfer defines them:

* ``mask`` / ``packed_mask`` take precedence over ``causal`` (``causal`` is ignored when a mask is given).
  ``packed_mask`` is FlashInfer's layout: per block row a byte-aligned segment of
  ``rows * (blocks * C)`` bits (row-major over the row's gathered keys, little bit order), as
  ``segment_packbits`` of the block row's ``mask[indptr[i]:indptr[i+1]].transpose(1, 0, 2)`` makes.
* ``causal=True`` is causal over the DENSE matrix, bottom-right aligned: key ``j`` is visible to query row ``i``
  iff ``j <= i + N - M`` (``j <= i`` when ``M == N``). (FlashInfer's fa2 path applies its causal mask to the
  gathered keys of a block row, which agrees with this for the usual sorted lower-triangular patterns.)
* ``o_data_type`` defaults to float16 as in FlashInfer; pass it for float32 / bfloat16 outputs.
* Rows that see no key get ``o = 0`` and ``lse = -inf``; ``lse`` is base 2.

Arrays: NumPy arrays and torch CPU tensors run on the CPU backend, torch CUDA tensors on the CUDA backend of
their device, on torch's current stream (the wrapper's workspace decides; q/k/v/out/lse must be on the same
device). ``plan()`` reads ``indptr`` / ``indices`` / ``mask`` / ``packed_mask`` on the host (device tensors are
copied to the host, which synchronises, as FlashInfer's plan does) and keeps its own backend copies of the
column-block ids and the packed mask, so the caller may free or overwrite its arrays after ``plan()``.
``run()`` never synchronises and allocates only ``out`` / ``lse`` when they are not given; it can be captured
into a CUDA graph (the replay runs the plan that was current at capture: capture again after a new
``plan()``; the backend arrays a capture reads stay alive with the wrapper). ``run()`` is not traceable by
torch.compile (no custom op is registered for it).

Not supported: fused positional encodings (``pos_encoding_mode`` other than ``"NONE"``), per-head fp8 scales
(``scale_q/k/v``), ``use_fp16_qk_reduction``, the VSA / cake backends' ``block_mask`` arguments.
``VariableBlockSparseAttentionWrapper`` (variable block sizes per KV head) is in ``sparse_variable.py`` and
re-exported here.
"""

from __future__ import annotations

import ctypes
import math
from ctypes import POINTER, Structure, c_float, c_int32, c_int64, c_size_t, c_uint64, c_void_p
from typing import Any, Optional, Tuple

import numpy as np

from . import _context as CX
from . import _core
from . import _ffi as F
from . import _tensor as T
from . import _torch_ops
from .variant import refuse as refuse_variant

__all__ = ["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper"]

# --------------------------------------------------------------------------------------------------
# ctypes mirror of the block-sparse section of include/kvattn.h (checked by python/tests/test_sparse.py)


class kva_bsr_params(Structure):
    _fields_ = [
        ("num_qo_rows", c_int64),
        ("num_kv_rows", c_int64),
        ("block_rows", c_int32),
        ("block_cols", c_int32),
        ("indptr", c_void_p),
        ("indices", c_void_p),
        ("block_mask", c_void_p),
        ("fixed_split_size", c_int32),
        ("disable_split_kv", c_int32),
        ("graph_mode", c_int32),
    ]


class kva_bsr_plan(Structure):
    _fields_ = [
        ("plan", F.kva_plan),
        ("num_qo_rows", c_int64),
        ("num_kv_rows", c_int64),
        ("block_rows", c_int32),
        ("block_cols", c_int32),
        ("num_block_rows", c_int32),
        ("uses_mask", c_int32),
        ("nnz", c_int64),
        ("mask_bytes", c_int64),
        ("magic", c_uint64),
        ("graph_mode", c_int32),
        ("pad_", c_int32),
        ("max_mask_bytes", c_int64),
    ]


class kva_bsr_run_args(Structure):
    _fields_ = [
        ("q", F.kva_tensor),
        ("k", F.kva_tensor),
        ("v", F.kva_tensor),
        ("o", F.kva_tensor),
        ("lse", F.kva_tensor),
        ("indices", c_void_p),
        ("packed_mask", c_void_p),
        ("packed_mask_bytes", c_int64),
        ("k_scale", c_float),
        ("v_scale", c_float),
        ("stream", c_void_p),
    ]


STRUCTS = {"kva_bsr_params": kva_bsr_params, "kva_bsr_plan": kva_bsr_plan, "kva_bsr_run_args": kva_bsr_run_args}

_P = POINTER
_PROTOTYPES = {
    "kva_bsr_params_init": (None, [_P(kva_bsr_params)]),
    "kva_bsr_workspace_size": (F.c_enum, [c_void_p, _P(F.kva_attention_desc), _P(kva_bsr_params), _P(c_size_t),
                                          _P(c_size_t)]),
    "kva_bsr_plan_make": (F.c_enum, [c_void_p, _P(F.kva_attention_desc), _P(kva_bsr_params), _P(F.kva_workspace),
                                     _P(kva_bsr_plan), c_void_p]),
    "kva_bsr_mask_pack": (F.c_enum, [_P(F.kva_attention_desc), _P(kva_bsr_params), c_void_p, c_size_t,
                                     _P(c_size_t)]),
    "kva_bsr_run_args_init": (None, [_P(kva_bsr_run_args)]),
    "kva_bsr_run": (F.c_enum, [c_void_p, _P(kva_bsr_plan), _P(F.kva_workspace), _P(kva_bsr_run_args)]),
}

_lib = F.PrototypeBinder(_PROTOTYPES, "block-sparse attention")


# --------------------------------------------------------------------------------------------------
# Helpers


def _to_host_bool(x: Any, what: str) -> np.ndarray:
    """A host bool copy-or-view of an element mask (torch device tensors are copied to the host at plan time)."""
    if T.is_torch(x):
        t = T._torch()
        if x.dtype.is_floating_point or x.dtype.is_complex:
            raise TypeError("kvattn: %s must be a bool (or integer) tensor, got %s" % (what, x.dtype))
        x = x.detach().to(device="cpu", dtype=t.bool).numpy()
    a = np.asarray(x)
    if a.dtype != np.bool_:
        if a.dtype.kind not in "biu":
            raise TypeError("kvattn: %s must be a bool array, got %s" % (what, a.dtype))
        a = a != 0
    return np.ascontiguousarray(a)


def _to_host_u8(x: Any, what: str) -> np.ndarray:
    """A host uint8 copy-or-view of a packed mask (torch device tensors are copied to the host at plan time)."""
    if T.is_torch(x):
        if x.dtype != T._torch().uint8:
            raise TypeError("kvattn: %s must be a 1-D uint8 tensor, got %s %s" % (what, x.dtype, tuple(x.shape)))
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype != np.uint8 or a.ndim != 1:
        raise TypeError("kvattn: %s must be a 1-D uint8 array, got %s %s" % (what, a.dtype, a.shape))
    return np.ascontiguousarray(a)


def _unpack_bsr_mask(packed: np.ndarray, indptr: np.ndarray, M: int, R: int, C: int) -> np.ndarray:
    """FlashInfer's packed BSR mask (per block row: segment of rows x (blocks * C) bits, little bit order, byte
    aligned) -> the element mask [nnz, R, C] (rows past M are False)."""
    MB = indptr.size - 1
    nnz = int(indptr[-1])
    out = np.zeros((nnz, R, C), dtype=bool)
    off = 0
    for b in range(MB):
        e0, e1 = int(indptr[b]), int(indptr[b + 1])
        rows = min(R, M - b * R)
        bits = rows * (e1 - e0) * C
        nbytes = (bits + 7) // 8
        if off + nbytes > packed.size:
            raise ValueError("kvattn: packed_mask has %d bytes; block row %d needs bytes [%d, %d)"
                             % (packed.size, b, off, off + nbytes))
        if bits:
            seg = np.unpackbits(packed[off:off + nbytes], bitorder="little")[:bits].astype(bool)
            out[e0:e1, :rows, :] = seg.reshape(rows, e1 - e0, C).transpose(1, 0, 2)
        off += nbytes
    return out


class _BsrState:
    """Everything run() needs from plan()."""

    def __init__(self) -> None:
        self.plan = kva_bsr_plan()
        self.ws_owner: Any = None  # token of the last commit (the workspace record's owner)
        self.ws: Optional[F.kva_workspace] = None
        self.ctx = 0
        self.dev: T.DeviceKey = ("cpu", 0)
        self.M = self.N = self.R = self.C = 0
        self.num_qo_heads = self.num_kv_heads = self.head_dim = 0
        self.q_dtype = self.kv_dtype = self.o_dtype = F.KVA_DTYPE_F16
        self.sm_scale = 0.0  # as the C descriptor holds them (float32)
        self.logits_soft_cap = 0.0
        self.indices: Any = None  # backend copy of the column-block ids (kva_bsr_run_args.indices)
        self.mask: Any = None  # backend copy of the packed mask (kva_bsr_run_args.packed_mask)
        self.mask_bytes = 0
        self.stream: Optional[int] = None  # the stream plan() allocated `indices` / `mask` on (CUDA)
        self.keep: Tuple[Any, ...] = ()  # host arrays the C plan was made from
        self.desc: Any = None  # kva_attention_desc / kva_bsr_params of the plan (to write it again)
        self.params: Any = None
        self.ws_bytes = 0


# --------------------------------------------------------------------------------------------------
# The wrapper


class BlockSparseAttentionWrapper:
    """Attention with a block-sparse (BSR) attention mask, any block size ``(R, C)`` (``C = 1``: vector
    sparsity). ``q [M, num_qo_heads, head_dim]``, ``k, v [N, num_kv_heads, head_dim]`` (NHD)."""

    def __init__(self, float_workspace_buffer: Any, backend: str = "auto") -> None:
        _core.check_backend(backend)
        self._float_workspace_buffer = float_workspace_buffer
        self._ws = CX.Workspace(float_workspace_buffer)
        self._dev = self._ws.dev
        self._backend = backend
        self._state: Optional[_BsrState] = None
        # Backend arrays read by runs captured into CUDA graphs: a graph replays the pointers it captured, so
        # they stay alive as long as the wrapper (replaying a capture after a later plan() is not supported).
        self._captured: list = []
        self.M: Optional[int] = None
        self.N: Optional[int] = None
        self.R: Optional[int] = None
        self.C: Optional[int] = None

    @property
    def device(self) -> Any:
        if T.is_torch(self._float_workspace_buffer):
            return self._float_workspace_buffer.device
        return "cpu"

    def reset_workspace_buffer(self, float_workspace_buffer: Any, int_workspace_buffer: Any = None) -> None:
        """Swap the float workspace (there is no separate int workspace: ``int_workspace_buffer`` is accepted and
        unused). The current plan is dropped: call plan() again."""
        ws = CX.Workspace(float_workspace_buffer)
        if ws.dev != self._dev:
            raise ValueError("kvattn: reset_workspace_buffer: the new buffer is on %s, the wrapper on %s"
                             % (T.device_str(ws.dev), T.device_str(self._dev)))
        self._float_workspace_buffer = float_workspace_buffer
        self._ws = ws
        self._state = None

    def plan(self, indptr: Any, indices: Any, M: int, N: int, R: int, C: int, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, mask: Any = None, packed_mask: Any = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, o_data_type: Any = "float16", non_blocking: bool = True,
             block_mask: Any = None, fixed_split_size: Optional[int] = None, disable_split_kv: bool = False, *,
             variant: Any = None) -> None:
        """Plan block-sparse attention (host work, reused by every run()).

        ``indptr [MB + 1]`` (``MB = ceil(M / R)``) and ``indices [nnz]`` (column-block ids in ``[0, N / C)``, no
        repeats within a block row) describe the BSR matrix; ``N`` must be a multiple of ``C``. ``mask`` (bool
        ``[nnz, R, C]``) or ``packed_mask`` masks elements of the listed blocks and takes precedence over
        ``causal``. ``fixed_split_size`` (tokens) and ``disable_split_kv`` are kvattn extensions (batch-invariant
        or unsplit KV). ``variant`` is refused (UnsupportedError), as by the C library's kva_bsr_*."""
        refuse_variant(variant, "BlockSparseAttentionWrapper",
                       "block-sparse runs carry no variant parameters and hooks would see block-row positions")
        if use_fp16_qk_reduction:
            raise NotImplementedError("kvattn: use_fp16_qk_reduction=True is not supported (kvattn always "
                                      "accumulates QK in float32)")
        _core.reject(block_mask=block_mask)
        pos = _core.parse_pos_encoding(pos_encoding_mode)
        if pos != "NONE":
            raise NotImplementedError("kvattn: block-sparse attention supports pos_encoding_mode='NONE' only (the "
                                      "composed op does not see dense positions; apply RoPE to q and k first)")
        M, N, R, C_ = int(M), int(N), int(R), int(C)
        if M < 0 or N < 0 or R < 1 or C_ < 1:
            raise ValueError("kvattn: M=%d, N=%d must be >= 0 and R=%d, C=%d >= 1" % (M, N, R, C_))
        if N % C_:
            raise ValueError("kvattn: N=%d must be a multiple of C=%d" % (N, C_))
        MB = (M + R - 1) // R
        h_indptr = np.array(T.host_int32(indptr, "indptr"), copy=True)
        if h_indptr.size != MB + 1:
            raise ValueError("kvattn: indptr has %d elements; M=%d rows in blocks of R=%d need MB + 1 = %d"
                             % (h_indptr.size, M, R, MB + 1))
        nnz = int(h_indptr[-1])
        h_indices = T.host_int32(indices, "indices")
        if h_indices.size < nnz:
            raise ValueError("kvattn: indices has %d elements but indptr[-1] = %d" % (h_indices.size, nnz))
        # an owned copy: on the CPU backend run() reads it, so later writes to the caller's array must not reach it
        h_indices = np.array(h_indices[:nnz], dtype=np.int32, copy=True, order="C")
        emask = None
        if packed_mask is not None:
            emask = _unpack_bsr_mask(_to_host_u8(packed_mask, "packed_mask"), h_indptr, M, R, C_)
        elif mask is not None:
            emask = _to_host_bool(mask, "mask")
            if emask.shape != (nnz, R, C_):
                raise ValueError("kvattn: mask must have shape (nnz, R, C) = %s, got %s"
                                 % ((nnz, R, C_), tuple(emask.shape)))
        dtypes = _core.resolve_dtypes(q_data_type, kv_data_type,
                                      q_data_type if o_data_type is None else o_data_type)
        head_dim = _core.size_arg(head_dim, "head_dim")
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError("kvattn: sm_scale=%r must be a positive finite number" % (sm_scale,))
        mask_mode = F.KVA_MASK_CAUSAL if (causal and emask is None) else F.KVA_MASK_NONE
        desc = _core.make_desc(num_qo_heads, num_kv_heads, head_dim, head_dim, dtypes[0], dtypes[1], dtypes[2],
                               mask_mode, -1, _core.norm_cap(logits_soft_cap), _core.f32(scale), "NONE",
                               1.0 if rope_scale is None else float(rope_scale),
                               1e4 if rope_theta is None else float(rope_theta))
        emask_u8 = None if emask is None else np.ascontiguousarray(emask.astype(np.uint8))
        p = kva_bsr_params()
        lib = _lib()
        lib.kva_bsr_params_init(ctypes.byref(p))
        p.num_qo_rows, p.num_kv_rows, p.block_rows, p.block_cols = M, N, R, C_
        p.indptr = h_indptr.ctypes.data
        p.indices = h_indices.ctypes.data if nnz else None
        p.block_mask = emask_u8.ctypes.data if emask_u8 is not None else None
        p.fixed_split_size = max(int(fixed_split_size or 0), 0)
        p.disable_split_kv = 1 if disable_split_kv else 0

        ctx = CX.get_context(self._dev)
        dev_b, host_b = c_size_t(0), c_size_t(0)
        F.check(lib.kva_bsr_workspace_size(ctx, ctypes.byref(desc), ctypes.byref(p), ctypes.byref(dev_b),
                                           ctypes.byref(host_b)), "BlockSparseAttentionWrapper.plan")
        # the packed mask (element mask and/or dense causal), built before anything is planned
        mbytes = c_size_t(0)
        F.check(lib.kva_bsr_mask_pack(ctypes.byref(desc), ctypes.byref(p), None, 0, ctypes.byref(mbytes)),
                "kva_bsr_mask_pack")
        packed = None
        if mbytes.value:
            packed = np.zeros(int(mbytes.value), dtype=np.uint8)
            got = c_size_t(0)
            F.check(lib.kva_bsr_mask_pack(ctypes.byref(desc), ctypes.byref(p), packed.ctypes.data, packed.size,
                                          ctypes.byref(got)), "kva_bsr_mask_pack")
        st = _BsrState()
        st.indices = T.backend_int32(h_indices, self._dev, "indices") if nnz else None
        st.mask = T.backend_u8(packed, self._dev) if packed is not None else None
        st.mask_bytes = int(mbytes.value)
        wss = self._ws.struct(int(dev_b.value), int(host_b.value), "BlockSparseAttentionWrapper.plan")
        self._state = None
        st.ws, st.ctx, st.dev = wss, ctx, self._dev
        st.desc, st.params, st.ws_bytes = desc, p, int(dev_b.value)
        self._commit(st, "BlockSparseAttentionWrapper.plan")
        st.stream = CX.current_stream(self._dev)
        st.M, st.N, st.R, st.C = M, N, R, C_
        st.num_qo_heads, st.num_kv_heads, st.head_dim = int(num_qo_heads), int(num_kv_heads), head_dim
        st.q_dtype, st.kv_dtype, st.o_dtype = dtypes
        st.sm_scale, st.logits_soft_cap = float(desc.sm_scale), float(desc.logits_soft_cap)
        st.keep = (h_indptr, h_indices, emask_u8, packed)
        self._state = st
        self.M, self.N, self.R, self.C = M, N, R, C_

    begin_forward = plan

    def _commit(self, st: _BsrState, what: str) -> None:
        """Write st's plan into its workspace (and record it as the last writer of those bytes)."""
        F.check(_lib().kva_bsr_plan_make(st.ctx, ctypes.byref(st.desc), ctypes.byref(st.params), ctypes.byref(st.ws),
                                         ctypes.byref(st.plan), CX.current_stream(st.dev)), what)
        # the record's owner is a token of this commit, not st: the process-wide record must not keep the plan's
        # index and mask copies alive after the wrapper drops them
        st.ws_owner = object()
        CX.claim_workspace(st.dev, int(st.ws.device or 0), st.ws_bytes, st.ws_owner)

    _DTYPE_HINT = {"q": "pass q_data_type to plan()", "k": "pass kv_data_type to plan()",
                   "v": "pass kv_data_type to plan()", "out": "pass o_data_type to plan()",
                   "lse": "lse is always float32"}

    def _check(self, st: _BsrState, x: Any, what: str, dtype: int, shape: Tuple[int, ...]) -> None:
        T.check_run_array(x, st.dev, what, dtype, shape, self._DTYPE_HINT[what])

    def _guard_backend_arrays(self, st: _BsrState, stream: Optional[int]) -> None:
        """Keep the plan's backend arrays valid for the stream this run is enqueued on (CUDA)."""
        arrays = [a for a in (st.indices, st.mask) if a is not None and T.is_torch(a)]
        if not arrays:
            return
        if CX.is_capturing(st.dev):
            if not any(k[0] is st for k in self._captured):
                self._captured.append((st, arrays))
        elif stream != st.stream:
            # torch's caching allocator must not hand this memory out again (after a re-plan frees it) before
            # the run on this other stream has finished.
            t = T._torch()
            cur = t.cuda.current_stream(st.dev[1])
            for a in arrays:
                a.record_stream(cur)

    def run(self, q: Any, k: Any, v: Any, scale_q: Any = None, scale_k: Any = None, scale_v: Any = None,
            out: Any = None, lse: Any = None, return_lse: bool = False, enable_pdl: Optional[bool] = None) -> Any:
        """``q [M, num_qo_heads, head_dim]``, ``k, v [N, num_kv_heads, head_dim]`` -> ``out [M, num_qo_heads,
        head_dim]`` (and base-2 ``lse [M, num_qo_heads]`` with ``return_lse=True``)."""
        _core.reject(scale_q=scale_q, scale_k=scale_k, scale_v=scale_v)
        st = self._state
        if st is None:
            raise RuntimeError("kvattn: BlockSparseAttentionWrapper.run() called before plan() (or after "
                               "reset_workspace_buffer())")
        if T.is_torch(q) and _torch_ops.is_compiling():
            raise NotImplementedError("kvattn: BlockSparseAttentionWrapper.run is not traceable by torch.compile "
                                      "(it registers no custom op); call it outside the compiled region, e.g. "
                                      "through a torch.compiler.disable'd function")
        self._check(st, q, "q", st.q_dtype, (st.M, st.num_qo_heads, st.head_dim))
        self._check(st, k, "k", st.kv_dtype, (st.N, st.num_kv_heads, st.head_dim))
        self._check(st, v, "v", st.kv_dtype, (st.N, st.num_kv_heads, st.head_dim))
        if out is None:
            out = T.empty(q, (st.M, st.num_qo_heads, st.head_dim), st.o_dtype)
        else:
            self._check(st, out, "out", st.o_dtype, (st.M, st.num_qo_heads, st.head_dim))
        if return_lse or lse is not None:
            if lse is None:
                lse = T.empty(q, (st.M, st.num_qo_heads), F.KVA_DTYPE_F32)
            else:
                self._check(st, lse, "lse", F.KVA_DTYPE_F32, (st.M, st.num_qo_heads))
        what = "BlockSparseAttentionWrapper"
        CX.replan_if_overwritten(st.dev, int(st.ws.device or 0), st.ws_bytes, st.ws_owner, what, lambda: self._commit(
            st, what + ".run (re-plan: the float workspace was used by another plan)"))
        lib = _lib()
        a = kva_bsr_run_args()
        lib.kva_bsr_run_args_init(ctypes.byref(a))
        T.fill_tensor(a.q, q, "q")
        T.fill_tensor(a.k, k, "k")
        T.fill_tensor(a.v, v, "v")
        T.fill_tensor(a.o, out, "out", out=True)
        if lse is not None:
            T.fill_tensor(a.lse, lse, "lse", out=True)
        a.indices = T.data_ptr(st.indices) if st.indices is not None else None
        if st.mask is not None:
            a.packed_mask = T.data_ptr(st.mask) or None
            a.packed_mask_bytes = st.mask_bytes
        a.stream = CX.current_stream(st.dev)
        self._guard_backend_arrays(st, a.stream)
        F.check(lib.kva_bsr_run(st.ctx, ctypes.byref(st.plan), ctypes.byref(st.ws), ctypes.byref(a)),
                "BlockSparseAttentionWrapper.run")
        return (out, lse) if return_lse else out

    def run_return_lse(self, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        kwargs["return_lse"] = True
        return self.run(q, k, v, *args, **kwargs)

    def forward(self, q: Any, k: Any, v: Any, scale_q: Any = None, scale_k: Any = None, scale_v: Any = None,
                pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
                return_lse: bool = False) -> Any:
        """Deprecated FlashInfer entry point: per-call parameters must match the plan (None = as planned); a
        ``sm_scale`` or ``logits_soft_cap`` that differs raises PlanMismatchError (``rope_*`` have no effect without
        positional encoding)."""
        if _core.parse_pos_encoding(pos_encoding_mode) != "NONE" or use_fp16_qk_reduction:
            raise NotImplementedError("kvattn: forward() with pos_encoding_mode or use_fp16_qk_reduction is not "
                                      "supported")
        st = self._state
        if st is not None:
            for name, given, planned in (("sm_scale", sm_scale, st.sm_scale),
                                         ("logits_soft_cap", logits_soft_cap, st.logits_soft_cap)):
                if given is None:
                    continue
                val = _core.norm_cap(given) if name == "logits_soft_cap" else float(given)
                if _core.f32(val) != _core.f32(planned):
                    raise _core.PlanMismatchError(
                        "kvattn: BlockSparseAttentionWrapper.forward got %s=%r but the plan was made with %s=%r; "
                        "pass it to plan()" % (name, given, name, planned))
        return self.run(q, k, v, scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, return_lse=return_lse)

    def forward_return_lse(self, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        kwargs["return_lse"] = True
        return self.forward(q, k, v, *args, **kwargs)

    def end_forward(self) -> None:
        """Deprecated FlashInfer no-op."""


from .sparse_variable import VariableBlockSparseAttentionWrapper  # noqa: E402 (flashinfer.sparse path)
