"""Decode attention with FlashInfer's names, arguments, defaults and semantics (``flashinfer.decode``)."""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _core
from . import _ffi as F
from . import _tensor as T
from ._core import BatchWrapperBase, PlanMismatchError, PlanState, commit_plan, reject
from ._single import single_attention

__all__ = [
    "fast_decode_plan",
    "single_decode_with_kv_cache",
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
]


def single_decode_with_kv_cache(q: Any, k: Any, v: Any, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                use_tensor_cores: bool = False, q_scale: Optional[float] = None,
                                k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                                window_left: int = -1, logits_soft_cap: Optional[float] = None,
                                sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                                rope_theta: Optional[float] = None, return_lse: bool = False, *,
                                variant: Any = None, variant_scalars: Any = None, variant_tensors: Any = None) -> Any:
    """Decode attention for one request: ``q [num_qo_heads, head_dim]`` against ``k, v [kv_len, num_kv_heads,
    head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND). Returns ``o [num_qo_heads, head_dim]``
    (and the base-2 ``lse [num_qo_heads]`` when ``return_lse``). The query sits at position ``kv_len - 1``.
    ``use_tensor_cores`` is accepted and has no effect (kvattn picks its kernel itself).

    kvattn extension: ``variant`` (a :class:`kvattn.Variant`) with its ``variant_scalars`` (floats) and
    ``variant_tensors`` (f32 arrays on q's device)."""
    return single_attention(q, k, v, decode=True, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode,
                            q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left,
                            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                            rope_theta=rope_theta, return_lse=return_lse, variant=variant,
                            variant_scalars=variant_scalars, variant_tensors=variant_tensors)


