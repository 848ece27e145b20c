"""Prefill / append attention with FlashInfer's names, arguments, defaults and semantics
(``flashinfer.prefill``)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _core
from . import _ffi as F
from . import _tensor as T
from ._core import BatchWrapperBase, PlanState, commit_plan, reject
from ._single import single_attention
from .decode import _query_size, _seq_lens_np, _setup_page_table
from .quantization import segment_packbits

__all__ = [
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
]


def single_prefill_with_kv_cache(q: Any, k: Any, v: Any, scale_q: Any = None, scale_k: Any = None,
                                 scale_v: Any = None, o_dtype: Any = None, custom_mask: Any = None,
                                 packed_custom_mask: Any = None, causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                                 sm_scale: Optional[float] = None, window_left: int = -1,
                                 logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
                                 rope_theta: Optional[float] = None, backend: str = "auto", return_lse: bool = False,
                                 kv_cache_sf: Any = None, k_scale: Optional[float] = None,
                                 v_scale: Optional[float] = None, *, variant: Any = None,
                                 variant_scalars: Any = None, variant_tensors: Any = None) -> Any:
    """Prefill attention for one request: ``q [qo_len, num_qo_heads, head_dim_qk]`` against
    ``k [kv_len, num_kv_heads, head_dim_qk]``, ``v [kv_len, num_kv_heads, head_dim_vo]`` (NHD; HND swaps the first
    two dims). Query row i sits at position ``kv_len - qo_len + i`` (causal mask bottom-right aligned).
    ``custom_mask`` (bool ``[qo_len, kv_len]``, True = visible) or ``packed_custom_mask`` (its
    ``packbits(..., bitorder="little")``) take precedence over ``causal``. Returns ``o [qo_len, num_qo_heads,
    head_dim_vo]`` (and base-2 ``lse [qo_len, num_qo_heads]``).

    kvattn extension: ``variant`` (a :class:`kvattn.Variant`) with its ``variant_scalars`` (floats) and
    ``variant_tensors`` (f32 arrays on q's device)."""
    _core.check_backend(backend)
    reject(scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, kv_cache_sf=kv_cache_sf)
    if use_fp16_qk_reduction:
        raise NotImplementedError("kvattn: use_fp16_qk_reduction=True is not supported (kvattn always accumulates "
                                  "QK in float32)")
    return single_attention(q, k, v, decode=False, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode,
                            q_scale=None, k_scale=k_scale, v_scale=v_scale, window_left=window_left,
                            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                            rope_theta=rope_theta, return_lse=return_lse, causal=causal, custom_mask=custom_mask,
                            packed_custom_mask=packed_custom_mask, o_dtype=o_dtype, variant=variant,
                            variant_scalars=variant_scalars, variant_tensors=variant_tensors)


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)


def _check_buf(dev: T.DeviceKey, name: str, b: Any, code: int) -> None:
    if b is None:
        return
    if T.device_of(b) != dev:
        raise ValueError("kvattn: %s is on %s but the workspace is on %s"
                         % (name, T.device_str(T.device_of(b)), T.device_str(dev)))
    if T.is_bool(b) or T.dtype_of(b, name) != code or b.ndim != 1 or not T.is_contiguous(b):
        raise TypeError("kvattn: %s must be a contiguous 1-D %s buffer" % (name, T.dtype_name(code)))


def _plan_kwargs(plan: Any, kwargs: Dict[str, Any], *names: str) -> Tuple[Any, ...]:
    """workspace_size(**kwargs): TypeError for a keyword plan() does not take (a typo is not ignored); the values of
    `names` (plan() arguments the size query passes on, so unsupported ones are refused as plan() refuses them)."""
    params = inspect.signature(plan).parameters
    for key in kwargs:
        if key not in params:
            raise TypeError("workspace_size() got an unexpected keyword argument %r" % key)
    return tuple(kwargs.get(n, 0 if n == "token_pos_in_items_len" else None) for n in names)


