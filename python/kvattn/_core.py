"""Machinery shared by the FlashInfer-compatible wrappers: argument parsing, descriptors, plan state, the run
entry point (also the body of the ``kvattn::run`` custom op) and the batch-wrapper base class."""

from __future__ import annotations

import ctypes
import itertools
import math
import operator
import struct
import threading
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from . import _context as C
from . import _ffi as F
from . import _tensor as T
from . import _torch_ops
from . import variant as V
from .exceptions import CaptureActiveError, InvalidArgumentError, PlanMismatchError, UnsupportedError

# --------------------------------------------------------------------------------------------------
# Argument parsing

POS_ENCODING_MODES = {"NONE": F.KVA_POS_NONE, "ROPE_LLAMA": F.KVA_POS_ROPE_LLAMA, "ALIBI": F.KVA_POS_ALIBI}
_POS_BY_CODE = {v: k for k, v in POS_ENCODING_MODES.items()}


def parse_pos_encoding(mode: Any) -> str:
    """'NONE' | 'ROPE_LLAMA' | 'ALIBI' from a string, a PosEncodingMode enum or its integer value."""
    if mode is None:
        return "NONE"
    if isinstance(mode, str):
        m = mode.upper()
        if m in POS_ENCODING_MODES:
            return m
    elif hasattr(mode, "name") and str(mode.name).upper() in POS_ENCODING_MODES:
        return str(mode.name).upper()
    elif isinstance(mode, (int, np.integer)) and int(mode) in _POS_BY_CODE:
        return _POS_BY_CODE[int(mode)]
    raise ValueError("kvattn: pos_encoding_mode=%r is not supported (NONE, ROPE_LLAMA, ALIBI)" % (mode,))


def parse_layout(kv_layout: Any) -> str:
    if isinstance(kv_layout, str) and kv_layout.upper() in ("NHD", "HND"):
        return kv_layout.upper()
    if hasattr(kv_layout, "name") and str(kv_layout.name).upper() in ("NHD", "HND"):
        return str(kv_layout.name).upper()
    raise ValueError("kvattn: kv_layout=%r is not supported ('NHD' or 'HND')" % (kv_layout,))


def check_backend(backend: Any, jit_args: Any = None, jit_kwargs: Any = None) -> None:
    if backend not in ("auto", "fa2", None):
        raise NotImplementedError(
            "kvattn: backend=%r is not supported; kvattn has one implementation per device (use 'auto' or 'fa2')"
            % (backend,))
    if jit_args is not None or jit_kwargs is not None:
        raise NotImplementedError("kvattn: jit_args / jit_kwargs (user-defined JIT attention variants) are not "
                                  "supported")


def reject(**kwargs: Any) -> None:
    """NotImplementedError for every argument that is set (not None / False / 0) among kwargs."""
    for name, value in kwargs.items():
        if value is None or value is False:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            continue
        raise NotImplementedError("kvattn: argument %s=%r is not supported" % (name, _short(value)))


def _short(v: Any) -> Any:
    if T.is_torch(v) or isinstance(v, np.ndarray):
        return "<%s %s>" % (type(v).__name__, tuple(v.shape))
    return v


INT32_MAX = 2 ** 31 - 1


def size_arg(x: Any, what: str, lo: int = 1, hi: int = INT32_MAX) -> int:
    """An integer size argument (Python or NumPy integer, or anything with __index__) in [lo, hi]: TypeError for a
    float or bool (it is not silently truncated), ValueError outside the range (the C fields are 32-bit: a larger
    value would wrap)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError("kvattn: %s must be an integer, got %r" % (what, x))
    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError("kvattn: %s must be an integer, got %r (%s)" % (what, x, type(x).__name__)) from None
    if v < lo:
        raise ValueError("kvattn: %s=%d must be >= %d" % (what, v, lo))
    if v > hi:
        raise ValueError("kvattn: %s=%d is too large (at most %d)" % (what, v, hi))
    return int(v)


def f32(x: float) -> float:
    """x rounded to float32 (the precision the C descriptor stores; out of range -> +-inf, checked by callers).
    struct rounds to nearest even as a float32 cast does, at an eighth of np.errstate's cost (plan() calls it for
    every scale)."""
    x = float(x)
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # rounds past the float32 range
        return math.copysign(math.inf, x)


def norm_cap(cap: Any) -> float:
    if cap is None:
        return 0.0
    c = float(cap)
    if not math.isfinite(c) or c < 0:
        raise ValueError("kvattn: logits_soft_cap=%r must be a finite number >= 0 (None or 0 = off)" % (cap,))
    return c


def norm_window(w: Any) -> int:
    w = -1 if w is None else int(w)
    if w < -1:
        raise ValueError("kvattn: window_left=%d must be -1 (no window) or >= 0" % w)
    if w > INT32_MAX:
        raise ValueError("kvattn: window_left=%d is too large (at most %d; -1 = no window)" % (w, INT32_MAX))
    return w


def norm_split(fixed_split_size: Any, page_size: int) -> int:
    """FlashInfer counts fixed_split_size in pages (tokens for ragged); the C API counts tokens."""
    if fixed_split_size is None:
        return 0
    s = int(fixed_split_size)
    if s < 0:
        return 0  # FlashInfer treats -1 as "not fixed"
    if s * page_size > INT32_MAX:
        raise ValueError("kvattn: fixed_split_size=%d (x page_size %d = %d tokens) is too large (at most %d tokens)"
                         % (s, page_size, s * page_size, INT32_MAX))
    return s * page_size


class _DefaultDtype(str):
    """The default of the decode plan's q_data_type ("float16", FlashInfer's): a distinct object, so that an explicit
    q_data_type="float16" is told apart from the default when the deprecated data_type is given too."""


DEFAULT_Q_DATA_TYPE = _DefaultDtype("float16")


def resolve_dtypes(q_data_type: Any, kv_data_type: Any, o_data_type: Any,
                   data_type: Any = None) -> Tuple[int, int, int]:
    if data_type is not None:  # deprecated alias for both q and kv
        # An explicit q_data_type (even "float16") wins, as in FlashInfer: q_data_type="float16" with
        # data_type="float8_e4m3fn" is a float16 query over an fp8 cache. Left at its default, q_data_type follows
        # data_type (as it did when FlashInfer's default was None), so data_type="bfloat16" alone plans bf16 q.
        if q_data_type is None or q_data_type is DEFAULT_Q_DATA_TYPE:
            q_data_type = data_type
        if kv_data_type is None:
            kv_data_type = data_type
    q = T.parse_dtype("float16" if q_data_type is None else q_data_type, "q_data_type")
    if q not in T.FLOAT_DTYPES:
        raise NotImplementedError("kvattn: q_data_type=%s is not supported (float32, float16, bfloat16)"
                                  % T.dtype_name(q))
    kv = q if kv_data_type is None else T.parse_dtype(kv_data_type, "kv_data_type")
    o = q if o_data_type is None else T.parse_dtype(o_data_type, "o_data_type")
    if o not in T.FLOAT_DTYPES:
        raise NotImplementedError("kvattn: o_data_type=%s is not supported (float32, float16, bfloat16)"
                                  % T.dtype_name(o))
    return q, kv, o


def make_desc(num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, q_dtype: int,
              kv_dtype: int, o_dtype: int, mask_mode: int, window_left: int, logits_soft_cap: float,
              sm_scale: float, pos_encoding: str, rope_scale: float, rope_theta: float,
              variant_ptr: int = 0) -> "F.kva_attention_desc":
    num_qo_heads, num_kv_heads = size_arg(num_qo_heads, "num_qo_heads"), size_arg(num_kv_heads, "num_kv_heads")
    head_dim_qk, head_dim_vo = size_arg(head_dim_qk, "head_dim_qk"), size_arg(head_dim_vo, "head_dim_vo")
    if num_qo_heads % num_kv_heads:
        raise ValueError("kvattn: num_qo_heads=%d is not a multiple of num_kv_heads=%d" % (num_qo_heads, num_kv_heads))
    if pos_encoding == "ROPE_LLAMA":
        # the C descriptor reads 0 as "default" (rope_scale 1, rope_theta 1e4): a zero (or a value that rounds to 0
        # in float32) must not silently become the default
        for name, x in (("rope_scale", rope_scale), ("rope_theta", rope_theta)):
            if not math.isfinite(f32(x)) or f32(x) <= 0:
                raise ValueError("kvattn: %s=%r must be a positive finite number (as float32) with "
                                 "pos_encoding_mode='ROPE_LLAMA'" % (name, x))
    d = F.kva_attention_desc()
    F.lib().kva_attention_desc_init(ctypes.byref(d), num_qo_heads, num_kv_heads, head_dim_qk, q_dtype)
    d.head_dim_vo = head_dim_vo
    d.q_dtype, d.kv_dtype, d.o_dtype = q_dtype, kv_dtype, o_dtype
    d.mask_mode = mask_mode
    d.window_left = int(window_left)
    d.logits_soft_cap = float(logits_soft_cap)
    d.sm_scale = float(sm_scale)
    d.pos_encoding = POS_ENCODING_MODES[pos_encoding]
    d.rope_scale = float(rope_scale)
    d.rope_theta = float(rope_theta)
    d.variant = variant_ptr or None
    return d


# --------------------------------------------------------------------------------------------------
# Arrays

def _page_size_one(x: Any, layout: str) -> Any:
    """x with a page dimension of size 1 inserted (NHD: before the heads, HND: after them): a cache without a page
    dimension is a page-size-1 cache, as in FlashInfer (e.g. a token-granular [num_tokens, num_kv_heads, head_dim])."""
    axis = x.ndim - 2 if layout == "NHD" else x.ndim - 1
    return x.unsqueeze(axis) if T.is_torch(x) else np.expand_dims(x, axis)


def split_paged_kv(paged_kv_cache: Any, layout: str) -> Tuple[Any, Any]:
    """(k, v) 4-D views of a paged KV cache given as one 5-D tensor [P, 2, ...] or a (K, V) pair of 4-D tensors.
    Without the page_size dimension (a 4-D [P, 2, H, D] tensor, 3-D [P, H, D] K and V) the page size is 1."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError("kvattn: paged_kv_cache as a tuple must be (k_cache, v_cache)")
        k, v = paged_kv_cache
        for name, x in (("k_cache", k), ("v_cache", v)):
            if not (T.is_torch(x) or isinstance(x, np.ndarray)):
                raise TypeError("kvattn: %s must be a NumPy array or a torch tensor, got %s" % (name, type(x).__name__))
        if k.ndim not in (3, 4) or v.ndim != k.ndim:
            raise ValueError("kvattn: k_cache and v_cache must be 4-D [num_pages, %s] (or both 3-D [num_pages, "
                             "num_kv_heads, head_dim] for page_size 1), got shapes %s and %s" % (
                                 "page_size, num_kv_heads, head_dim" if layout == "NHD"
                                 else "num_kv_heads, page_size, head_dim", tuple(k.shape), tuple(v.shape)))
        if k.ndim == 3:
            k, v = _page_size_one(k, layout), _page_size_one(v, layout)
        return k, v
    x = paged_kv_cache
    if not (T.is_torch(x) or isinstance(x, np.ndarray)):
        raise TypeError("kvattn: paged_kv_cache must be an array or a (k_cache, v_cache) tuple, got %s"
                        % type(x).__name__)
    if x.ndim == 4 and int(x.shape[1]) == 2:
        x = _page_size_one(x, layout)
    if x.ndim != 5 or int(x.shape[1]) != 2:
        raise ValueError("kvattn: paged_kv_cache must be 5-D [num_pages, 2, %s] (or a (K, V) tuple), got shape %s"
                         % ("page_size, num_kv_heads, head_dim" if layout == "NHD"
                            else "num_kv_heads, page_size, head_dim", tuple(x.shape)))
    if T.is_torch(x):  # select(): one ATen call per view, cheaper than indexing with slices
        return x.select(1, 0), x.select(1, 1)
    return x[:, 0], x[:, 1]