class BatchDecodeWithPagedKVCacheWrapper(BatchWrapperBase):
    """Batch decode on a paged KV cache (one query row per request, or ``q_len_per_req`` rows with a causal
    mask inside each request's block).

    ``float_workspace_buffer`` (uint8, NumPy array for the CPU backend or torch tensor for its device) is the
    memory plans are written into; if a plan needs more, plan() raises WorkspaceTooSmallError with the size.
    With ``use_cuda_graph=True`` the three buffers are required, the batch size is fixed to
    ``len(paged_kv_last_page_len_buffer)``, plan() copies the page table into them and run() reads them, so a
    captured run replays correctly after a new plan."""

    _kind = "decode"

    def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: Any = None,
                 paged_kv_indices_buffer: Any = None, paged_kv_last_page_len_buffer: Any = None,
                 backend: str = "auto", jit_args: Any = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        self._use_tensor_cores = bool(use_tensor_cores)
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._fixed_batch_size: Optional[int] = None
        if use_cuda_graph:
            bufs = (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                    ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                    ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer))
            for name, b in bufs:
                if b is None:
                    raise ValueError("kvattn: use_cuda_graph=True needs %s" % name)
                if T.device_of(b) != self._dev:
                    raise ValueError("kvattn: %s is on %s but the workspace is on %s" % (
                        name, T.device_str(T.device_of(b)), T.device_str(self._dev)))
                if T.dtype_of(b, name) != F.KVA_DTYPE_I32 or b.ndim != 1 or not T.is_contiguous(b):
                    raise TypeError("kvattn: %s must be a contiguous 1-D int32 buffer" % name)
            self._fixed_batch_size = int(paged_kv_last_page_len_buffer.shape[0])
            if int(paged_kv_indptr_buffer.shape[0]) < self._fixed_batch_size + 1:
                raise ValueError("kvattn: paged_kv_indptr_buffer must hold batch_size + 1 = %d elements"
                                 % (self._fixed_batch_size + 1))

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def _build(self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int, num_kv_heads: int,
               head_dim: int, page_size: int, pos_encoding_mode: Any, window_left: Any, window_right: Any,
               logits_soft_cap: Any, q_data_type: Any, kv_data_type: Any, o_data_type: Any, data_type: Any,
               sm_scale: Any, rope_scale: Any, rope_theta: Any, block_tables: Any, seq_lens: Any,
               fixed_split_size: Any, disable_split_kv: Any, q_len_per_req: Any, num_pages: Any,
               dry: bool, variant: Any = None, variant_scalars: Any = None,
               variant_tensors: Any = None) -> PlanState:
        if window_right not in (None, 0, -1):
            raise NotImplementedError("kvattn: window_right=%r is not supported by decode (keys after the query "
                                      "do not exist)" % (window_right,))
        dtypes = _core.resolve_dtypes(q_data_type, kv_data_type, o_data_type, data_type)
        qlen = 1 if q_len_per_req is None else int(q_len_per_req)
        if qlen < 1:
            raise ValueError("kvattn: q_len_per_req=%d must be >= 1" % qlen)
        st = PlanState()
        _setup_page_table(self, st, indptr, indices, last_page_len, page_size, num_pages, block_tables, seq_lens,
                          dry)
        B = st.batch_size
        if self._use_cuda_graph and B != self._fixed_batch_size:
            raise ValueError("kvattn: the batch size is fixed to %d in CUDA-graph mode (len(last_page_len_buffer)); "
                             "plan() got %d requests (pad with empty requests)" % (self._fixed_batch_size, B))
        if st.bt_stride:
            lens = st.h_seq_lens
        else:
            lens = _seq_lens_np(st.h_kv_indptr, st.h_last_page_len, st.page_size) \
                if seq_lens is not None or qlen > 1 else None
        if seq_lens is not None and not st.bt_stride:
            given = T.host_int32(seq_lens, "seq_lens")
            if given.shape != lens.shape or np.any(given != lens):
                raise ValueError("kvattn: seq_lens disagrees with indptr / last_page_len / page_size")
        if qlen > 1:
            # as FlashInfer: the verified tokens must already be in the cache, or a request's first rows would see no
            # key (empty requests, the padding of a CUDA-graph batch, stay allowed: they have no rows to compute)
            short = np.nonzero((lens > 0) & (lens < qlen))[0]
            if short.size:
                i = int(short[0])
                raise ValueError("kvattn: q_len_per_req=%d requires kv_len >= q_len_per_req for every non-empty "
                                 "request (append the verified tokens to the KV cache first), but request %d has "
                                 "kv_len=%d" % (qlen, i, int(lens[i])))
        if qlen == 1:
            op, mask = F.KVA_OP_BATCH_DECODE, F.KVA_MASK_NONE
        else:
            op, mask = F.KVA_OP_BATCH_PREFILL_PAGED, F.KVA_MASK_CAUSAL
            st.h_qo_indptr = np.arange(0, (B + 1) * qlen, qlen, dtype=np.int32)
        self._fill_common(st, op, num_qo_heads, num_kv_heads, head_dim, head_dim, dtypes, mask, qlen > 1,
                          window_left, logits_soft_cap, sm_scale, pos_encoding_mode, rope_scale, rope_theta,
                          _core.norm_split(fixed_split_size, st.page_size), bool(disable_split_kv), variant,
                          variant_scalars, variant_tensors)
        st.q_len_per_req = qlen
        st.total_rows = B * qlen
        st.max_batch = self._fixed_batch_size or B
        st.max_rows = st.max_batch * qlen
        self._set_pool_shapes(st)
        return st

    def plan(self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *deprecated_positional_args: Any, **kwargs: Any) -> None:
        """Plan a decode step (host work; reused by every layer's run()).

        Keyword arguments (FlashInfer's): ``pos_encoding_mode="NONE"``, ``window_left=-1``, ``window_right=0``,
        ``logits_soft_cap=None``, ``q_data_type="float16"``, ``kv_data_type=None``, ``o_data_type=None``,
        ``data_type=None``, ``sm_scale=None``, ``rope_scale=None``, ``rope_theta=None``, ``non_blocking=True``,
        ``block_tables=None``, ``seq_lens=None``, ``fixed_split_size=None``, ``disable_split_kv=False``,
        ``q_len_per_req=1``. As in FlashInfer, the optional arguments after ``page_size`` are also accepted
        positionally in that order (without ``window_right``), with a DeprecationWarning.

        ``indptr [B+1]``, ``last_page_len [B]`` are read on the host (device tensors are copied, which
        synchronises); ``indices`` may live on the host or the wrapper's device. ``fixed_split_size`` is in pages.
        ``block_tables [B, max_blocks]`` (int32, host or device) with ``seq_lens [B]`` (KV tokens, read on the host)
        give the page table in block-table form instead (vLLM's layout; indptr / indices / last_page_len are then
        not read and may be None): request b's pages are row b's first ceil(seq_lens[b] / page_size) entries, the
        rest are never read; the table is used in place (CUDA-graph wrappers copy it into the indices buffer).
        kvattn extensions (keyword only): ``num_pages``, the pool's page count (default: the pool seen by the
        previous run, else the largest index + 1); ``variant`` (a :class:`kvattn.Variant`, compiled for the
        wrapper's device on first use) with default ``variant_scalars`` / ``variant_tensors`` for every run (run()
        may pass others)."""
        if deprecated_positional_args:
            kwargs = _legacy_plan_kwargs(type(self).__name__, deprecated_positional_args, kwargs)
        self._plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs)

    def _plan(self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int, num_kv_heads: int,
              head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE", window_left: int = -1,
              window_right: int = 0, logits_soft_cap: Optional[float] = None,
              q_data_type: Any = _core.DEFAULT_Q_DATA_TYPE, kv_data_type: Any = None, o_data_type: Any = None,
              data_type: Any = None, sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
              rope_theta: Optional[float] = None, non_blocking: bool = True, block_tables: Any = None,
              seq_lens: Any = None, fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
              q_len_per_req: int = 1, num_pages: Optional[int] = None, variant: Any = None,
              variant_scalars: Any = None, variant_tensors: Any = None) -> None:
        st = self._build(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                         pos_encoding_mode, window_left, window_right, logits_soft_cap, q_data_type, kv_data_type,
                         o_data_type, data_type, sm_scale, rope_scale, rope_theta, block_tables, seq_lens,
                         fixed_split_size, disable_split_kv, q_len_per_req, num_pages, dry=False, variant=variant,
                         variant_scalars=variant_scalars, variant_tensors=variant_tensors)
        self._set_state(None)
        commit_plan(st, self._ws, type(self).__name__ + ".plan")
        self._set_state(st)

    begin_forward = plan

    def workspace_size(self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int, num_kv_heads: int,
                       head_dim: int, page_size: int, **kwargs: Any) -> Tuple[int, int]:
        """(float_workspace_bytes, int_workspace_bytes) a plan with these arguments needs: the float workspace
        buffer holds its split-KV partials, the wrapper's own plan memory (allocated by kvattn, as FlashInfer's int
        workspace) the plan."""
        kw = dict(pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None,
                  q_data_type=_core.DEFAULT_Q_DATA_TYPE, kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
                  rope_scale=None, rope_theta=None, block_tables=None, seq_lens=None, fixed_split_size=None,
                  disable_split_kv=False, q_len_per_req=1, num_pages=None, variant=None, variant_scalars=None,
                  variant_tensors=None)
        kwargs.pop("non_blocking", None)
        for key in kwargs:
            if key not in kw:
                raise TypeError("workspace_size() got an unexpected keyword argument %r" % key)
        kw.update(kwargs)
        st = self._build(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                         dry=True, **kw)
        return _query_size(st)

    def run(self, q: Any, paged_kv_cache: Any, *args: Any, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, out: Any = None, lse: Any = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None, window_left: Optional[int] = None,
            sinks: Any = None, q_len_per_req: Optional[int] = None,
            skip_softmax_threshold_scale_factor: Optional[float] = None, kv_cache_sf: Any = None,
            logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
            rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
            pos_encoding_mode: Any = None, variant_scalars: Any = None, variant_tensors: Any = None) -> Any:
        """Attention of ``q [B * q_len_per_req, num_qo_heads, head_dim]`` against the paged cache.

        Returns ``out [rows, num_qo_heads, head_dim]`` (and base-2 ``lse [rows, num_qo_heads]`` with
        ``return_lse``). With ``out=`` (and ``lse=``) given, nothing is allocated and nothing synchronises, so the
        call can be captured in a CUDA graph (``use_cuda_graph=True`` wrappers). Scalar arguments that disagree
        with the plan raise PlanMismatchError. ``enable_pdl`` (None = on): programmatic dependent launch on compute
        capability 9.0+ (the kernels may start while the previous kernel finishes; ignored elsewhere and under
        torch.compile, where it is on). kvattn extension:
        ``variant_scalars`` / ``variant_tensors`` for the plan's variant (None = those given to plan())."""
        reject(sinks=sinks, skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
               kv_cache_sf=kv_cache_sf)
        st = self._require_plan()
        if q_len_per_req is not None and int(q_len_per_req) != st.q_len_per_req:
            raise PlanMismatchError("kvattn: run got q_len_per_req=%d but the plan was made with q_len_per_req=%d"
                                    % (int(q_len_per_req), st.q_len_per_req))
        return self._run_paged(q, paged_kv_cache, args, q_scale, k_scale, v_scale, out, lse, return_lse,
                               variant_scalars, variant_tensors, enable_pdl, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                               rope_theta=rope_theta, pos_encoding_mode=pos_encoding_mode)

    def run_return_lse(self, q: Any, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        kwargs["return_lse"] = True
        return self.run(q, paged_kv_cache, *args, **kwargs)

    def forward(self, q: Any, paged_kv_cache: Any, pos_encoding_mode: Any = None, q_scale: Optional[float] = None,
                k_scale: Optional[float] = None, v_scale: Optional[float] = None, window_left: Optional[int] = None,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None) -> Any:
        """Deprecated FlashInfer entry point with per-call parameters (None = as given to plan()). A parameter that
        differs from the plan makes a new plan with it (FlashInfer silently ignored some of them)."""
        self._forward_params(window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                             rope_scale=rope_scale, rope_theta=rope_theta, pos_encoding_mode=pos_encoding_mode)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q: Any, paged_kv_cache: Any, pos_encoding_mode: Any = None,
                           q_scale: Optional[float] = None, k_scale: Optional[float] = None,
                           v_scale: Optional[float] = None, window_left: Optional[int] = None,
                           logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                           rope_scale: Optional[float] = None, rope_theta: Optional[float] = None) -> Tuple[Any, Any]:
        self._forward_params(window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                             rope_scale=rope_scale, rope_theta=rope_theta, pos_encoding_mode=pos_encoding_mode)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """BatchDecodeWithPagedKVCacheWrapper with ``use_cuda_graph=True`` and fixed buffers."""

    def __init__(self, workspace_buffer: Any, indptr_buffer: Any, indices_buffer: Any, last_page_len_buffer: Any,
                 kv_layout: str = "NHD", use_tensor_cores: bool = False) -> None:
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