class _PrefillBase(BatchWrapperBase):
    def __init__(self, float_workspace_buffer: Any, kv_layout: str, use_cuda_graph: bool, backend: str,
                 jit_args: Any, jit_kwargs: Any, qo_indptr_buf: Any, custom_mask_buf: Any,
                 mask_indptr_buf: Any) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs)
        self._qo_indptr_buf = qo_indptr_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf
        self._fixed_batch_size: Optional[int] = None
        self._max_total_num_rows: Optional[int] = None
        _check_buf(self._dev, "qo_indptr_buf", qo_indptr_buf, F.KVA_DTYPE_I32)
        _check_buf(self._dev, "custom_mask_buf", custom_mask_buf, F.KVA_DTYPE_U8)
        _check_buf(self._dev, "mask_indptr_buf", mask_indptr_buf, F.KVA_DTYPE_I32)
        if use_cuda_graph:
            if qo_indptr_buf is None:
                raise ValueError("kvattn: use_cuda_graph=True needs qo_indptr_buf")
            self._fixed_batch_size = int(qo_indptr_buf.shape[0]) - 1

    def _setup_qo(self, st: PlanState, qo_indptr: Any, dry: bool) -> None:
        h_qo = T.host_int32_owned(qo_indptr, "qo_indptr")
        if h_qo.size != st.batch_size + 1:
            raise ValueError("kvattn: qo_indptr has %d elements but the KV indptr describes %d requests"
                             % (h_qo.size, st.batch_size))
        st.h_qo_indptr = h_qo
        st.total_rows = int(h_qo[-1])
        if self._use_cuda_graph and not dry:
            if st.batch_size != self._fixed_batch_size:
                raise ValueError("kvattn: the batch size is fixed to %d in CUDA-graph mode (len(qo_indptr_buf) - 1); "
                                 "plan() got %d requests" % (self._fixed_batch_size, st.batch_size))
            if self._max_total_num_rows is not None and st.total_rows > self._max_total_num_rows:
                raise ValueError("kvattn: CUDA-graph mode: this plan has %d query rows but the first plan had %d, "
                                 "which bounds every later plan" % (st.total_rows, self._max_total_num_rows))
            _core.copy_into(self._qo_indptr_buf, h_qo, "qo_indptr_buf")
        st.max_batch = self._fixed_batch_size if self._use_cuda_graph else st.batch_size
        # graph mode: the first plan that succeeds sets the row bound (_commit)
        st.max_rows = (self._max_total_num_rows or st.total_rows) if self._use_cuda_graph else st.total_rows

    def _commit(self, st: PlanState) -> None:
        """Write the plan and install it; in graph mode the first plan that succeeds bounds the later ones' rows."""
        self._set_state(None)
        commit_plan(st, self._ws, type(self).__name__ + ".plan")
        if self._use_cuda_graph and self._max_total_num_rows is None:
            self._max_total_num_rows = st.max_rows
        self._set_state(st)

    def _setup_mask(self, st: PlanState, kv_lens: np.ndarray, custom_mask: Any, packed_custom_mask: Any,
                    dry: bool) -> int:
        """Pack / place the custom mask; returns the mask mode."""
        if custom_mask is None and packed_custom_mask is None:
            return F.KVA_MASK_CAUSAL if st.causal else F.KVA_MASK_NONE
        qo_lens = np.diff(st.h_qo_indptr.astype(np.int64))
        bits = qo_lens * kv_lens.astype(np.int64)
        need_bytes = int(((bits + 7) // 8).sum())
        st.mask_bytes = need_bytes
        if dry:
            return F.KVA_MASK_CUSTOM
        if packed_custom_mask is not None:
            packed = packed_custom_mask
            if T.is_bool(packed) or T.dtype_of(packed, "packed_custom_mask") != F.KVA_DTYPE_U8 or packed.ndim != 1:
                raise TypeError("kvattn: packed_custom_mask must be a 1-D uint8 array of packed bits (a bool mask "
                                "goes to custom_mask)")
            if int(packed.shape[0]) < need_bytes:
                raise ValueError("kvattn: packed_custom_mask has %d bytes but the batch needs %d (one byte-aligned "
                                 "segment of ceil(qo_len * kv_len / 8) bytes per request, as "
                                 "segment_packbits(..., bitorder='little') makes)" % (int(packed.shape[0]), need_bytes))
        else:
            custom_mask = T.check_bool_mask(custom_mask, "custom_mask")
            total_bits = int(bits.sum())
            n = 1
            for s in custom_mask.shape:
                n *= int(s)
            if n != total_bits:
                raise ValueError("kvattn: custom_mask has %d elements but sum(qo_len * kv_len) = %d" % (n, total_bits))
            bit_indptr = np.zeros(bits.size + 1, dtype=np.int64)
            np.cumsum(bits, out=bit_indptr[1:])
            flat = custom_mask.reshape(-1)
            if T.is_torch(flat):
                bit_indptr = T._torch().from_numpy(bit_indptr).to(flat.device)
            packed, _ = segment_packbits(flat, bit_indptr, bitorder="little")
        if T.device_of(packed) != self._dev:
            if T.is_torch(packed) or self._dev[0] != "cpu":
                t = T._torch()
                packed = (packed if T.is_torch(packed) else t.from_numpy(np.ascontiguousarray(packed))).to(
                    "cpu" if self._dev[0] == "cpu" else "cuda:%d" % self._dev[1])
                if self._dev[0] == "cpu":
                    packed = packed.numpy()
        if not T.is_contiguous(packed):
            packed = packed.contiguous() if T.is_torch(packed) else np.ascontiguousarray(packed)
        if self._use_cuda_graph and self._custom_mask_buf is not None:
            _core.copy_into(self._custom_mask_buf, packed[:need_bytes], "custom_mask_buf")
            packed = self._custom_mask_buf
        if self._mask_indptr_buf is not None:
            byte_indptr = np.zeros(bits.size + 1, dtype=np.int32)
            np.cumsum((bits + 7) // 8, out=byte_indptr[1:])
            _core.copy_into(self._mask_indptr_buf, byte_indptr, "mask_indptr_buf")
        st.mask = packed
        st.mask_bytes = max(need_bytes, 0)
        return F.KVA_MASK_CUSTOM


class BatchPrefillWithPagedKVCacheWrapper(_PrefillBase):
    """Batch prefill / append attention of ragged queries against a paged KV cache (also used for speculative
    verification and as a cascade level). Query row i of request b sits at position ``kv_len_b - qo_len_b + i``."""

    _kind = "prefill_paged"

    def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Any = None, paged_kv_indptr_buf: Any = None, paged_kv_indices_buf: Any = None,
                 paged_kv_last_page_len_buf: Any = None, custom_mask_buf: Any = None, mask_indptr_buf: Any = None,
                 backend: str = "auto", jit_args: Any = None, jit_kwargs: Any = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs,
                         qo_indptr_buf, custom_mask_buf, mask_indptr_buf)
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        for name, b in (("paged_kv_indptr_buf", paged_kv_indptr_buf), ("paged_kv_indices_buf", paged_kv_indices_buf),
                        ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf)):
            if use_cuda_graph and b is None:
                raise ValueError("kvattn: use_cuda_graph=True needs %s" % name)
            _check_buf(self._dev, name, b, F.KVA_DTYPE_I32)

    def _build(self, qo_indptr: Any, paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any,
               num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo: Any,
               custom_mask: Any, packed_custom_mask: Any, causal: bool, pos_encoding_mode: Any,
               use_fp16_qk_reduction: bool, sm_scale: Any, window_left: Any, logits_soft_cap: Any, rope_scale: Any,
               rope_theta: Any, q_data_type: Any, kv_data_type: Any, o_data_type: Any, prefix_len_ptr: Any,
               token_pos_in_items_ptr: Any, token_pos_in_items_len: Any, max_item_len_ptr: Any, seq_lens: Any,
               seq_lens_q: Any, block_tables: Any, max_token_per_sequence: Any, max_sequence_kv: Any,
               fixed_split_size: Any, disable_split_kv: Any, num_pages: Any, dry: bool, variant: Any = None,
               variant_scalars: Any = None, variant_tensors: Any = None) -> PlanState:
        # seq_lens goes with block_tables (the block-table form of the page table, run natively)
        reject(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
               token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr,
               seq_lens=seq_lens if block_tables is None else None, seq_lens_q=seq_lens_q,
               max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv)
        if use_fp16_qk_reduction:
            raise NotImplementedError("kvattn: use_fp16_qk_reduction=True is not supported (kvattn always "
                                      "accumulates QK in float32)")
        dtypes = _core.resolve_dtypes(q_data_type, kv_data_type, o_data_type)
        st = PlanState()
        st.causal = bool(causal)
        _setup_page_table(self, st, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, num_pages,
                          block_tables, seq_lens, dry)
        self._setup_qo(st, qo_indptr, dry)
        kv_lens = st.h_seq_lens if st.bt_stride else _seq_lens_np(st.h_kv_indptr, st.h_last_page_len, st.page_size)
        mask_mode = self._setup_mask(st, kv_lens, custom_mask, packed_custom_mask, dry)
        dvo = head_dim_qk if head_dim_vo is None else head_dim_vo
        self._fill_common(st, F.KVA_OP_BATCH_PREFILL_PAGED, num_qo_heads, num_kv_heads, head_dim_qk, dvo, dtypes,
                          mask_mode, causal, window_left, logits_soft_cap, sm_scale, pos_encoding_mode, rope_scale,
                          rope_theta, _core.norm_split(fixed_split_size, st.page_size), bool(disable_split_kv),
                          variant, variant_scalars, variant_tensors)
        self._set_pool_shapes(st)
        return st

    def plan(self, qo_indptr: Any, paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo: Optional[int] = None,
             custom_mask: Any = None, packed_custom_mask: Any = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None,
             window_left: int = -1, logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, q_data_type: Any = "float16", kv_data_type: Any = None,
             o_data_type: Any = None, non_blocking: bool = True, prefix_len_ptr: Any = None,
             token_pos_in_items_ptr: Any = None, token_pos_in_items_len: int = 0, max_item_len_ptr: Any = None,
             seq_lens: Any = None, seq_lens_q: Any = None, block_tables: Any = None,
             max_token_per_sequence: Optional[int] = None, max_sequence_kv: Optional[int] = None,
             fixed_split_size: Optional[int] = None, disable_split_kv: bool = False, *,
             num_pages: Optional[int] = None, variant: Any = None, variant_scalars: Any = None,
             variant_tensors: Any = None) -> None:
        """Plan a batch (host work; reused by every layer's run()). Arguments follow FlashInfer;
        ``fixed_split_size`` is in pages. ``block_tables [B, max_blocks]`` with ``seq_lens [B]`` (KV tokens) give the
        page table in block-table form instead of the CSR arrays (which are then not read; see
        BatchDecodeWithPagedKVCacheWrapper.plan). kvattn extensions: ``num_pages`` (the pool's page count);
        ``variant`` (a :class:`kvattn.Variant`) with default ``variant_scalars`` / ``variant_tensors`` for every
        run."""
        st = self._build(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                         num_kv_heads, head_dim_qk, page_size, head_dim_vo, custom_mask, packed_custom_mask, causal,
                         pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
                         rope_theta, q_data_type, kv_data_type, o_data_type, prefix_len_ptr, token_pos_in_items_ptr,
                         token_pos_in_items_len, max_item_len_ptr, seq_lens, seq_lens_q, block_tables,
                         max_token_per_sequence, max_sequence_kv, fixed_split_size, disable_split_kv, num_pages,
                         dry=False, variant=variant, variant_scalars=variant_scalars, variant_tensors=variant_tensors)
        self._commit(st)

    begin_forward = plan

    def workspace_size(self, qo_indptr: Any, paged_kv_indptr: Any, paged_kv_indices: Any,
                       paged_kv_last_page_len: Any, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
                       page_size: int, head_dim_vo: Optional[int] = None, custom_mask: Any = None,
                       packed_custom_mask: Any = None, causal: bool = False, pos_encoding_mode: str = "NONE",
                       use_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None, window_left: int = -1,
                       logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
                       rope_theta: Optional[float] = None, q_data_type: Any = "float16", kv_data_type: Any = None,
                       o_data_type: Any = None, non_blocking: bool = True, fixed_split_size: Optional[int] = None,
                       disable_split_kv: bool = False, **kwargs: Any) -> Tuple[int, int]:
        """(float_workspace_bytes, int_workspace_bytes) a plan with these arguments needs (the float workspace
        buffer: split-KV partials; the wrapper's own plan memory: the plan)."""
        st = self._build(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                         num_kv_heads, head_dim_qk, page_size, head_dim_vo, custom_mask, packed_custom_mask, causal,
                         pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
                         rope_theta, q_data_type, kv_data_type, o_data_type, *_plan_kwargs(
                             type(self).plan, kwargs, "prefix_len_ptr", "token_pos_in_items_ptr",
                             "token_pos_in_items_len", "max_item_len_ptr", "seq_lens", "seq_lens_q", "block_tables",
                             "max_token_per_sequence", "max_sequence_kv"), fixed_split_size, disable_split_kv,
                         kwargs.get("num_pages"), dry=True, variant=kwargs.get("variant"))
        return _query_size(st)

    def run(self, q: Any, paged_kv_cache: Any, *args: Any, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, out: Any = None, lse: Any = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None, window_left: Optional[int] = None,
            sinks: Any = None, kv_cache_sf: Any = None, skip_softmax_threshold_scale_factor: Optional[float] = None,
            use_fp16_softmax: Optional[bool] = None, uses_spcompress: Optional[bool] = None,
            logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
            rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, pos_encoding_mode: Any = None,
            causal: Optional[bool] = None, variant_scalars: Any = None, variant_tensors: Any = None) -> Any:
        """``q [qo_indptr[-1], num_qo_heads, head_dim_qk]`` -> ``out [rows, num_qo_heads, head_dim_vo]`` (and base-2
        ``lse``). Capturable in a CUDA graph with ``out=`` given (``use_cuda_graph=True`` wrappers). kvattn
        extension: ``variant_scalars`` / ``variant_tensors`` (None = those given to plan())."""
        reject(sinks=sinks, kv_cache_sf=kv_cache_sf,
               skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
               use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress)
        return self._run_paged(q, paged_kv_cache, args, q_scale, k_scale, v_scale, out, lse, return_lse,
                               variant_scalars, variant_tensors, enable_pdl, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                               rope_theta=rope_theta, pos_encoding_mode=pos_encoding_mode, causal=causal)

    def run_return_lse(self, q: Any, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        kwargs["return_lse"] = True
        return self.run(q, paged_kv_cache, *args, **kwargs)

    def forward(self, q: Any, paged_kv_cache: Any, causal: Optional[bool] = None, pos_encoding_mode: Any = None,
                use_fp16_qk_reduction: Optional[bool] = None, k_scale: Optional[float] = None,
                v_scale: Optional[float] = None, window_left: Optional[int] = None,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
                return_lse: bool = False) -> Any:
        """Deprecated FlashInfer entry point with per-call parameters (None = as given to plan()); a parameter that
        differs from the plan makes a new plan with it."""
        self._forward_params(window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                             rope_scale=rope_scale, rope_theta=rope_theta, pos_encoding_mode=pos_encoding_mode,
                             causal=causal, use_fp16_qk_reduction=use_fp16_qk_reduction)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    def forward_return_lse(self, q: Any, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        kwargs["return_lse"] = True
        return self.forward(q, paged_kv_cache, *args, **kwargs)


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillBase):
    """Batch prefill attention of ragged queries against ragged (contiguous per request) K/V:
    ``k[kv_indptr[b]:kv_indptr[b+1]]`` belongs to request b."""

    _kind = "prefill_ragged"

    def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Any = None, kv_indptr_buf: Any = None, custom_mask_buf: Any = None,
                 mask_indptr_buf: Any = None, backend: str = "auto", jit_args: Any = None,
                 jit_kwargs: Any = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs,
                         qo_indptr_buf, custom_mask_buf, mask_indptr_buf)
        self._kv_indptr_buf = kv_indptr_buf
        if use_cuda_graph and kv_indptr_buf is None:
            raise ValueError("kvattn: use_cuda_graph=True needs kv_indptr_buf")
        _check_buf(self._dev, "kv_indptr_buf", kv_indptr_buf, F.KVA_DTYPE_I32)

    def _build(self, qo_indptr: Any, kv_indptr: Any, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
               head_dim_vo: Any, custom_mask: Any, packed_custom_mask: Any, causal: bool, pos_encoding_mode: Any,
               use_fp16_qk_reduction: bool, window_left: Any, logits_soft_cap: Any, sm_scale: Any, rope_scale: Any,
               rope_theta: Any, q_data_type: Any, kv_data_type: Any, o_data_type: Any, prefix_len_ptr: Any,
               token_pos_in_items_ptr: Any, token_pos_in_items_len: Any, max_item_len_ptr: Any,
               fixed_split_size: Any, disable_split_kv: Any, seq_lens: Any, seq_lens_q: Any,
               max_token_per_sequence: Any, max_sequence_kv: Any, v_indptr: Any, o_indptr: Any,
               dry: bool, variant: Any = None, variant_scalars: Any = None,
               variant_tensors: Any = None) -> PlanState:
        reject(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
               token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr, seq_lens=seq_lens,
               seq_lens_q=seq_lens_q, max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv)
        if use_fp16_qk_reduction:
            raise NotImplementedError("kvattn: use_fp16_qk_reduction=True is not supported (kvattn always "
                                      "accumulates QK in float32)")
        dtypes = _core.resolve_dtypes(q_data_type, kv_data_type, o_data_type)
        st = PlanState()
        st.causal = bool(causal)
        h_kv = T.host_int32_owned(kv_indptr, "kv_indptr")
        if h_kv.size < 1:
            raise ValueError("kvattn: kv_indptr must have batch_size + 1 >= 1 elements")
        for name, other in (("v_indptr", v_indptr), ("o_indptr", o_indptr)):
            if other is not None:
                ref = h_kv if name == "v_indptr" else T.host_int32(qo_indptr, "qo_indptr")
                h = T.host_int32(other, name)
                if h.shape != ref.shape or np.any(h != ref):
                    raise NotImplementedError("kvattn: %s different from %s is not supported" % (
                        name, "kv_indptr" if name == "v_indptr" else "qo_indptr"))
        st.h_kv_indptr = h_kv
        st.batch_size = h_kv.size - 1
        st.total_kv = int(h_kv[-1])
        st.page_size = 1
        self._setup_qo(st, qo_indptr, dry)
        if self._use_cuda_graph and not dry:
            _core.copy_into(self._kv_indptr_buf, h_kv, "kv_indptr_buf")
        kv_lens = np.diff(h_kv.astype(np.int64))
        mask_mode = self._setup_mask(st, kv_lens, custom_mask, packed_custom_mask, dry)
        dvo = head_dim_qk if head_dim_vo is None else head_dim_vo
        self._fill_common(st, F.KVA_OP_BATCH_PREFILL_RAGGED, num_qo_heads, num_kv_heads, head_dim_qk, dvo, dtypes,
                          mask_mode, causal, window_left, logits_soft_cap, sm_scale, pos_encoding_mode, rope_scale,
                          rope_theta, _core.norm_split(fixed_split_size, 1), bool(disable_split_kv), variant,
                          variant_scalars, variant_tensors)
        return st

    def plan(self, qo_indptr: Any, kv_indptr: Any, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             head_dim_vo: Optional[int] = None, custom_mask: Any = None, packed_custom_mask: Any = None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, o_data_type: Any = None, non_blocking: bool = True,
             prefix_len_ptr: Any = None, token_pos_in_items_ptr: Any = None, token_pos_in_items_len: int = 0,
             max_item_len_ptr: Any = None, fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
             seq_lens: Any = None, seq_lens_q: Any = None, max_token_per_sequence: Optional[int] = None,
             max_sequence_kv: Optional[int] = None, v_indptr: Any = None, o_indptr: Any = None, *,
             variant: Any = None, variant_scalars: Any = None, variant_tensors: Any = None) -> None:
        """Plan a batch (host work; reused by every layer's run()). ``fixed_split_size`` counts tokens here.
        kvattn extension: ``variant`` (a :class:`kvattn.Variant`) with default ``variant_scalars`` /
        ``variant_tensors`` for every run."""
        st = self._build(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, custom_mask,
                         packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left,
                         logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type,
                         prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr,
                         fixed_split_size, disable_split_kv, seq_lens, seq_lens_q, max_token_per_sequence,
                         max_sequence_kv, v_indptr, o_indptr, dry=False, variant=variant,
                         variant_scalars=variant_scalars, variant_tensors=variant_tensors)
        self._commit(st)

    begin_forward = plan

    def workspace_size(self, qo_indptr: Any, kv_indptr: Any, num_qo_heads: int, num_kv_heads: int,
                       head_dim_qk: int, head_dim_vo: Optional[int] = None, custom_mask: Any = None,
                       packed_custom_mask: Any = None, causal: bool = False, pos_encoding_mode: str = "NONE",
                       use_fp16_qk_reduction: bool = False, window_left: int = -1,
                       logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                       rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
                       q_data_type: Any = "float16", kv_data_type: Any = None, o_data_type: Any = None,
                       non_blocking: bool = True, fixed_split_size: Optional[int] = None,
                       disable_split_kv: bool = False, **kwargs: Any) -> Tuple[int, int]:
        """(float_workspace_bytes, int_workspace_bytes) a plan with these arguments needs (the float workspace
        buffer: split-KV partials; the wrapper's own plan memory: the plan)."""
        st = self._build(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, custom_mask,
                         packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left,
                         logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type,
                         *_plan_kwargs(type(self).plan, kwargs, "prefix_len_ptr", "token_pos_in_items_ptr",
                                       "token_pos_in_items_len", "max_item_len_ptr"),
                         fixed_split_size, disable_split_kv,
                         *_plan_kwargs(type(self).plan, kwargs, "seq_lens", "seq_lens_q", "max_token_per_sequence",
                                       "max_sequence_kv", "v_indptr", "o_indptr"),
                         dry=True, variant=kwargs.get("variant"))
        return _query_size(st)

    def run(self, q: Any, k: Any, v: Any, *args: Any, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, o_scale: Optional[float] = None,
            out: Any = None, lse: Any = None, return_lse: bool = False, enable_pdl: Optional[bool] = None,
            kv_cache_sf: Any = None, window_left: Optional[int] = None, logits_soft_cap: Optional[float] = None,
            sm_scale: Optional[float] = None, rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
            pos_encoding_mode: Any = None, causal: Optional[bool] = None, variant_scalars: Any = None,
            variant_tensors: Any = None) -> Any:
        """``q [qo_indptr[-1], Hq, Dqk]``, ``k [kv_indptr[-1], Hkv, Dqk]``, ``v [kv_indptr[-1], Hkv, Dvo]`` (NHD; HND
        swaps the first two dims of k and v) -> ``out [rows, Hq, Dvo]`` (and base-2 ``lse``). kvattn extension:
        ``variant_scalars`` / ``variant_tensors`` (None = those given to plan())."""
        reject(kv_cache_sf=kv_cache_sf)
        if o_scale is not None and float(o_scale) != 1.0:
            raise NotImplementedError("kvattn: o_scale (fp8 output scaling) is not supported")
        if args:
            raise NotImplementedError("kvattn: extra positional run() arguments (JIT variant parameters) are not "
                                      "supported")
        st = self._require_plan()
        compiling = _core._torch_ops.is_compiling()
        key = None if compiling or variant_scalars is not None or variant_tensors is not None else \
            _core.fast_key(q, (k, v), out, lse, return_lse)
        scalars = dict(window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                       rope_scale=rope_scale, rope_theta=rope_theta, pos_encoding_mode=pos_encoding_mode,
                       causal=causal)
        kv_in = (k, v)
        res = None if _core.any_given(scalars) else \
            _core.fast_run(self, st, key, kv_in, q, out, lse, q_scale, k_scale, v_scale, enable_pdl)
        if res is not None:
            return res if return_lse else res[0]
        if not compiling and not st.graph and T.is_torch(q) and _core.C.is_capturing(st.dev):
            raise _core.CaptureActiveError(
                "kvattn: %s.run is being captured into a CUDA graph but the wrapper was created with "
                "use_cuda_graph=False" % type(self).__name__)
        self._check_scalars(st, **scalars)
        if st.kv_layout == "HND":
            if k.ndim != 3 or v.ndim != 3:
                raise ValueError("kvattn: k and v must be 3-D [num_kv_heads, kv_len, head_dim] (HND)")
            k = k.transpose(0, 1) if T.is_torch(k) else k.transpose(1, 0, 2)
            v = v.transpose(0, 1) if T.is_torch(v) else v.transpose(1, 0, 2)
        if not compiling:
            rows = st.total_rows
            self._check_array(st, q, "q", st.q_dtype, (rows, st.num_qo_heads, st.head_dim_qk),
                              rows_at_least=rows if st.graph else None)
            kvr = st.total_kv
            self._check_array(st, k, "k", st.kv_dtype, (kvr, st.num_kv_heads, st.head_dim_qk),
                              rows_at_least=kvr if st.graph else None)
            self._check_array(st, v, "v", st.kv_dtype, (kvr, st.num_kv_heads, st.head_dim_vo),
                              rows_at_least=kvr if st.graph else None)
        ks, vs = _core.scales_for(q_scale, k_scale, v_scale)
        _core.check_variant_run(st, return_lse or lse is not None, type(self).__name__ + ".run")
        out_given, lse_given = out is not None, lse is not None
        out, lse = self._outputs(st, q, out, lse, return_lse, check=not compiling)
        args = _core.dispatch_run(self._handle, q, k, v, out, lse, ks, vs, variant_scalars, variant_tensors,
                                  enable_pdl)
        if key is not None:
            _core.fast_record(self._require_plan(), key, args, kv_in, k, v, False, out_given, lse_given, out,
                              lse)
        return (out, lse) if return_lse else out

    def run_return_lse(self, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        kwargs["return_lse"] = True
        return self.run(q, k, v, *args, **kwargs)

    def forward(self, q: Any, k: Any, v: Any, causal: Optional[bool] = None, pos_encoding_mode: Any = None,
                use_fp16_qk_reduction: Optional[bool] = None, window_left: Optional[int] = None,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
                return_lse: bool = False) -> Any:
        """Deprecated FlashInfer entry point with per-call parameters (None = as given to plan()); a parameter that
        differs from the plan makes a new plan with it."""
        self._forward_params(window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                             rope_scale=rope_scale, rope_theta=rope_theta, pos_encoding_mode=pos_encoding_mode,
                             causal=causal, use_fp16_qk_reduction=use_fp16_qk_reduction)
        return self.run(q, k, v, return_lse=return_lse)

    def forward_return_lse(self, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        kwargs["return_lse"] = True
        return self.forward(q, k, v, *args, **kwargs)