def pool_dims(k: Any, layout: str) -> Tuple[int, int, int, int]:
    """(num_pages, page_size, num_heads, head_dim) of a 4-D K or V pool view."""
    s = k.shape
    if layout == "NHD":
        return int(s[0]), int(s[1]), int(s[2]), int(s[3])
    return int(s[0]), int(s[2]), int(s[1]), int(s[3])


def fill_paged(p: "F.kva_paged_kv", k: Any, v: Any, layout: str, dtype: int, num_pages: int, indices_ptr: int,
               indptr_ptr: int = 0, last_page_len_ptr: int = 0, num_indices: int = 0) -> None:
    ks = T.strides_of(k, "k_cache")
    vs = T.strides_of(v, "v_cache")
    P, ps, H, Dk = pool_dims(k, layout)
    _, _, _, Dv = pool_dims(v, layout)
    if Dk > 1 and ks[3] != 1 or Dv > 1 and vs[3] != 1:
        raise ValueError("kvattn: the KV cache must have a contiguous head_dim (element stride 1), got K strides %s "
                         "and V strides %s" % (ks, vs))
    p.k_data = T.data_ptr(k) or None
    p.v_data = T.data_ptr(v) or None
    p.dtype = dtype
    p.num_pages = int(num_pages)
    p.page_size = ps
    p.num_heads = H
    p.head_dim_qk = Dk
    p.head_dim_vo = Dv
    p.k_stride_page = ks[0]
    p.v_stride_page = vs[0]
    if layout == "NHD":
        p.k_stride_token, p.k_stride_head = ks[1], ks[2]
        p.v_stride_token, p.v_stride_head = vs[1], vs[2]
    else:
        p.k_stride_head, p.k_stride_token = ks[1], ks[2]
        p.v_stride_head, p.v_stride_token = vs[1], vs[2]
    p.indices = indices_ptr or None
    p.indptr = indptr_ptr or None
    p.last_page_len = last_page_len_ptr or None
    p.num_indices = int(num_indices)


def copy_into(dst: Any, src: Any, what: str) -> None:
    """dst[:len(src)] = src for 1-D buffers (NumPy or torch, any devices)."""
    n = int(src.shape[0])
    if n > int(dst.shape[0]):
        raise ValueError("kvattn: %s holds %d elements but %d are needed" % (what, int(dst.shape[0]), n))
    if n == 0:
        return
    if T.is_torch(dst):
        torch = T._torch()
        if T.is_torch(src):
            if src.data_ptr() == dst.data_ptr() and src.dtype == dst.dtype:
                return
            if dst.is_cuda and not src.is_cuda:
                src = T.pinned(src.reshape(-1))  # (a pageable source may make the copy wait for the stream)
            dst[:n].copy_(src.reshape(-1), non_blocking=True)
        elif dst.is_cuda:
            dst[:n].copy_(T.pinned(src), non_blocking=True)
        else:
            dst[:n].copy_(torch.from_numpy(np.ascontiguousarray(src)), non_blocking=False)
    else:
        if T.is_torch(src):
            src = src.detach().cpu().numpy()
        if T.data_ptr(src) == T.data_ptr(dst) and src.dtype == dst.dtype:
            return
        dst[:n] = src


# --------------------------------------------------------------------------------------------------
# Plan state and the run entry point

_registry: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