def fast_decode_plan(self: BatchDecodeWithPagedKVCacheWrapper, indptr: Any, indices: Any, last_page_len: Any,
                     num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                     pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap: Optional[float] = None,
                     q_data_type: Any = None, kv_data_type: Any = None, data_type: Any = None,
                     sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                     rope_theta: Optional[float] = None, non_blocking: bool = True,
                     fixed_split_size: Optional[int] = None, disable_split_kv: bool = False, q_len_per_req: int = 1,
                     global_override_indptr_cpu: Any = None, *, variant: Any = None, variant_scalars: Any = None,
                     variant_tensors: Any = None) -> None:
    """FlashInfer's plan variant that engines monkey-patch onto the decode wrapper: the same plan, with the host
    indptr taken from ``global_override_indptr_cpu`` when given (so a device indptr is never copied back)."""
    if global_override_indptr_cpu is not None:
        indptr = global_override_indptr_cpu
    # the class's plan, not self.plan: engines install this function as the instance's plan
    BatchDecodeWithPagedKVCacheWrapper.plan(
        self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
        pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
        q_data_type=q_data_type, kv_data_type=kv_data_type, data_type=data_type, sm_scale=sm_scale,
        rope_scale=rope_scale, rope_theta=rope_theta, non_blocking=non_blocking, fixed_split_size=fixed_split_size,
        disable_split_kv=disable_split_kv, q_len_per_req=q_len_per_req, variant=variant,
        variant_scalars=variant_scalars, variant_tensors=variant_tensors)


