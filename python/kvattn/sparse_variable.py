"""Block-sparse attention with variable block sizes per KV head (``flashinfer.sparse.VariableBlockSparseAttentionWrapper``)
over kvattn's C API (``kva_vbsr_*``).

For KV head ``h`` (and the ``num_qo_heads // num_kv_heads`` query heads sharing it) the ``[qo_len, kv_len]``
attention matrix is cut into block rows of heights ``block_row_sz[h]`` and block columns of widths
``block_col_sz[h]``; ``block_mask_map[h, i, j]`` says whether block ``(i, j)`` is attended. As in FlashInfer the
tensors are HND: ``q [num_qo_heads, qo_len, head_dim]``, ``k, v [num_kv_heads, kv_len, head_dim]``, and the output
is ``[num_qo_heads, qo_len, head_dim]`` (``lse [num_qo_heads, qo_len]``, base 2). ``causal=True`` is causal over
the dense matrix, bottom-right aligned. Rows that see no key get ``o = 0`` and ``lse = -inf``.

The C library runs one page-size-1 paged-prefill op per KV head over that head's slices (no copies of q / k / v);
the token tables and masks are built at plan time and kept on the wrapper's device.

Not supported: fused positional encodings (``pos_encoding_mode`` other than ``"NONE"``),
``use_fp16_qk_reduction``.
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
from .variant import refuse as refuse_variant

__all__ = ["VariableBlockSparseAttentionWrapper"]


class kva_vbsr_params(Structure):
    _fields_ = [
        ("num_qo_rows", c_int64),
        ("num_kv_rows", c_int64),
        ("num_block_rows", c_int32),
        ("num_block_cols", c_int32),
        ("block_row_sz", c_void_p),
        ("block_col_sz", c_void_p),
        ("block_mask_map", c_void_p),
        ("fixed_split_size", c_int32),
        ("disable_split_kv", c_int32),
    ]


class kva_vbsr_plan(Structure):
    _fields_ = [
        ("num_qo_rows", c_int64),
        ("num_kv_rows", c_int64),
        ("num_kv_heads", c_int32),
        ("uses_mask", c_int32),
        ("table_entries", c_int64),
        ("mask_bytes", c_int64),
        ("device_bytes", c_size_t),
        ("host_bytes", c_size_t),
        ("ws_device_addr", c_uint64),
        ("head_plans", c_void_p),
        ("magic", c_uint64),
    ]


class kva_vbsr_run_args(Structure):
    _fields_ = [
        ("q", F.kva_tensor),
        ("k", F.kva_tensor),
        ("v", F.kva_tensor),
        ("o", F.kva_tensor),
        ("lse", F.kva_tensor),
        ("table", c_void_p),
        ("table_entries", c_int64),
        ("packed_mask", c_void_p),
        ("packed_mask_bytes", c_int64),
        ("k_scale", c_float),
        ("v_scale", c_float),
        ("stream", c_void_p),
    ]


STRUCTS = {"kva_vbsr_params": kva_vbsr_params, "kva_vbsr_plan": kva_vbsr_plan,
           "kva_vbsr_run_args": kva_vbsr_run_args}

_P = POINTER
_PROTOTYPES = {
    "kva_vbsr_params_init": (None, [_P(kva_vbsr_params)]),
    "kva_vbsr_workspace_size": (F.c_enum, [c_void_p, _P(F.kva_attention_desc), _P(kva_vbsr_params), _P(c_size_t),
                                           _P(c_size_t)]),
    "kva_vbsr_plan_make": (F.c_enum, [c_void_p, _P(F.kva_attention_desc), _P(kva_vbsr_params), _P(F.kva_workspace),
                                      c_void_p, _P(kva_vbsr_plan), c_void_p]),
    "kva_vbsr_pack": (F.c_enum, [_P(F.kva_attention_desc), _P(kva_vbsr_params), c_void_p, c_size_t, c_void_p,
                                 c_size_t, _P(c_int64), _P(c_int64)]),
    "kva_vbsr_run_args_init": (None, [_P(kva_vbsr_run_args)]),
    "kva_vbsr_run": (F.c_enum, [c_void_p, _P(kva_vbsr_plan), _P(F.kva_workspace), _P(kva_vbsr_run_args)]),
}

_lib = F.PrototypeBinder(_PROTOTYPES, "variable block-sparse attention")


def _host_i32_2d(x: Any, what: str, shape: Tuple[int, int]) -> np.ndarray:
    if T.is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError("kvattn: %s must be an integer array, got %s" % (what, a.dtype))
    if a.shape != shape:
        raise ValueError("kvattn: %s must have shape %s, got %s" % (what, shape, tuple(a.shape)))
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise ValueError("kvattn: %s must hold sizes in [0, 2^31)" % what)
    return np.ascontiguousarray(a.astype(np.int32))


class _VState:
    def __init__(self) -> None:
        self.plan = kva_vbsr_plan()
        self.ws_owner: Any = None  # token of the last commit (the workspace record's owner)
        self.head_plans: Any = None
        self.ws: Optional[F.kva_workspace] = None
        self.ctx = 0
        self.dev: T.DeviceKey = ("cpu", 0)
        self.M = self.N = 0
        self.num_qo_heads = self.num_kv_heads = self.head_dim = 0
        self.q_dtype = self.kv_dtype = self.o_dtype = F.KVA_DTYPE_F16
        self.table: Any = None
        self.table_entries = 0
        self.mask: Any = None
        self.mask_bytes = 0
        self.keep: Tuple[Any, ...] = ()
        self.desc: Any = None  # kva_attention_desc / kva_vbsr_params of the plan (to write it again)
        self.params: Any = None
        self.ws_bytes = 0


class VariableBlockSparseAttentionWrapper:
    """Block-sparse attention whose block row / column sizes and block map differ per KV head (HND tensors)."""

    def __init__(self, float_workspace_buffer: Any, backend: str = "auto") -> None:
        _core.check_backend(backend)
        self._float_workspace_buffer = float_workspace_buffer
        self._ws = CX.Workspace(float_workspace_buffer)
        self._dev = self._ws.dev
        self._state: Optional[_VState] = None

    @property
    def device(self) -> Any:
        if T.is_torch(self._float_workspace_buffer):
            return self._float_workspace_buffer.device
        return "cpu"

    def reset_workspace_buffer(self, float_workspace_buffer: Any, int_workspace_buffer: Any = None) -> None:
        """Swap the float workspace (``int_workspace_buffer`` is accepted and unused). Call plan() again."""
        ws = CX.Workspace(float_workspace_buffer)
        if ws.dev != self._dev:
            raise ValueError("kvattn: reset_workspace_buffer: the new buffer is on %s, the wrapper on %s"
                             % (T.device_str(ws.dev), T.device_str(self._dev)))
        self._float_workspace_buffer = float_workspace_buffer
        self._ws = ws
        self._state = None

    def plan(self, block_mask_map: Any, block_row_sz: Any, block_col_sz: Any, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, logits_soft_cap: Optional[float] = None,
             sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, non_blocking: bool = True, q_data_type: Any = "float16",
             kv_data_type: Any = None, o_data_type: Any = None, fixed_split_size: Optional[int] = None,
             disable_split_kv: bool = False, *, variant: Any = None) -> None:
        """``block_mask_map [num_kv_heads, MB, NB]`` (bool), ``block_row_sz [num_kv_heads, MB]``,
        ``block_col_sz [num_kv_heads, NB]``; every head's row sizes sum to ``qo_len`` and column sizes to
        ``kv_len``. ``variant`` is refused (UnsupportedError), as by the C library's kva_vbsr_*."""
        refuse_variant(variant, "VariableBlockSparseAttentionWrapper",
                       "variable block-sparse runs carry no variant parameters")
        if use_fp16_qk_reduction:
            raise NotImplementedError("kvattn: use_fp16_qk_reduction=True is not supported")
        if _core.parse_pos_encoding(pos_encoding_mode) != "NONE":
            raise NotImplementedError("kvattn: variable block-sparse attention supports pos_encoding_mode='NONE' "
                                      "only (apply RoPE to q and k first)")
        H = _core.size_arg(num_kv_heads, "num_kv_heads")
        num_qo_heads = _core.size_arg(num_qo_heads, "num_qo_heads")
        if num_qo_heads % H:
            raise ValueError("kvattn: num_qo_heads=%d must be a positive multiple of num_kv_heads=%d"
                             % (num_qo_heads, H))
        bm = block_mask_map.detach().cpu().numpy() if T.is_torch(block_mask_map) else np.asarray(block_mask_map)
        if bm.ndim != 3 or bm.shape[0] != H:
            raise ValueError("kvattn: block_mask_map must have shape (num_kv_heads=%d, MB, NB), got %s"
                             % (H, tuple(bm.shape)))
        MB, NB = int(bm.shape[1]), int(bm.shape[2])
        if bm.dtype.kind not in "biu":
            raise TypeError("kvattn: block_mask_map must be a bool array, got %s" % bm.dtype)
        bm_u8 = np.ascontiguousarray((bm != 0).astype(np.uint8))
        rs = _host_i32_2d(block_row_sz, "block_row_sz", (H, MB))
        cs = _host_i32_2d(block_col_sz, "block_col_sz", (H, NB))
        M, N = int(rs[0].sum()), int(cs[0].sum())
        if (rs.sum(axis=1) != M).any() or (cs.sum(axis=1) != N).any():
            raise ValueError("kvattn: every KV head's block_row_sz must sum to the same qo_len and block_col_sz to "
                             "the same kv_len (got row sums %s, column sums %s)"
                             % (rs.sum(axis=1).tolist(), cs.sum(axis=1).tolist()))
        dtypes = _core.resolve_dtypes(q_data_type, kv_data_type, q_data_type if o_data_type is None else o_data_type)
        head_dim = _core.size_arg(head_dim, "head_dim")
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError("kvattn: sm_scale=%r must be a positive finite number" % (sm_scale,))
        desc = _core.make_desc(num_qo_heads, H, head_dim, head_dim, dtypes[0], dtypes[1], dtypes[2],
                               F.KVA_MASK_CAUSAL if causal else F.KVA_MASK_NONE, -1,
                               _core.norm_cap(logits_soft_cap), _core.f32(scale), "NONE",
                               1.0 if rope_scale is None else float(rope_scale),
                               1e4 if rope_theta is None else float(rope_theta))
        lib = _lib()
        p = kva_vbsr_params()
        lib.kva_vbsr_params_init(ctypes.byref(p))
        p.num_qo_rows, p.num_kv_rows, p.num_block_rows, p.num_block_cols = M, N, MB, NB
        p.block_row_sz = rs.ctypes.data
        p.block_col_sz = cs.ctypes.data
        p.block_mask_map = bm_u8.ctypes.data
        p.fixed_split_size = max(int(fixed_split_size or 0), 0)
        p.disable_split_kv = 1 if disable_split_kv else 0
        ctx = CX.get_context(self._dev)
        dev_b, host_b = c_size_t(0), c_size_t(0)
        F.check(lib.kva_vbsr_workspace_size(ctx, ctypes.byref(desc), ctypes.byref(p), ctypes.byref(dev_b),
                                            ctypes.byref(host_b)), "VariableBlockSparseAttentionWrapper.plan")
        nt, nm = c_int64(0), c_int64(0)
        F.check(lib.kva_vbsr_pack(ctypes.byref(desc), ctypes.byref(p), None, 0, None, 0, ctypes.byref(nt),
                                  ctypes.byref(nm)), "kva_vbsr_pack")
        table = np.zeros(max(int(nt.value), 1), dtype=np.int32)
        mask = np.zeros(max(int(nm.value), 1), dtype=np.uint8)
        F.check(lib.kva_vbsr_pack(ctypes.byref(desc), ctypes.byref(p), table.ctypes.data, table.size,
                                  mask.ctypes.data if nm.value else None, mask.size, ctypes.byref(nt),
                                  ctypes.byref(nm)), "kva_vbsr_pack")
        st = _VState()
        st.head_plans = (F.kva_plan * H)()
        st.table = T.backend_int32(table, self._dev, "table")
        st.table_entries = int(nt.value)
        if nm.value:
            st.mask = T.backend_u8(mask, self._dev)
        st.mask_bytes = int(nm.value)
        wss = self._ws.struct(int(dev_b.value), int(host_b.value), "VariableBlockSparseAttentionWrapper.plan")
        self._state = None
        st.ws, st.ctx, st.dev = wss, ctx, self._dev
        st.desc, st.params, st.ws_bytes = desc, p, int(dev_b.value)
        self._commit(st, "VariableBlockSparseAttentionWrapper.plan")
        st.M, st.N = M, N
        st.num_qo_heads, st.num_kv_heads, st.head_dim = num_qo_heads, H, head_dim
        st.q_dtype, st.kv_dtype, st.o_dtype = dtypes
        st.keep = (rs, cs, bm_u8, table, mask)
        self._state = st

    begin_forward = plan

    def _commit(self, st: _VState, what: str) -> None:
        """Write st's plan into its workspace (and record it as the last writer of those bytes)."""
        F.check(_lib().kva_vbsr_plan_make(st.ctx, ctypes.byref(st.desc), ctypes.byref(st.params),
                                          ctypes.byref(st.ws), ctypes.cast(st.head_plans, c_void_p),
                                          ctypes.byref(st.plan), CX.current_stream(st.dev)), what)
        # the record's owner is a token of this commit, not st: the process-wide record must not keep the plan's
        # index and mask copies alive after the wrapper drops them
        st.ws_owner = object()
        CX.claim_workspace(st.dev, int(st.ws.device or 0), st.ws_bytes, st.ws_owner)

    def _check(self, st: _VState, x: Any, what: str, dtype: int, shape: Tuple[int, ...]) -> None:
        T.check_run_array(x, st.dev, what, dtype, shape)

    @staticmethod
    def _swap01(x: Any) -> Any:
        """[a, b, ...] -> the view [b, a, ...] (no copy)."""
        return x.transpose(0, 1) if T.is_torch(x) else np.swapaxes(x, 0, 1)

    def run(self, q: Any, k: Any, v: Any, out: Any = None, lse: Any = None, return_lse: bool = False,
            enable_pdl: Optional[bool] = None) -> Any:
        """``q [num_qo_heads, qo_len, head_dim]``, ``k, v [num_kv_heads, kv_len, head_dim]`` -> ``out
        [num_qo_heads, qo_len, head_dim]`` (and ``lse [num_qo_heads, qo_len]`` with ``return_lse=True``)."""
        st = self._state
        if st is None:
            raise RuntimeError("kvattn: VariableBlockSparseAttentionWrapper.run() called before plan()")
        Hq, Hkv, D, M, N = st.num_qo_heads, st.num_kv_heads, st.head_dim, st.M, st.N
        self._check(st, q, "q", st.q_dtype, (Hq, M, D))
        self._check(st, k, "k", st.kv_dtype, (Hkv, N, D))
        self._check(st, v, "v", st.kv_dtype, (Hkv, N, D))
        if out is None:
            out = T.empty(q, (Hq, M, D), st.o_dtype)
        else:
            self._check(st, out, "out", st.o_dtype, (Hq, M, D))
        if return_lse or lse is not None:
            if lse is None:
                lse = T.empty(q, (Hq, M), F.KVA_DTYPE_F32)
            else:
                self._check(st, lse, "lse", F.KVA_DTYPE_F32, (Hq, M))
                T.check_writable(lse, "lse")
        what = "VariableBlockSparseAttentionWrapper"
        CX.replan_if_overwritten(st.dev, int(st.ws.device or 0), st.ws_bytes, st.ws_owner, what, lambda: self._commit(
            st, what + ".run (re-plan: the float workspace was used by another plan)"))
        lib = _lib()
        a = kva_vbsr_run_args()
        lib.kva_vbsr_run_args_init(ctypes.byref(a))
        T.fill_tensor(a.q, self._swap01(q), "q")
        T.fill_tensor(a.k, self._swap01(k), "k")
        T.fill_tensor(a.v, self._swap01(v), "v")
        T.fill_tensor(a.o, self._swap01(out), "out", out=True)
        lse_tmp = None
        if lse is not None:
            # the C API wants a unit last stride: [qo_len, num_qo_heads] temporary, transposed into lse after
            lse_tmp = T.empty(q, (M, Hq), F.KVA_DTYPE_F32)
            T.fill_tensor(a.lse, lse_tmp, "lse")
        a.table = T.data_ptr(st.table) or None
        a.table_entries = st.table_entries
        if st.mask is not None:
            a.packed_mask = T.data_ptr(st.mask) or None
            a.packed_mask_bytes = st.mask_bytes
        a.stream = CX.current_stream(st.dev)
        F.check(lib.kva_vbsr_run(st.ctx, ctypes.byref(st.plan), ctypes.byref(st.ws), ctypes.byref(a)),
                "VariableBlockSparseAttentionWrapper.run")
        if lse is not None:
            if T.is_torch(lse):
                lse.copy_(lse_tmp.transpose(0, 1))
            else:
                lse[...] = lse_tmp.T
        return (out, lse) if return_lse else out

    def run_return_lse(self, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        kwargs["return_lse"] = True
        return self.run(q, k, v, *args, **kwargs)

    def end_forward(self) -> None:
        """Deprecated FlashInfer no-op."""