class PlanState:
    """Everything a run needs from a plan (host side)."""

    op: int
    desc: "F.kva_attention_desc"
    plan: "F.kva_plan"
    ws: "F.kva_workspace"
    ctx: int
    dev: T.DeviceKey
    graph: bool
    kv_layout: str
    q_dtype: int
    kv_dtype: int
    o_dtype: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    batch_size: int
    total_rows: int
    total_kv: int
    num_pages: int
    window_left: int
    logits_soft_cap: float
    sm_scale: float
    pos_encoding: str
    rope_scale: float
    rope_theta: float
    causal: bool
    q_len_per_req: int
    # host arrays the plan was made from (kept for re-planning at run when the pool size changes)
    h_qo_indptr: Optional[np.ndarray]
    h_kv_indptr: np.ndarray
    h_last_page_len: Optional[np.ndarray]
    h_indices: Optional[np.ndarray]
    # the block-table form (plan(block_tables=, seq_lens=)): per-request lengths and the table's row length; the
    # page table (h_indices / indices) is then the [B, bt_stride] table flattened, and h_kv_indptr is None
    h_seq_lens: Optional[np.ndarray]
    bt_stride: int
    fixed_split_tokens: int
    disable_split_kv: bool
    max_batch: int
    max_rows: int
    # backend arrays the run reads
    indices: Any
    mask: Any
    mask_bytes: int
    # user variant (desc.variant) and its run-time parameters given at plan (None = not given: run passes them)
    variant: Optional[V.Variant]
    v_scalars: Optional[Tuple[float, ...]]
    v_tensors: Optional[Tuple[Any, ...]]

    def __init__(self) -> None:
        self.variant = None
        self.v_scalars = None
        self.v_tensors = None
        self.indices = None
        self.mask = None
        self.mask_bytes = 0
        self.h_qo_indptr = None
        self.h_last_page_len = None
        self.h_indices = None
        self.h_seq_lens = None
        self.bt_stride = 0
        self.num_pages = 0
        self.total_kv = 0
        self.page_size = 0
        self.q_len_per_req = 1
        self.causal = False
        self.valid = False
        self.scratch_bytes = 0
        self.commit: Any = None
        self.layout_shape_k: Optional[Tuple[int, ...]] = None
        self.layout_shape_v: Optional[Tuple[int, ...]] = None
        self.fast: Optional[FastRun] = None  # the prepared run of the last eager call (see FastRun)

    def params(self) -> "F.kva_plan_params":
        p = F.kva_plan_params()
        F.lib().kva_plan_params_init(ctypes.byref(p))
        p.batch_size = self.batch_size
        p.qo_indptr = self.h_qo_indptr.ctypes.data if self.h_qo_indptr is not None else None
        if self.bt_stride:  # the block-table form: the CSR arrays are not read
            p.kv_seq_lens = self.h_seq_lens.ctypes.data
            p.block_table_stride = self.bt_stride
        else:
            p.kv_indptr = self.h_kv_indptr.ctypes.data
            p.kv_last_page_len = self.h_last_page_len.ctypes.data if self.h_last_page_len is not None else None
        p.page_size = self.page_size
        p.num_pages = self.num_pages
        p.kv_indices = self.h_indices.ctypes.data if self.h_indices is not None and self.h_indices.size else None
        p.fixed_split_size = self.fixed_split_tokens
        p.disable_split_kv = 1 if self.disable_split_kv else 0
        p.graph_mode = 1 if self.graph else 0
        p.max_batch_size = self.max_batch if self.graph else 0
        p.max_total_qo_rows = self.max_rows if self.graph else 0
        return p


def commit_plan(st: PlanState, ws: C.Workspace, what: str) -> None:
    """Size, check and make the C plan for st into workspace ws (st.plan / st.ws / st.ctx are set)."""
    lib = F.lib()
    ctx = C.get_context(st.dev)
    # the variant's current handle on this device (raises if the Variant was closed; compiles it on first use)
    st.desc.variant = st.variant.handle(st.dev) if st.variant is not None else None
    params = st.params()
    # The plan goes to the wrapper's own plan memory, the split-KV partials to the float workspace buffer (the C
    # workspace's scratch): wrappers sharing one float workspace keep their plans (as with FlashInfer's per-wrapper
    # int workspace), and a run only needs its partials there while it runs.
    plan = F.kva_plan()
    stream = C.current_stream(st.dev)

    def make(w: "F.kva_workspace") -> int:
        return lib.kva_plan_make(ctx, ctypes.byref(st.desc), st.op, ctypes.byref(params), ctypes.byref(w),
                                 ctypes.byref(plan), stream)

    # The plan memory and host staging of an earlier plan usually fit this one: plan straight into them (the C planner
    # checks every size before it writes anything, so a plan that does not fit leaves them as they were) and size the
    # parts only when it does not fit. That saves the planner's sizing pass on most steps.
    wss = ws.struct_current()
    rc = make(wss) if wss is not None else F.KVA_ERR_WORKSPACE_TOO_SMALL
    if rc == F.KVA_ERR_WORKSPACE_TOO_SMALL:
        plan_b, scr_b, host_b = ctypes.c_size_t(0), ctypes.c_size_t(0), ctypes.c_size_t(0)
        F.check(lib.kva_plan_workspace_parts(ctx, ctypes.byref(st.desc), st.op, ctypes.byref(params),
                                             ctypes.byref(plan_b), ctypes.byref(scr_b), ctypes.byref(host_b)), what)
        wss = ws.struct_split(int(plan_b.value), int(scr_b.value), int(host_b.value), bool(st.graph), what)
        rc = make(wss)
    F.check(rc, what)
    info = F.kva_plan_info()
    F.check(lib.kva_plan_get_info(ctypes.byref(plan), ctypes.byref(info)), what)
    st.plan, st.ws, st.ctx = plan, wss, ctx
    st.fast = None  # prepared for the previous C plan
    st.scratch_bytes = int(info.scratch_bytes) if wss.scratch else 0
    st.commit = object()  # this commit's identity (the plan memory is the wrapper's own: nobody else writes there;
    # the runs record the scratch bytes they write, see run_impl)


def _narrow_rows(t: "F.kva_tensor", rows: int) -> None:
    if t.data and t.shape[0] > rows:
        t.shape[0] = rows


def variant_run_params(st: PlanState, scalars: Any, tensors: Any, where: str) -> "V.RunParams":
    """The variant parameters of a run of plan st: those given to run(), else those given to plan() (checked;
    a variant that takes parameters needs them from one of the two)."""
    if st.variant is None:
        if (scalars is not None and len(scalars)) or (tensors is not None and len(tensors)):
            raise InvalidArgumentError("kvattn: %s got variant_scalars / variant_tensors but the plan has no "
                                       "variant (pass variant= to plan())" % where)
        return V.RunParams()
    vs = st.v_scalars if scalars is None and st.v_scalars is not None else \
        V.check_scalars(st.variant, scalars, where)
    vt = st.v_tensors if tensors is None and st.v_tensors is not None else \
        V.check_tensors(st.variant, tensors, st.dev, where)
    return V.run_params(st.variant, vs, vt)


def pdl_flag(enable_pdl: Optional[bool]) -> bool:
    """run()'s enable_pdl: None = on, as FlashInfer's default on devices that support it (the C library launches
    with programmatic dependent launch only on compute capability 9.0+ and ignores the flag elsewhere)."""
    return True if enable_pdl is None else bool(enable_pdl)