# --------------------------------------------------------------------------------------------------

# FlashInfer's historical positional order of the decode plan() arguments after page_size (window_right, added
# later, is keyword-only there too)
_LEGACY_PLAN_POSITIONAL = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                           "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
                           "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req")


def _legacy_plan_kwargs(cls_name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """kwargs with the deprecated positional plan() arguments merged in (TypeError for too many, or for one also
    given by keyword); warns once per call site, as FlashInfer does."""
    if len(args) > len(_LEGACY_PLAN_POSITIONAL):
        raise TypeError("%s.plan() takes at most %d optional positional arguments after page_size (%d given)"
                        % (cls_name, len(_LEGACY_PLAN_POSITIONAL), len(args)))
    merged = dict(kwargs)
    for name, value in zip(_LEGACY_PLAN_POSITIONAL, args):
        if name in merged:
            raise TypeError("%s.plan() got multiple values for argument %r" % (cls_name, name))
        merged[name] = value
    warnings.warn("%s.plan(): passing the optional arguments after page_size positionally is deprecated (as in "
                  "FlashInfer); pass them by keyword" % cls_name, DeprecationWarning, stacklevel=3)
    return merged


def _seq_lens_np(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    pages = np.diff(indptr.astype(np.int64))
    lens = np.where(pages > 0, (pages - 1) * page_size + last_page_len.astype(np.int64), 0)
    return lens.astype(np.int32)


def _setup_page_table(w: BatchWrapperBase, st: PlanState, indptr: Any, indices: Any, last_page_len: Any,
                      page_size: int, num_pages: Any, block_tables: Any, seq_lens: Any, dry: bool) -> None:
    """The page table of a paged plan: the block-table form (block_tables with seq_lens; the CSR arrays are then not
    read) or the CSR form, for a plan (buffers and device arrays) or a size query (dry: host arrays only)."""
    if block_tables is not None:
        if seq_lens is None:
            raise ValueError("kvattn: block_tables needs seq_lens (the KV length of each request)")
        w._setup_block_table(st, block_tables, seq_lens, page_size, num_pages, w._paged_kv_indices_buf, dry=dry)
    elif dry:
        _setup_dry(w, st, indptr, indices, last_page_len, page_size, num_pages)
    else:
        w._setup_paged(st, indptr, indices, last_page_len, page_size, num_pages, w._paged_kv_indptr_buf,
                       w._paged_kv_indices_buf, w._paged_kv_last_page_len_buf)


def _setup_dry(w: BatchWrapperBase, st: PlanState, indptr: Any, indices: Any, last_page_len: Any, page_size: int,
               num_pages: Any) -> None:
    """The host half of _setup_paged (no buffer copies, no device transfers): for size queries."""
    st.h_kv_indptr = T.host_int32(indptr, "indptr")
    if st.h_kv_indptr.size < 1:
        raise ValueError("kvattn: indptr must have batch_size + 1 >= 1 elements")
    B = st.h_kv_indptr.size - 1
    h_lpl = T.host_int32(last_page_len, "last_page_len")
    if h_lpl.size < B:  # the C library reads B entries
        raise ValueError("kvattn: last_page_len has %d elements, the batch has %d requests" % (h_lpl.size, B))
    st.h_last_page_len = np.ascontiguousarray(h_lpl[:B])
    st.page_size = _core.size_arg(page_size, "page_size")
    st.batch_size = B
    st.h_indices = None
    st.num_pages = int(num_pages) if num_pages is not None else (w._pool_pages or 2 ** 31 - 1)


def _query_size(st: PlanState) -> Tuple[int, int]:
    """(float workspace bytes, plan bytes) of a plan: the float workspace holds its split-KV partials (plus the
    buffer's alignment slack), the wrapper's own plan memory (FlashInfer's int workspace) the plan."""
    from . import _context as C
    lib = F.lib()
    ctx = C.get_context(st.dev)
    params = st.params()
    st.desc.variant = st.variant.handle(st.dev) if st.variant is not None else None
    pb, sb, hb = ctypes.c_size_t(0), ctypes.c_size_t(0), ctypes.c_size_t(0)
    F.check(lib.kva_plan_workspace_parts(ctx, ctypes.byref(st.desc), st.op, ctypes.byref(params), ctypes.byref(pb),
                                         ctypes.byref(sb), ctypes.byref(hb)), "workspace_size")
    return int(sb.value) + F.KVA_WS_ALIGN, int(pb.value)
