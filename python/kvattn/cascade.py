"""Attention-state merging (``flashinfer.cascade``): states are ``(v [rows, heads, dim], s [rows, heads])`` with
``s`` the float32 base-2 log-sum-exp. Merging (v_a, s_a) with (v_b, s_b) gives
``s = log2(2^s_a + 2^s_b)`` and ``v = (2^s_a v_a + 2^s_b v_b) / 2^s``; two empty states (s = -inf) merge to
v = 0, s = -inf."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Tuple

import numpy as np

from . import _context as C
from . import _ffi as F
from . import _tensor as T
from . import _torch_ops
from .variant import refuse as refuse_variant

__all__ = ["merge_state", "merge_state_in_place", "merge_states", "MultiLevelCascadeAttentionWrapper"]


def _check_state(v: Any, s: Any, what: str, ndim_v: int = 3) -> None:
    for name, x in ((what + " v", v), (what + " s", s)):
        if not (T.is_torch(x) or isinstance(x, np.ndarray)):
            raise TypeError("kvattn: %s must be a NumPy array or a torch tensor, got %s" % (name, type(x).__name__))
    if v.ndim != ndim_v or s.ndim != ndim_v - 1 or tuple(v.shape[:-1]) != tuple(s.shape):
        raise ValueError("kvattn: %s: v must be %s and s %s, got %s and %s" % (
            what, "[rows, heads, dim]" if ndim_v == 3 else "[rows, num_states, heads, dim]",
            "[rows, heads]" if ndim_v == 3 else "[rows, num_states, heads]", tuple(v.shape), tuple(s.shape)))
    if T.dtype_of(s, what + " s") != F.KVA_DTYPE_F32:
        raise TypeError("kvattn: %s: s (the log-sum-exp) must be float32" % what)
    if T.dtype_of(v, what + " v") not in T.FLOAT_DTYPES:
        raise TypeError("kvattn: %s: v must be float32, float16 or bfloat16" % what)


def _same_device(*xs: Any) -> T.DeviceKey:
    dev = T.device_of(xs[0])
    for x in xs[1:]:
        if x is not None and T.device_of(x) != dev:
            raise ValueError("kvattn: all arguments must be on the same device (%s vs %s)"
                             % (T.device_str(dev), T.device_str(T.device_of(x))))
    return dev


# Signatures (shapes, strides, dtypes, devices of torch tensors) whose argument checks passed, per merge function:
# later calls with the same signatures skip them (the C library checks every call regardless)
_CHECKED: Dict[Any, bool] = {}
_CHECKED_MAX = 256


def _remember(key: Any) -> None:
    if key is not None:
        T.remember(_CHECKED, _CHECKED_MAX, key, True)


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> Tuple[Any, Any]:
    """Merge two attention states. Returns ``(v_merged, s_merged)`` (v in v_a's dtype, s float32)."""
    key = T.sig_key("merge_state", (v_a, s_a, v_b, s_b)) if not _torch_ops.is_compiling() else None
    if key is None or key not in _CHECKED:
        _check_state(v_a, s_a, "merge_state: a")
        _check_state(v_b, s_b, "merge_state: b")
        if tuple(v_a.shape) != tuple(v_b.shape):
            raise ValueError("kvattn: merge_state: v_a %s and v_b %s differ in shape" % (tuple(v_a.shape),
                                                                                          tuple(v_b.shape)))
        _same_device(v_a, s_a, v_b, s_b)
        _remember(key)
    v = T.empty(v_a, tuple(v_a.shape), T.dtype_of(v_a))
    s = T.empty(v_a, tuple(s_a.shape), F.KVA_DTYPE_F32)
    if T.is_torch(v_a) and _torch_ops.is_compiling():
        _torch_ops.ops().merge_state(v_a, s_a, v_b, s_b, v, s)
    else:
        if T.is_torch(v_a):
            _torch_ops.ensure_registered()
        _merge_state_impl(v_a, s_a, v_b, s_b, v, s)
    return v, s


def merge_state_in_place(v: Any, s: Any, v_other: Any, s_other: Any, mask: Any = None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` in place, only for rows whose ``mask`` (bool [rows],
    optional) is true."""
    key = T.sig_key("merge_state_in_place", (v, s, v_other, s_other)) \
        if mask is None and not _torch_ops.is_compiling() else None
    if key is None or key not in _CHECKED:
        _check_state(v, s, "merge_state_in_place")
        _check_state(v_other, s_other, "merge_state_in_place: other")
        if tuple(v.shape) != tuple(v_other.shape):
            raise ValueError("kvattn: merge_state_in_place: v %s and v_other %s differ in shape"
                             % (tuple(v.shape), tuple(v_other.shape)))
        _same_device(v, s, v_other, s_other, mask)
        _remember(key)
    if mask is not None:
        if mask.ndim != 1 or int(mask.shape[0]) != int(v.shape[0]) or T.dtype_of(mask, "mask") != F.KVA_DTYPE_U8:
            raise ValueError("kvattn: merge_state_in_place: mask must be a bool (or uint8) vector of %d rows"
                             % int(v.shape[0]))
        if not T.is_contiguous(mask):
            mask = mask.contiguous() if T.is_torch(mask) else np.ascontiguousarray(mask)
    if T.is_torch(v) and _torch_ops.is_compiling():
        _torch_ops.ops().merge_state_in_place(v, s, v_other, s_other, mask)
    else:
        if T.is_torch(v):
            _torch_ops.ensure_registered()
        _merge_state_in_place_impl(v, s, v_other, s_other, mask)


def merge_states(v: Any, s: Any) -> Tuple[Any, Any]:
    """Merge ``num_states`` states per row: ``v [rows, num_states, heads, dim]``, ``s [rows, num_states, heads]``
    -> ``(v [rows, heads, dim], s [rows, heads])``."""
    _check_state(v, s, "merge_states", ndim_v=4)
    _same_device(v, s)
    n, _, h, d = (int(x) for x in v.shape)
    vo = T.empty(v, (n, h, d), T.dtype_of(v))
    so = T.empty(v, (n, h), F.KVA_DTYPE_F32)
    if T.is_torch(v) and _torch_ops.is_compiling():
        _torch_ops.ops().merge_states(v, s, vo, so)
    else:
        if T.is_torch(v):
            _torch_ops.ensure_registered()
        _merge_states_impl(v, s, vo, so)
    return vo, so


# ---- bodies of the custom ops ---------------------------------------------------------------------

def _merge_state_impl(v_a: Any, s_a: Any, v_b: Any, s_b: Any, v_out: Any, s_out: Any) -> None:
    dev = T.device_of(v_a)
    ts = [T.make_tensor(x, name, out=name.endswith("_out")) for x, name in (
        (v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b"), (v_out, "v_out"), (s_out, "s_out"))]
    F.check(F.lib().kva_merge_state(C.get_context(dev), *[ctypes.byref(t) for t in ts], C.current_stream(dev)),
            "merge_state")


def _merge_state_in_place_impl(v: Any, s: Any, v_other: Any, s_other: Any, mask: Any) -> None:
    dev = T.device_of(v)
    ts = [T.make_tensor(x, name, out=name in ("v", "s")) for x, name in (
        (v, "v"), (s, "s"), (v_other, "v_other"), (s_other, "s_other"))]
    mp = (T.data_ptr(mask) or None) if mask is not None else None
    F.check(F.lib().kva_merge_state_in_place(C.get_context(dev), *[ctypes.byref(t) for t in ts], mp,
                                             C.current_stream(dev)), "merge_state_in_place")


def _merge_states_impl(v: Any, s: Any, v_out: Any, s_out: Any) -> None:
    dev = T.device_of(v)
    n, k, h, d = (int(x) for x in v.shape)
    vf = v.reshape(n * k, h, d)
    sf = s.reshape(n * k, h)
    indptr = np.arange(0, n * k + 1, k if k > 0 else 1, dtype=np.int32)
    if k == 0:
        indptr = np.zeros(n + 1, dtype=np.int32)
    tv, tsv = T.make_tensor(vf, "v"), T.make_tensor(sf, "s")
    tvo, tso = T.make_tensor(v_out, "v_out", out=True), T.make_tensor(s_out, "s_out", out=True)
    F.check(F.lib().kva_merge_states(C.get_context(dev), ctypes.byref(tv), ctypes.byref(tsv), indptr.ctypes.data, n,
                                     ctypes.byref(tvo), ctypes.byref(tso), C.current_stream(dev)), "merge_states")


class MultiLevelCascadeAttentionWrapper:
    """Cascade (shared-prefix) attention over one paged KV cache with ``num_levels`` levels, composed like
    FlashInfer: one paged-prefill plan per level (each level groups the queries differently through its own
    ``qo_indptr``; only the last level is causal), outputs combined with :func:`merge_state_in_place`.

    The levels share the float workspace buffer, as in FlashInfer: each level's plan lives in its wrapper's own plan
    memory, and the buffer only holds a run's split-KV partials while that run executes (the levels run one after
    the other on the stream). plan() raises WorkspaceTooSmallError with the size a level needs."""

    def __init__(self, num_levels: int, float_workspace_buffer: Any, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr: Any = None, paged_kv_indptr_buf_arr: Any = None,
                 paged_kv_indices_buf_arr: Any = None, paged_kv_last_page_len_buf_arr: Any = None) -> None:
        from .prefill import BatchPrefillWithPagedKVCacheWrapper

        num_levels = int(num_levels)
        if num_levels < 1:
            raise ValueError("kvattn: num_levels=%d must be >= 1" % num_levels)
        self._num_levels = num_levels
        self._kv_layout = kv_layout
        self._batch_prefill_wrappers = []
        for i in range(num_levels):
            kw = {}
            if use_cuda_graph:
                kw = dict(qo_indptr_buf=qo_indptr_buf_arr[i], paged_kv_indptr_buf=paged_kv_indptr_buf_arr[i],
                          paged_kv_indices_buf=paged_kv_indices_buf_arr[i],
                          paged_kv_last_page_len_buf=paged_kv_last_page_len_buf_arr[i])
            self._batch_prefill_wrappers.append(BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer, kv_layout, use_cuda_graph=use_cuda_graph, **kw))

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._batch_prefill_wrappers[0].is_cuda_graph_enabled

    def reset_workspace_buffer(self, float_workspace_buffer: Any, int_workspace_buffers: Any = None) -> None:
        for w in self._batch_prefill_wrappers:
            w.reset_workspace_buffer(float_workspace_buffer)

    def plan(self, qo_indptr_arr: Any, paged_kv_indptr_arr: Any, paged_kv_indices_arr: Any,
             paged_kv_last_page_len: Any, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Any = None, window_left: int = -1, logits_soft_cap: Any = None, rope_scale: Any = None,
             rope_theta: Any = None, q_data_type: Any = "float16", kv_data_type: Any = None, *,
             variant: Any = None) -> None:
        """Per-level arrays (lists of length num_levels): ``qo_indptr_arr[i]``, ``paged_kv_indptr_arr[i]``,
        ``paged_kv_indices_arr[i]``, ``paged_kv_last_page_len[i]``. ``variant`` is refused (UnsupportedError)."""
        refuse_variant(variant, "MultiLevelCascadeAttentionWrapper",
                       "the levels are merged through their lse, which an output transform or use_softmax=False "
                       "would break; as the C library's kva_cascade_*")
        for name, arr in (("qo_indptr_arr", qo_indptr_arr), ("paged_kv_indptr_arr", paged_kv_indptr_arr),
                          ("paged_kv_indices_arr", paged_kv_indices_arr),
                          ("paged_kv_last_page_len", paged_kv_last_page_len)):
            if len(arr) != self._num_levels:
                raise ValueError("kvattn: %s has %d levels, the wrapper %d" % (name, len(arr), self._num_levels))
        # every level covers every query row (their states are merged row by row)
        totals = []
        for i in range(self._num_levels):
            h = T.host_int32(qo_indptr_arr[i], "qo_indptr_arr[%d]" % i)
            if h.size < 1:
                raise ValueError("kvattn: qo_indptr_arr[%d] must have batch_size + 1 >= 1 elements" % i)
            totals.append(int(h[-1]))
        if any(t != totals[0] for t in totals):
            raise ValueError("kvattn: the levels cover different numbers of query rows (qo_indptr_arr[i][-1] = %s); "
                             "every level must cover all of them" % totals)
        for i, w in enumerate(self._batch_prefill_wrappers):
            w.plan(qo_indptr_arr[i], paged_kv_indptr_arr[i], paged_kv_indices_arr[i], paged_kv_last_page_len[i],
                   num_qo_heads, num_kv_heads, head_dim, page_size,
                   causal=causal if i == self._num_levels - 1 else False, pos_encoding_mode=pos_encoding_mode,
                   use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale, window_left=window_left,
                   logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                   q_data_type=q_data_type, kv_data_type=kv_data_type)

    begin_forward = plan

    def run(self, q: Any, paged_kv_cache: Any) -> Any:
        """``q [nnz, num_qo_heads, head_dim]`` -> ``out [nnz, num_qo_heads, head_dim]``."""
        out, lse = self._batch_prefill_wrappers[0].run(q, paged_kv_cache, return_lse=True)
        for w in self._batch_prefill_wrappers[1:]:
            o_i, s_i = w.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(out, lse, o_i, s_i)
        return out

    forward = run

    def end_forward(self) -> None:
        """Deprecated FlashInfer no-op."""