def run_impl(handle: int, q: Any, k: Any, v: Any, out: Any, lse: Any, k_scale: float, v_scale: float,
             variant_scalars: Any = None, variant_tensors: Any = None, enable_pdl: bool = True) -> Any:
    """Run wrapper `handle`'s current plan: the body of the kvattn::run custom op (arrays were checked by the
    wrapper in eager mode; the C library re-checks everything against the plan). The variant parameters default
    to those given at plan (the custom op passes none, and runs with programmatic dependent launch). Returns the
    kva_run_args it ran with."""
    w = _registry.get(int(handle))
    if w is None:
        raise RuntimeError("kvattn: wrapper handle %d is gone (the wrapper was garbage collected)" % handle)
    st = w._require_plan()
    if st.scratch_bytes:  # the partials this run writes (the block-sparse wrappers' plans may live there)
        C.claim_workspace(st.dev, int(st.ws.scratch), st.scratch_bytes, C.SCRATCH_WRITES)
    lib = F.lib()
    args = F.kva_run_args()
    lib.kva_run_args_init(ctypes.byref(args))
    vparams = variant_run_params(st, variant_scalars, variant_tensors, type(w).__name__ + ".run")
    vparams.apply(args)
    T.fill_tensor(args.q, q, "q")
    T.fill_tensor(args.o, out, "out", out=True)
    if lse is not None:
        T.fill_tensor(args.lse, lse, "lse", out=True)
    if st.graph:  # buffers sized for the graph's bounds: the plan's rows are the leading ones
        for t in (args.q, args.o, args.lse):
            _narrow_rows(t, st.total_rows)
    if st.op == F.KVA_OP_BATCH_PREFILL_RAGGED:
        T.fill_tensor(args.k, k, "k")
        T.fill_tensor(args.v, v, "v")
        if st.graph:
            _narrow_rows(args.k, st.total_kv)
            _narrow_rows(args.v, st.total_kv)
    else:
        pool = int(k.shape[0])
        if pool < st.num_pages or (st.graph and pool != st.num_pages):
            # The plan was made for another pool size (FlashInfer's plan never sees the pool): plan again for
            # this one. Not possible while a CUDA graph is being captured.
            if C.is_capturing(st.dev):
                raise CaptureActiveError(
                    "kvattn: the paged KV cache has %d pages but the plan was made for a pool of %d pages; run the "
                    "wrapper once outside CUDA-graph capture (or pass num_pages=%d to plan) before capturing"
                    % (pool, st.num_pages, pool))
            w._replan_for_pool(pool)
            st = w._require_plan()
        w._pool_pages = pool
        # the run reads the plan's indices array (FlashInfer's contract), which the caller may have refilled since
        # plan(): its entries are bounded by the pool given here (at least the planned one), not the planned size
        fill_paged(args.paged, k, v, st.kv_layout, st.kv_dtype, pool, T.data_ptr(st.indices),
                   num_indices=int(st.indices.shape[0]) if st.indices is not None else 0)
    if st.mask is not None:
        args.custom_mask = T.data_ptr(st.mask) or None
        args.custom_mask_bytes = st.mask_bytes
    args.k_scale = float(k_scale)
    args.v_scale = float(v_scale)
    args.stream = C.current_stream(st.dev)
    args.enable_pdl = 1 if enable_pdl else 0
    F.check(lib.kva_run(st.ctx, ctypes.byref(st.plan), ctypes.byref(st.ws), ctypes.byref(args)), "run")
    del vparams  # the scalars / tensor pointers were read during the call
    return args


def dispatch_run(handle: int, q: Any, k: Any, v: Any, out: Any, lse: Any, k_scale: float, v_scale: float,
                 variant_scalars: Any = None, variant_tensors: Any = None, enable_pdl: Optional[bool] = None) -> Any:
    """Run through the custom op under torch.compile, else directly; returns the kva_run_args of a direct run (None
    under torch.compile)."""
    if T.is_torch(q) and _torch_ops.is_compiling():  # (the custom op runs with enable_pdl on)
        if variant_scalars is not None or variant_tensors is not None:
            raise UnsupportedError("kvattn: under torch.compile the variant parameters cannot be passed to run(); "
                                   "pass variant_scalars / variant_tensors to plan() (they are the run's defaults)")
        _torch_ops.ops().run(handle, q, k, v, out, lse, k_scale, v_scale)
        return None
    return run_impl(handle, q, k, v, out, lse, k_scale, v_scale, variant_scalars, variant_tensors,
                    pdl_flag(enable_pdl))


# --------------------------------------------------------------------------------------------------
# The prepared run: eager runs of one plan with torch tensors of unchanged shapes skip the argument checks

def fast_key(q: Any, kv: Tuple[Any, ...], out: Any, lse: Any, return_lse: bool) -> Optional[Tuple[Any, ...]]:
    """The prepared-run key of a call: the signatures of q, the KV inputs (the paged cache as given: one tensor or a
    (K, V) pair; ragged K and V), out and lse (None for an output the run allocates), and return_lse. None when an
    input is not a torch tensor (NumPy arrays take the checked path)."""
    return T.sig_key((bool(return_lse), len(kv)), (q,) + tuple(kv) + (out, lse))


class FastRun:
    """The kva_run_args of a checked eager run, kept for the next runs of the same plan whose tensors have the same
    shapes, strides, dtypes and devices (fast_key): those runs set only the data pointers, scales, stream and PDL
    flag, without the wrapper's argument checks (whose outcome the key decides; the C library checks every run against
    the plan regardless). Dropped by any new plan (commit_plan)."""

    __slots__ = ("key", "args", "q_t", "o_t", "lse_t", "kv_t", "kv_src", "out_shape", "lse_shape", "o_dtype",
                 "device", "capture_check", "busy")

    def __init__(self, key: Tuple[Any, ...], args: Any, kv_in: Tuple[Any, ...], k: Any, v: Any, paged: bool,
                 out_new: bool, lse_new: bool, out: Any, lse: Any, capture_check: bool) -> None:
        self.key = key
        self.args = args
        self.q_t = args.q
        self.o_t = args.o
        self.lse_t = args.lse if lse is not None else None
        # where K's and V's data pointers come from: (input index, byte offset): one paged cache tensor holds both
        # (V at a fixed offset from K), a (K, V) pair or ragged K and V have one each (views at offset 0)
        vi = 1 if len(kv_in) > 1 else 0
        src = [(0, k.data_ptr() - kv_in[0].data_ptr()), (vi, v.data_ptr() - kv_in[vi].data_ptr())]
        self.kv_src = tuple(src)
        # the structs whose data pointers are K's and V's (the paged cache's fields, or the ragged K and V tensors)
        self.kv_t = (args.paged, None) if paged else (args.k, args.v)
        self.out_shape = tuple(out.shape) if out_new else None
        self.lse_shape = tuple(lse.shape) if lse_new else None
        self.o_dtype = (out.dtype, lse.dtype if lse is not None else None)
        self.device = out.device
        self.capture_check = capture_check
        # held from the pointer writes to the end of the C call (ctypes releases the GIL during it): a run of the same
        # wrapper from another thread meanwhile takes the checked path with arguments of its own
        self.busy = threading.Lock()


def fast_record(st: "PlanState", key: Optional[Tuple[Any, ...]], args: Any, kv_in: Tuple[Any, ...], k: Any, v: Any,
                paged: bool, out_given: bool, lse_given: bool, out: Any, lse: Any) -> None:
    """After a checked eager run with args: prepare the next runs of this plan with the same key."""
    if key is None or args is None or st.variant is not None or not st.valid:
        return
    st.fast = FastRun(key, args, kv_in, k, v, paged, not out_given, lse is not None and not lse_given, out, lse,
                      not st.graph)


def any_given(checks: Dict[str, Any]) -> bool:
    for x in checks.values():
        if x is not None:
            return True
    return False


def non_graph_capture_error(w: Any) -> CaptureActiveError:
    return CaptureActiveError(
        "kvattn: %s.run is being captured into a CUDA graph but the wrapper was created with use_cuda_graph=False; "
        "its plans cannot be replaced under a captured graph. Create it with use_cuda_graph=True (and fixed buffers)"
        % type(w).__name__)


def fast_run(w: Any, st: "PlanState", key: Optional[Tuple[Any, ...]], kv_in: Tuple[Any, ...], q: Any, out: Any,
             lse: Any, q_scale: Any, k_scale: Any, v_scale: Any,
             enable_pdl: Optional[bool]) -> Optional[Tuple[Any, Any]]:
    """Run st.fast with these tensors when its key is this call's; returns (out, lse), or None (nothing done) when
    there is no such prepared run or another thread is running it."""
    fr = st.fast
    if key is None or fr is None or fr.key != key or not fr.busy.acquire(blocking=False):
        return None
    try:
        if fr.capture_check and C.is_capturing(st.dev):
            raise non_graph_capture_error(w)
        if q_scale is None and k_scale is None and v_scale is None:
            ks, vs = 1.0, 1.0
        else:
            ks, vs = scales_for(q_scale, k_scale, v_scale)
        torch = T._TORCH_MOD
        if out is None:
            out = torch.empty(fr.out_shape, dtype=fr.o_dtype[0], device=fr.device)
        if lse is None and fr.lse_shape is not None:
            lse = torch.empty(fr.lse_shape, dtype=fr.o_dtype[1], device=fr.device)
        args = fr.args
        fr.q_t.data = q.data_ptr() or None
        fr.o_t.data = out.data_ptr() or None
        if fr.lse_t is not None:
            fr.lse_t.data = lse.data_ptr() or None
        (ki, ko), (vi, vo) = fr.kv_src
        kp = kv_in[ki].data_ptr() + ko
        vp = kv_in[vi].data_ptr() + vo
        kt, vt = fr.kv_t
        if vt is None:  # the paged cache
            kt.k_data = kp or None
            kt.v_data = vp or None
        else:
            kt.data = kp or None
            vt.data = vp or None
        args.k_scale = ks
        args.v_scale = vs
        args.stream = C.current_stream(st.dev)
        args.enable_pdl = 0 if enable_pdl is not None and not enable_pdl else 1
        if st.scratch_bytes:
            C.claim_workspace(st.dev, int(st.ws.scratch), st.scratch_bytes, C.SCRATCH_WRITES)
        F.check(F.lib().kva_run(st.ctx, ctypes.byref(st.plan), ctypes.byref(st.ws), ctypes.byref(args)), "run")
        return out, lse
    finally:
        fr.busy.release()


def check_variant_run(st: PlanState, want_lse: bool, what: str) -> None:
    """Refusals that depend on the plan's variant and the run's outputs (before anything is allocated)."""
    var = st.variant
    if var is None:
        return
    if want_lse and not var.use_softmax:
        raise InvalidArgumentError("kvattn: %s: lse is not defined for variant %r (use_softmax=False); do not ask "
                                   "for it (return_lse / lse=)" % (what, var.name))


def scales_for(q_scale: Any, k_scale: Any, v_scale: Any) -> Tuple[float, float]:
    """(k_scale, v_scale) for the C run. FlashInfer folds q_scale and k_scale into the logits scale and multiplies
    the values (so the output) by v_scale, for any KV dtype; the C library applies its k_scale and v_scale inside the
    kernels for every KV dtype, so q_scale goes into k_scale."""
    qs = 1.0 if q_scale is None else float(q_scale)
    ks = 1.0 if k_scale is None else float(k_scale)
    vs = 1.0 if v_scale is None else float(v_scale)
    for name, x in (("q_scale", qs), ("k_scale", ks), ("v_scale", vs)):
        if not math.isfinite(x):
            raise ValueError("kvattn: %s=%r must be finite" % (name, x))
    if not math.isfinite(qs * ks):
        raise ValueError("kvattn: q_scale * k_scale = %r must be finite" % (qs * ks))
    return qs * ks, vs


# --------------------------------------------------------------------------------------------------
# Base class of the batch wrappers

class BatchWrapperBase:
    """Shared behaviour of the batch wrappers: workspace, plan state, run checks, deprecated aliases."""

    _kind = "batch"

    def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", jit_args: Any = None, jit_kwargs: Any = None) -> None:
        check_backend(backend, jit_args, jit_kwargs)
        self._kv_layout = parse_layout(kv_layout)
        self._float_workspace_buffer = float_workspace_buffer
        self._ws = C.Workspace(float_workspace_buffer)
        self._dev = self._ws.dev
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = backend
        self._state: Optional[PlanState] = None
        self._pool_pages: Optional[int] = None
        self._handle = next(_handles)
        _registry[self._handle] = self
        if T.is_torch(float_workspace_buffer):
            _torch_ops.ensure_registered()

    # ---- FlashInfer properties / housekeeping ----
    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def device(self) -> Any:
        if T.is_torch(self._float_workspace_buffer):
            return self._float_workspace_buffer.device
        return "cpu"

    def reset_workspace_buffer(self, float_workspace_buffer: Any, int_workspace_buffer: Any = None,
                               *args: Any, **kwargs: Any) -> None:
        """Swap the float workspace (kvattn has no separate int workspace: int_workspace_buffer is accepted and
        unused). The current plan is dropped: call plan() again before run()."""
        ws = C.Workspace(float_workspace_buffer)
        if ws.dev != self._dev:
            raise ValueError("kvattn: reset_workspace_buffer: the new buffer is on %s, the wrapper on %s"
                             % (T.device_str(ws.dev), T.device_str(self._dev)))
        self._float_workspace_buffer = float_workspace_buffer
        self._ws = ws
        self._set_state(None)

    def end_forward(self) -> None:
        """Deprecated FlashInfer no-op."""

    # ---- the current plan's scalars under FlashInfer's attribute names (engines assert on them after plan()):
    # the values as given to plan() or the last forward() that set them (sm_scale None = the default
    # 1/sqrt(head_dim); logits_soft_cap None reads 0.0, as FlashInfer's plan stores it); AttributeError before a plan
    def _planned_value(self, key: str) -> Any:
        st = self._state
        if st is None or not st.valid:
            raise AttributeError("kvattn: %s has no plan (call plan() first)" % type(self).__name__)
        return st.user[key]

    _sm_scale = property(lambda self: self._planned_value("sm_scale"))
    _logits_soft_cap = property(lambda self: self._planned_value("logits_soft_cap"))
    _window_left = property(lambda self: self._planned_value("window_left"))
    _causal = property(lambda self: self._planned_value("causal"))
    _pos_encoding_mode = property(lambda self: self._planned_value("pos_encoding"))
    _rope_scale = property(lambda self: self._planned_value("rope_scale"))
    _rope_theta = property(lambda self: self._planned_value("rope_theta"))

    # ---- plan helpers ----
    def _set_state(self, st: Optional[PlanState]) -> None:
        """Install a new plan. The PlanState object of a wrapper stays the same (its fields are replaced), so
        code traced by torch.compile that reads it keeps valid guards across plans."""
        cur = self._state
        if st is None:
            if cur is not None:
                cur.valid = False
            return
        st.valid = True
        if cur is None or cur is st:
            self._state = st
        else:
            cur.__dict__.clear()
            cur.__dict__.update(st.__dict__)

    def _require_plan(self) -> PlanState:
        st = self._state
        if st is None or not st.valid:
            raise RuntimeError("kvattn: %s.run() called before plan() (or after reset_workspace_buffer(), or after a "
                               "plan() that raised: a failed plan drops the previous one)" % type(self).__name__)
        return st

    def _replan_for_pool(self, num_pages: int) -> None:
        st = self._require_plan()
        old = st.num_pages
        region = self._ws.plan_region.ptr
        st.num_pages = int(num_pages)
        try:
            commit_plan(st, self._ws, "%s.plan (pool of %d pages)" % (type(self).__name__, num_pages))
        except Exception:
            st.num_pages = old  # the C plan validates before writing anything: the old plan stands
            if self._ws.plan_region.ptr != region:  # unless its memory was replaced before the failure
                self._set_state(None)
            raise

    def _choose_num_pages(self, num_pages: Any, h_indices: Optional[np.ndarray], d_indices: Any, n: int) -> int:
        """Pool size to plan with: explicit > last pool seen at run (raised to cover host-visible indices) >
        max host index + 1 > max device index + 1 (the last one synchronises; first plan only)."""
        if num_pages is not None:
            return max(size_arg(num_pages, "num_pages", lo=0, hi=2 ** 63 - 1), 1)
        hi = None
        if h_indices is not None:
            hi = int(h_indices[:n].max()) + 1 if n > 0 else 1
        if self._pool_pages is not None:
            return max(self._pool_pages, hi or 1)
        if hi is not None:
            return max(hi, 1)
        if n == 0:
            return 1
        return max(int(d_indices[:n].max().item()) + 1, 1)

    def plan_info(self) -> Dict[str, int]:
        """Facts about the current plan (kvattn extension): workers, tiles, KV chunk size, work items, bytes."""
        st = self._require_plan()
        info = F.kva_plan_info()
        F.check(F.lib().kva_plan_get_info(ctypes.byref(st.plan), ctypes.byref(info)), "kva_plan_get_info")
        return {name: int(getattr(info, name)) for name, _ in F.kva_plan_info._fields_}

    def read_faults(self) -> Dict[str, int]:
        """Read and clear the device fault word (kvattn extension; CUDA: synchronises the stream).
        Returns {'faulted', 'request', 'page_index'}."""
        st = self._require_plan()
        rep = F.kva_fault_report()
        F.check(F.lib().kva_read_faults(st.ctx, ctypes.byref(st.ws), ctypes.byref(rep), C.current_stream(st.dev)),
                "kva_read_faults")
        return {"faulted": int(rep.faulted), "request": int(rep.request), "page_index": int(rep.page_index)}

    # ---- run helpers ----
    def _check_scalars(self, st: PlanState, window_left: Any = None, logits_soft_cap: Any = None,
                       sm_scale: Any = None, rope_scale: Any = None, rope_theta: Any = None,
                       pos_encoding_mode: Any = None, causal: Any = None) -> None:
        """A run-time value that disagrees with the plan raises (FlashInfer silently ignored some of them)."""
        def bad(name: str, given: Any, planned: Any) -> None:
            raise PlanMismatchError(
                "kvattn: %s.run got %s=%r but the plan was made with %s=%r; pass it to plan() instead (plan-time "
                "parameters are fixed for every run of a plan)" % (type(self).__name__, name, given, name, planned))

        if window_left is not None and norm_window(window_left) != st.window_left:
            bad("window_left", window_left, st.window_left)
        if logits_soft_cap is not None and f32(norm_cap(logits_soft_cap)) != f32(st.logits_soft_cap):
            bad("logits_soft_cap", logits_soft_cap, st.logits_soft_cap or None)
        if sm_scale is not None and f32(sm_scale) != f32(st.sm_scale):
            bad("sm_scale", sm_scale, st.sm_scale)
        if rope_scale is not None and f32(rope_scale) != f32(st.rope_scale):
            bad("rope_scale", rope_scale, st.rope_scale)
        if rope_theta is not None and f32(rope_theta) != f32(st.rope_theta):
            bad("rope_theta", rope_theta, st.rope_theta)
        if pos_encoding_mode is not None and parse_pos_encoding(pos_encoding_mode) != st.pos_encoding:
            bad("pos_encoding_mode", pos_encoding_mode, st.pos_encoding)
        if causal is not None and bool(causal) != st.causal:
            bad("causal", causal, st.causal)

    def _check_array(self, st: PlanState, x: Any, what: str, dtype: int, shape: Sequence[Optional[int]],
                     rows_at_least: Optional[int] = None) -> None:
        if (T.is_torch(x) and x.is_cuda and ("cuda", x.get_device()) == st.dev and
                T.torch_dtype_map().get(x.dtype) == dtype and rows_at_least is None and None not in shape and
                tuple(x.shape) == tuple(shape)):
            # the common case in one pass: a CUDA tensor of the plan's device, dtype and exact shape
            xs = x.stride()
            if xs and min(xs) >= 0 and (int(x.shape[-1]) <= 1 or xs[-1] == 1):
                return
        if not (T.is_torch(x) or isinstance(x, np.ndarray)):
            raise TypeError("kvattn: %s must be a NumPy array or a torch tensor, got %s" % (what, type(x).__name__))
        dev = T.device_of(x)
        if dev != st.dev:
            raise ValueError("kvattn: %s is on %s but the wrapper's workspace is on %s"
                             % (what, T.device_str(dev), T.device_str(st.dev)))
        code = T.dtype_of(x, what)
        if code != dtype:
            raise PlanMismatchError("kvattn: %s has dtype %s but the plan expects %s%s" % (
                what, T.dtype_name(code), T.dtype_name(dtype),
                " (pass q_data_type=... to plan(); FlashInfer's default is float16)" if what == "q" else
                " (pass kv_data_type=... to plan())" if what.startswith("k") or what.startswith("v") else ""))
        if x.ndim != len(shape):
            raise ValueError("kvattn: %s must be %d-D, got shape %s" % (what, len(shape), tuple(x.shape)))
        for i, s in enumerate(shape):
            if s is None:
                continue
            got = int(x.shape[i])
            if i == 0 and rows_at_least is not None:
                if got < rows_at_least:
                    raise PlanMismatchError("kvattn: %s has %d rows but the plan has %d" % (what, got, rows_at_least))
                continue
            if got != s:
                raise PlanMismatchError("kvattn: %s has shape %s but the plan expects %s" % (
                    what, tuple(int(d) for d in x.shape), tuple("*" if d is None else d for d in shape)))
        T.check_last_contiguous(x, what, T.strides_of(x, what))

    def _outputs(self, st: PlanState, q: Any, out: Any, lse: Any, return_lse: bool, check: bool) -> Tuple[Any, Any]:
        rows = int(q.shape[0])
        if out is None:
            out = T.empty(q, (rows, st.num_qo_heads, st.head_dim_vo), st.o_dtype)
        elif check:
            self._check_array(st, out, "out", st.o_dtype, (rows, st.num_qo_heads, st.head_dim_vo))
        if return_lse or lse is not None:
            if lse is None:
                lse = T.empty(q, (rows, st.num_qo_heads), F.KVA_DTYPE_F32)
            elif check:
                self._check_array(st, lse, "lse", F.KVA_DTYPE_F32, (rows, st.num_qo_heads))
        return out, lse

    def _run_paged(self, q: Any, paged_kv_cache: Any, extra_args: Tuple, q_scale: Any, k_scale: Any, v_scale: Any,
                   out: Any, lse: Any, return_lse: bool, variant_scalars: Any = None, variant_tensors: Any = None,
                   enable_pdl: Optional[bool] = None, **checks: Any) -> Any:
        if extra_args:
            raise NotImplementedError("kvattn: extra positional run() arguments (JIT variant parameters) are not "
                                      "supported")
        st = self._require_plan()
        compiling = _torch_ops.is_compiling()
        kv_in = tuple(paged_kv_cache) if isinstance(paged_kv_cache, (tuple, list)) else (paged_kv_cache,)
        key = None if compiling or extra_args or variant_scalars is not None or variant_tensors is not None else \
            fast_key(q, kv_in, out, lse, return_lse)
        res = None if any_given(checks) else \
            fast_run(self, st, key, kv_in, q, out, lse, q_scale, k_scale, v_scale, enable_pdl)
        if res is not None:
            return res if return_lse else res[0]
        if not compiling and st.graph is False and T.is_torch(q) and C.is_capturing(st.dev):
            raise non_graph_capture_error(self)
        self._check_scalars(st, **checks)
        k, v = split_paged_kv(paged_kv_cache, st.kv_layout)
        if not compiling:
            rows = st.total_rows
            self._check_array(st, q, "q", st.q_dtype, (rows, st.num_qo_heads, st.head_dim_qk),
                              rows_at_least=rows if st.graph else None)
            if st.layout_shape_k is not None:
                P = int(k.shape[0])
                self._check_array(st, k, "k_cache", st.kv_dtype, (P,) + st.layout_shape_k)
                self._check_array(st, v, "v_cache", st.kv_dtype, (P,) + st.layout_shape_v)
        ks, vs = scales_for(q_scale, k_scale, v_scale)
        check_variant_run(st, return_lse or lse is not None, type(self).__name__ + ".run")
        out_given, lse_given = out is not None, lse is not None
        out, lse = self._outputs(st, q, out, lse, return_lse, check=not compiling)
        args = dispatch_run(self._handle, q, k, v, out, lse, ks, vs, variant_scalars, variant_tensors, enable_pdl)
        if key is not None:
            fast_record(self._require_plan(), key, args, kv_in, k, v, True, out_given, lse_given, out, lse)
        return (out, lse) if return_lse else out

    # ---- paged plan setup shared by decode and paged prefill ----
    def _setup_paged(self, st: PlanState, indptr: Any, indices: Any, last_page_len: Any, page_size: int,
                     num_pages: Any, indptr_buf: Any = None, indices_buf: Any = None,
                     last_page_len_buf: Any = None) -> None:
        """Host copies of the page table, backend indices (graph mode: copied into the fixed buffers), pool
        size, and the expected pool shapes."""
        page_size = size_arg(page_size, "page_size")
        h_indptr = T.host_int32_owned(indptr, "indptr")
        if h_indptr.size < 1:
            raise ValueError("kvattn: indptr must have batch_size + 1 >= 1 elements")
        B = h_indptr.size - 1
        h_lpl = T.host_int32(last_page_len, "last_page_len")
        if h_lpl.size < B:
            raise ValueError("kvattn: last_page_len has %d elements, the batch has %d requests" % (h_lpl.size, B))
        h_lpl = h_lpl[:B].copy()  # the plan's own: the caller may refill its buffer after plan()
        n = int(h_indptr[-1])
        if n < 0:
            raise ValueError("kvattn: indptr[-1] = %d is negative" % n)
        if not (T.is_torch(indices) or isinstance(indices, np.ndarray)):
            indices = T.host_int32(indices, "indices")  # a sequence, as indptr / last_page_len may be
        if int(indices.shape[0]) < n:
            raise ValueError("kvattn: indices has %d elements but indptr[-1] = %d" % (int(indices.shape[0]), n))
        host_side = not T.is_torch(indices) or indices.device.type == "cpu"
        h_indices = T.host_int32(indices, "indices")[:n] if host_side else None
        if self._use_cuda_graph:
            copy_into(indptr_buf, h_indptr, "paged_kv_indptr_buffer")
            copy_into(last_page_len_buf, h_lpl, "paged_kv_last_page_len_buffer")
            src = h_indices if h_indices is not None else indices[:n]
            if T.is_torch(src) and src.dtype != T._torch().int32:
                src = src.to(T._torch().int32)
            copy_into(indices_buf, src, "paged_kv_indices_buffer")
            d_indices = indices_buf
        else:
            d_indices = T.backend_int32(h_indices if h_indices is not None else indices, self._dev, "indices")
        st.h_kv_indptr = h_indptr
        st.h_last_page_len = h_lpl
        st.h_indices = h_indices
        st.indices = d_indices
        st.page_size = page_size
        st.batch_size = B
        st.num_pages = self._choose_num_pages(num_pages, h_indices, d_indices, n)

    def _setup_block_table(self, st: PlanState, block_tables: Any, seq_lens: Any, page_size: int, num_pages: Any,
                           indices_buf: Any = None, dry: bool = False) -> None:
        """The block-table form of the page table: ``block_tables [B, max_blocks]`` (int32; request b's pages are
        row b's first ceil(seq_lens[b] / page_size) entries, the rest are never read) and ``seq_lens [B]`` (KV
        tokens; a device tensor is copied to the host, which synchronises). The table is used in place, flattened
        (no copy when it is a contiguous int32 array in the backend's memory); graph mode copies it into the fixed
        indices buffer, which must hold B * max_blocks entries. dry: host arrays only (size queries)."""
        page_size = size_arg(page_size, "page_size")
        h_sl = T.host_int32_owned(seq_lens, "seq_lens")
        B = int(h_sl.size)
        bt = block_tables
        if not (T.is_torch(bt) or isinstance(bt, np.ndarray)):
            bt = T.host_int32(bt, "block_tables", ndim=2)  # a nested sequence
        if len(bt.shape) != 2:
            raise ValueError("kvattn: block_tables must be 2-D [batch_size, max_blocks], got shape %s"
                             % (tuple(bt.shape),))
        if int(bt.shape[0]) < B:
            raise ValueError("kvattn: block_tables has %d rows, seq_lens %d requests" % (int(bt.shape[0]), B))
        stride = int(bt.shape[1])
        if B and h_sl.min() < 0:
            raise ValueError("kvattn: seq_lens[%d] = %d is negative" % (int(np.argmin(h_sl)), int(h_sl.min())))
        pages = (h_sl.astype(np.int64) + page_size - 1) // page_size
        if B and int(pages.max()) > stride:
            i = int(np.argmax(pages))
            raise ValueError("kvattn: seq_lens[%d] = %d needs %d pages of %d but block_tables rows hold %d"
                             % (i, int(h_sl[i]), int(pages[i]), page_size, stride))
        if B and stride < 1:
            raise ValueError("kvattn: block_tables has rows of 0 entries")
        host_side = not T.is_torch(bt) or bt.device.type == "cpu"
        h_flat = T.host_int32(bt[:B].reshape(-1) if T.is_torch(bt) else np.asarray(bt)[:B].reshape(-1),
                              "block_tables") if host_side else None
        npmax = int(pages.max()) if B else 0  # the kernels read row b's first pages[b] entries
        st.h_seq_lens = h_sl
        st.bt_stride = max(stride, 1)
        st.h_kv_indptr = None
        st.h_last_page_len = None
        st.h_indices = h_flat
        st.page_size = page_size
        st.batch_size = B
        hi = None  # the largest page index in use + 1, where the pool size must be inferred
        if num_pages is None and h_flat is not None:
            used = np.arange(npmax)[None, :] < pages[:, None]
            hi = int(h_flat.reshape(B, stride)[:, :npmax][used].max()) + 1 if npmax else 1
        if dry:
            st.indices = None
            st.num_pages = int(num_pages) if num_pages is not None else max(self._pool_pages or 2 ** 31 - 1, hi or 1)
            return
        if T.is_torch(bt) and not host_side:
            t = T._torch()
            flat = bt[:B].reshape(-1)
            if flat.dtype != t.int32:
                if flat.dtype.is_floating_point or flat.dtype == t.bool:
                    raise TypeError("kvattn: block_tables must be an integer tensor (int32), got %s" % flat.dtype)
                flat = flat.to(t.int32)
        else:
            flat = h_flat
        if self._use_cuda_graph:
            copy_into(indices_buf, flat, "paged_kv_indices_buffer (block_tables: batch_size x max_blocks entries)")
            d_indices = indices_buf
        else:
            d_indices = T.backend_int32(flat, self._dev, "block_tables")
        st.indices = d_indices
        if num_pages is not None:
            st.num_pages = max(size_arg(num_pages, "num_pages", lo=0, hi=2 ** 63 - 1), 1)
        elif self._pool_pages is not None:
            st.num_pages = max(self._pool_pages, hi or 1)
        elif hi is not None:
            st.num_pages = max(hi, 1)
        elif npmax == 0:
            st.num_pages = 1
        else:  # the largest page index in use on the device + 1 (synchronises; first plan only)
            t = T._torch()
            tbl = flat.reshape(B, stride)[:, :npmax]
            used = t.arange(npmax, device=tbl.device)[None, :] < t.from_numpy(pages).to(tbl.device)[:, None]
            st.num_pages = max(int(t.where(used, tbl, t.full_like(tbl, -1)).max().item()) + 1, 1)

    def _set_pool_shapes(self, st: PlanState) -> None:
        if st.kv_layout == "NHD":
            st.layout_shape_k = (st.page_size, st.num_kv_heads, st.head_dim_qk)
            st.layout_shape_v = (st.page_size, st.num_kv_heads, st.head_dim_vo)
        else:
            st.layout_shape_k = (st.num_kv_heads, st.page_size, st.head_dim_qk)
            st.layout_shape_v = (st.num_kv_heads, st.page_size, st.head_dim_vo)

    def _fill_common(self, st: PlanState, op: int, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
                     head_dim_vo: int, dtypes: Tuple[int, int, int], mask_mode: int, causal: bool,
                     window_left: Any, logits_soft_cap: Any, sm_scale: Any, pos_encoding_mode: Any,
                     rope_scale: Any, rope_theta: Any, fixed_split_tokens: int, disable_split_kv: bool,
                     variant: Any = None, variant_scalars: Any = None, variant_tensors: Any = None) -> None:
        st.op = op
        st.dev = self._dev
        st.graph = self._use_cuda_graph
        st.kv_layout = self._kv_layout
        st.q_dtype, st.kv_dtype, st.o_dtype = dtypes
        st.num_qo_heads = size_arg(num_qo_heads, "num_qo_heads")
        st.num_kv_heads = size_arg(num_kv_heads, "num_kv_heads")
        st.head_dim_qk = size_arg(head_dim_qk, "head_dim_qk")
        st.head_dim_vo = size_arg(head_dim_vo, "head_dim_vo")
        st.window_left = norm_window(window_left)
        st.logits_soft_cap = norm_cap(logits_soft_cap)
        st.sm_scale = f32(1.0 / math.sqrt(st.head_dim_qk) if sm_scale is None else float(sm_scale))
        st.pos_encoding = parse_pos_encoding(pos_encoding_mode)
        st.rope_scale = f32(1.0 if rope_scale is None else float(rope_scale))
        st.rope_theta = f32(1e4 if rope_theta is None else float(rope_theta))
        st.causal = bool(causal)
        st.mask_mode = mask_mode
        st.fixed_split_tokens = int(fixed_split_tokens)
        st.disable_split_kv = bool(disable_split_kv)
        if not math.isfinite(st.sm_scale) or st.sm_scale <= 0:
            raise ValueError("kvattn: sm_scale=%r must be a positive finite number" % (sm_scale,))
        st.variant = V.check_variant(variant)
        where = type(self).__name__ + ".plan"
        if st.variant is None:
            if variant_scalars is not None or variant_tensors is not None:
                raise InvalidArgumentError("kvattn: %s got variant_scalars / variant_tensors without variant=" % where)
        else:
            st.v_scalars = None if variant_scalars is None else V.check_scalars(st.variant, variant_scalars, where)
            st.v_tensors = None if variant_tensors is None else \
                V.check_tensors(st.variant, variant_tensors, self._dev, where)
        st.desc = make_desc(st.num_qo_heads, st.num_kv_heads, st.head_dim_qk, st.head_dim_vo, st.q_dtype,
                            st.kv_dtype, st.o_dtype, mask_mode, st.window_left, st.logits_soft_cap, st.sm_scale,
                            st.pos_encoding, st.rope_scale, st.rope_theta)
        # as given (FlashInfer's _sm_scale, _logits_soft_cap, ... attributes): engines compare them with their own
        st.user = dict(sm_scale=sm_scale, logits_soft_cap=0.0 if logits_soft_cap is None else logits_soft_cap,
                       window_left=-1 if window_left is None else window_left, causal=st.causal,
                       pos_encoding=st.pos_encoding, rope_scale=rope_scale, rope_theta=rope_theta)
        st.plan_user = dict(st.user)
        # the values given to plan(): what a deprecated forward() call uses for a parameter it leaves out
        st.planned = dict(window_left=st.window_left, logits_soft_cap=st.logits_soft_cap, sm_scale=st.sm_scale,
                          rope_scale=st.rope_scale, rope_theta=st.rope_theta, pos_encoding=st.pos_encoding,
                          causal=st.causal)

    # ---- deprecated forward(): per-call parameters ----
    def _forward_params(self, window_left: Any = None, logits_soft_cap: Any = None, sm_scale: Any = None,
                        rope_scale: Any = None, rope_theta: Any = None, pos_encoding_mode: Any = None,
                        causal: Any = None, use_fp16_qk_reduction: Any = None) -> None:
        """FlashInfer's deprecated forward() takes per-call parameters. kvattn honours them: when one differs
        from the current plan, the plan is remade with it (host work; not allowed during CUDA-graph capture)."""
        if use_fp16_qk_reduction:
            raise NotImplementedError("kvattn: use_fp16_qk_reduction=True is not supported (kvattn always "
                                      "accumulates QK in float32)")
        st = self._require_plan()
        # Each call's parameters are its own: one left out (None) is the value given to plan(), not the value an
        # earlier forward() call re-planned with (a forward(logits_soft_cap=c) does not cap the next forward()).
        base = st.planned
        want = dict(base)
        if window_left is not None:
            want["window_left"] = norm_window(window_left)
        if logits_soft_cap is not None:
            want["logits_soft_cap"] = norm_cap(logits_soft_cap)
        if sm_scale is not None:
            want["sm_scale"] = f32(sm_scale)
            if not math.isfinite(want["sm_scale"]) or want["sm_scale"] <= 0:  # as plan(): 0 would read as "default"
                raise ValueError("kvattn: sm_scale=%r must be a positive finite number" % (sm_scale,))
        if rope_scale is not None:
            want["rope_scale"] = f32(rope_scale)
        if rope_theta is not None:
            want["rope_theta"] = f32(rope_theta)
        if pos_encoding_mode is not None:
            want["pos_encoding"] = parse_pos_encoding(pos_encoding_mode)
        if causal is not None and st.mask_mode != F.KVA_MASK_CUSTOM:
            if bool(causal) != base["causal"] and st.op == F.KVA_OP_BATCH_DECODE:
                raise PlanMismatchError("kvattn: causal does not apply to batch decode")
            want["causal"] = bool(causal)
        new = {}
        for key, val in want.items():
            cur = getattr(st, key)
            if (f32(val) != f32(cur)) if isinstance(val, float) else (val != cur):
                new[key] = val
        user = dict(st.plan_user)
        for key, val in (("sm_scale", sm_scale), ("logits_soft_cap", logits_soft_cap), ("window_left", window_left),
                         ("rope_scale", rope_scale), ("rope_theta", rope_theta)):
            if val is not None:
                user[key] = val
        if pos_encoding_mode is not None:
            user["pos_encoding"] = want["pos_encoding"]
        if "causal" in want:
            user["causal"] = want["causal"]
        if not new:
            st.user = user
            return
        if C.is_capturing(st.dev):
            raise CaptureActiveError("kvattn: forward() with parameters %s that differ from the plan needs a new "
                                     "plan, which cannot happen during CUDA-graph capture; pass them to plan()"
                                     % sorted(new))
        # transactional: a re-plan that fails (checks in make_desc or the C plan) leaves the current plan as it was
        keys = list(new) + ["mask_mode", "desc", "plan", "ws", "ctx", "scratch_bytes", "commit"]
        saved = {key: getattr(st, key) for key in keys if hasattr(st, key)}
        region = self._ws.plan_region.ptr
        try:
            for key, val in new.items():
                setattr(st, key, val)
            if "causal" in new:
                st.mask_mode = F.KVA_MASK_CAUSAL if st.causal else F.KVA_MASK_NONE
            st.desc = make_desc(st.num_qo_heads, st.num_kv_heads, st.head_dim_qk, st.head_dim_vo, st.q_dtype,
                                st.kv_dtype, st.o_dtype, st.mask_mode, st.window_left, st.logits_soft_cap,
                                st.sm_scale, st.pos_encoding, st.rope_scale, st.rope_theta)
            commit_plan(st, self._ws, type(self).__name__ + ".forward (re-plan)")
        except BaseException:
            for key, val in saved.items():
                setattr(st, key, val)
            if self._ws.plan_region.ptr != region:  # the old plan's memory was replaced: it cannot run any more
                self._set_state(None)
            raise
        st.user = user
        self._set_state(st)
