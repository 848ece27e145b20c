"""Paged KV cache maintenance (``flashinfer.page``)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _context as C
from . import _core
from . import _ffi as F
from . import _tensor as T
from . import _torch_ops

__all__ = ["append_paged_kv_cache", "append_paged_kv_cache_by_slot", "get_batch_indices_positions", "get_seq_lens"]

_LAYOUT_CODE = {"NHD": F.KVA_LAYOUT_NHD, "HND": F.KVA_LAYOUT_HND}
_LAYOUT_NAME = {v: k for k, v in _LAYOUT_CODE.items()}


class _PreparedAppend:
    """The checked C arguments of an eager CUDA append, for later appends whose tensors have the same signatures
    (shapes, strides, dtypes, devices: T.sig) and whose index arrays were used as given (contiguous int32 on the
    cache's device): those set only the data pointers and the stream, without the checks and conversions."""

    __slots__ = ("dev", "p", "tk", "tv", "nnz", "batch", "koff", "voff", "busy")

    def __init__(self, dev: T.DeviceKey, p: Any, tk: Any, tv: Any, nnz: int, batch: int, koff: int,
                 voff: int) -> None:
        self.dev, self.p, self.tk, self.tv, self.nnz, self.batch, self.koff, self.voff = \
            dev, p, tk, tv, nnz, batch, koff, voff
        self.busy = threading.Lock()  # held until the C call returns (ctypes releases the GIL during it)

    def run(self, append_key: Any, append_value: Any, batch_indices: Any, positions: Any, cache: Any, v_cache: Any,
            kv_indices: Any, kv_indptr: Any, kv_last_page_len: Any) -> bool:
        if not self.busy.acquire(blocking=False):
            return False  # another thread is in the middle of this one: the caller takes the checked path
        try:
            p = self.p
            p.k_data = (cache.data_ptr() + self.koff) or None
            p.v_data = ((v_cache if v_cache is not None else cache).data_ptr() + self.voff) or None
            p.indices = kv_indices.data_ptr() or None
            p.indptr = kv_indptr.data_ptr() or None
            p.last_page_len = kv_last_page_len.data_ptr() or None
            self.tk.data = append_key.data_ptr() or None
            self.tv.data = append_value.data_ptr() or None
            F.check(F.lib().kva_append_paged_kv_cache(
                C.get_context(self.dev), ctypes.byref(self.tk), ctypes.byref(self.tv),
                batch_indices.data_ptr() or None, positions.data_ptr() or None, self.nnz, ctypes.byref(p),
                self.batch, C.current_stream(self.dev)), "append_paged_kv_cache")
            return True
        finally:
            self.busy.release()


_PREPARED: Dict[Any, _PreparedAppend] = {}
_PREPARED_MAX = 64


def append_paged_kv_cache(append_key: Any, append_value: Any, batch_indices: Any, positions: Any,
                          paged_kv_cache: Any, kv_indices: Any, kv_indptr: Any, kv_last_page_len: Any,
                          kv_layout: str = "NHD") -> None:
    """Scatter ``append_key/append_value [nnz, num_kv_heads, head_dim]`` into the paged cache: token i goes to
    request ``batch_indices[i]`` at position ``positions[i]``. The page table (``kv_indices``, ``kv_indptr``,
    ``kv_last_page_len``) must already include the new tokens. A token outside its request or the pool is not
    written and raises (PageIndexOutOfRangeError)."""
    layout = _core.parse_layout(kv_layout)
    if isinstance(paged_kv_cache, (tuple, list)):
        cache, v_cache = paged_kv_cache
    else:
        cache, v_cache = paged_kv_cache, None
    given = (append_key, append_value, batch_indices, positions, cache, v_cache, kv_indices, kv_indptr,
             kv_last_page_len)
    # all torch CUDA tensors (v_cache may be None), eager
    key = T.sig_key(layout, given, cuda_only=True) if not _torch_ops.is_compiling() else None
    if key is not None:
        prep = _PREPARED.get(key)
        if prep is not None and prep.run(*given):
            return
    if not (T.is_torch(cache) or isinstance(cache, np.ndarray)):
        raise TypeError("kvattn: paged_kv_cache must be an array or a (k_cache, v_cache) tuple, got %s"
                        % type(cache).__name__)
    dev = T.device_of(cache)  # (shapes and layout are checked with the views, in _append_impl)
    for name, x in (("append_key", append_key), ("append_value", append_value), ("v_cache", v_cache)):
        if x is not None and T.device_of(x) != dev:
            raise ValueError("kvattn: append_paged_kv_cache: %s is on %s, the cache on %s"
                             % (name, T.device_str(T.device_of(x)), T.device_str(dev)))
    if append_key.ndim != 3 or append_value.ndim != 3:
        raise ValueError("kvattn: append_key / append_value must be [nnz, num_kv_heads, head_dim]")
    ints = [T.backend_int32(x, dev, name) for x, name in ((batch_indices, "batch_indices"), (positions, "positions"),
                                                          (kv_indices, "kv_indices"), (kv_indptr, "kv_indptr"),
                                                          (kv_last_page_len, "kv_last_page_len"))]
    nnz = int(append_key.shape[0])
    if int(ints[0].shape[0]) < nnz or int(ints[1].shape[0]) < nnz:
        raise ValueError("kvattn: batch_indices and positions must have nnz = %d elements" % nnz)
    if int(ints[3].shape[0]) != int(ints[4].shape[0]) + 1:
        raise ValueError("kvattn: kv_indptr must have len(kv_last_page_len) + 1 elements")
    if T.is_torch(append_key):
        if _torch_ops.is_compiling():
            _torch_ops.ops().append_paged_kv_cache(append_key, append_value, ints[0], ints[1], cache, v_cache,
                                                   ints[2], ints[3], ints[4], _LAYOUT_CODE[layout])
            return
        _torch_ops.ensure_registered()
    prepared = _append_impl(append_key, append_value, ints[0], ints[1], cache, v_cache, ints[2], ints[3], ints[4],
                            _LAYOUT_CODE[layout])
    if key is not None and all(a is b for a, b in zip(ints, (batch_indices, positions, kv_indices, kv_indptr,
                                                              kv_last_page_len))):
        T.remember(_PREPARED, _PREPARED_MAX, key, prepared)


def _append_impl(append_key: Any, append_value: Any, batch_indices: Any, positions: Any, cache: Any,
                 v_cache: Any, kv_indices: Any, kv_indptr: Any, kv_last_page_len: Any,
                 layout: int) -> Optional[_PreparedAppend]:
    layout_name = _LAYOUT_NAME[int(layout)]
    if T.device_of(kv_indptr)[0] == "cpu" and int(kv_indptr.shape[0]) > 0:
        # the C library reads kv_indices[kv_indptr[b] ...] without knowing its length: host arrays are checked here
        # (device page tables cannot be read without a sync; here, in the custom op's body, the values are real
        # under torch.compile too)
        top = int(kv_indptr.max())
        if top > int(kv_indices.shape[0]):
            raise ValueError("kvattn: kv_indptr reaches %d but kv_indices has %d elements"
                             % (top, int(kv_indices.shape[0])))
    k, v = _core.split_paged_kv(cache if v_cache is None else (cache, v_cache), layout_name)
    T.check_writable(k, "k_cache")
    T.check_writable(v, "v_cache")
    dev = T.device_of(k)
    kd = T.dtype_of(k, "k_cache")
    if T.dtype_of(v, "v_cache") != kd:
        raise TypeError("kvattn: the K and V caches must have the same dtype")
    p = F.kva_paged_kv()
    _core.fill_paged(p, k, v, layout_name, kd, int(k.shape[0]), T.data_ptr(kv_indices), T.data_ptr(kv_indptr),
                     T.data_ptr(kv_last_page_len), int(kv_indices.shape[0]))
    tk = T.make_tensor(append_key, "append_key")
    tv = T.make_tensor(append_value, "append_value")
    nnz = int(append_key.shape[0])
    F.check(F.lib().kva_append_paged_kv_cache(C.get_context(dev), ctypes.byref(tk), ctypes.byref(tv),
                                              T.data_ptr(batch_indices) or None, T.data_ptr(positions) or None, nnz,
                                              ctypes.byref(p), int(kv_last_page_len.shape[0]),
                                              C.current_stream(dev)), "append_paged_kv_cache")
    if not T.is_torch(k):
        return None
    # what a later append with tensors of the same signatures needs (see _PreparedAppend)
    koff = k.data_ptr() - cache.data_ptr()
    voff = v.data_ptr() - (v_cache if v_cache is not None else cache).data_ptr()
    return _PreparedAppend(dev, p, tk, tv, nnz, int(kv_last_page_len.shape[0]), koff, voff)


def append_paged_kv_cache_by_slot(append_key: Any, append_value: Any, slot_mapping: Any, paged_kv_cache: Any,
                                  kv_layout: str = "NHD") -> None:
    """Scatter ``append_key/append_value [nnz, num_kv_heads, head_dim]`` into the paged cache by slot: token i goes
    to slot ``slot_mapping[i]`` of the pool, page ``slot // page_size`` at offset ``slot % page_size`` (the slot
    mapping of block-table engines; int64, any integer dtype is converted). A negative slot skips its token
    (padding). A slot past the pool is not written and raises (PageIndexOutOfRangeError; on CUDA the fault is
    recorded for ``kvattn.read_faults`` instead, as for the page-table form). Traced by torch.compile as the
    custom op ``kvattn::append_paged_kv_cache_by_slot``, which mutates the cache."""
    layout = _core.parse_layout(kv_layout)
    if isinstance(paged_kv_cache, (tuple, list)):
        cache, v_cache = paged_kv_cache
    else:
        cache, v_cache = paged_kv_cache, None
    if not (T.is_torch(cache) or isinstance(cache, np.ndarray)):
        raise TypeError("kvattn: paged_kv_cache must be an array or a (k_cache, v_cache) tuple, got %s"
                        % type(cache).__name__)
    dev = T.device_of(cache)
    for name, x in (("append_key", append_key), ("append_value", append_value), ("v_cache", v_cache)):
        if x is not None and T.device_of(x) != dev:
            raise ValueError("kvattn: append_paged_kv_cache_by_slot: %s is on %s, the cache on %s"
                             % (name, T.device_str(T.device_of(x)), T.device_str(dev)))
    if append_key.ndim != 3 or append_value.ndim != 3:
        raise ValueError("kvattn: append_key / append_value must be [nnz, num_kv_heads, head_dim]")
    slots = T.backend_int64(slot_mapping, dev, "slot_mapping")
    nnz = int(append_key.shape[0])
    if int(slots.shape[0]) < nnz:
        raise ValueError("kvattn: slot_mapping has %d elements, append_key %d rows" % (int(slots.shape[0]), nnz))
    if T.is_torch(append_key):
        if _torch_ops.is_compiling():
            _torch_ops.ops().append_paged_kv_cache_by_slot(append_key, append_value, slots, cache, v_cache,
                                                           _LAYOUT_CODE[layout])
            return
        _torch_ops.ensure_registered()
    _append_slot_impl(append_key, append_value, slots, cache, v_cache, _LAYOUT_CODE[layout])


def _append_slot_impl(append_key: Any, append_value: Any, slots: Any, cache: Any, v_cache: Any, layout: int) -> None:
    layout_name = _LAYOUT_NAME[int(layout)]
    k, v = _core.split_paged_kv(cache if v_cache is None else (cache, v_cache), layout_name)
    T.check_writable(k, "k_cache")
    T.check_writable(v, "v_cache")
    kd = T.dtype_of(k, "k_cache")
    if T.dtype_of(v, "v_cache") != kd:
        raise TypeError("kvattn: the K and V caches must have the same dtype")
    p = F.kva_paged_kv()
    _core.fill_paged(p, k, v, layout_name, kd, int(k.shape[0]), 0)
    tk = T.make_tensor(append_key, "append_key")
    tv = T.make_tensor(append_value, "append_value")
    dev = T.device_of(cache)
    F.check(F.lib().kva_append_paged_kv_cache_by_slot(C.get_context(dev), ctypes.byref(tk), ctypes.byref(tv),
                                                      T.data_ptr(slots) or None, int(append_key.shape[0]),
                                                      ctypes.byref(p), C.current_stream(dev)),
            "append_paged_kv_cache_by_slot")


def _check_batch_lens(indptr: Any, indptr_name: str, per_req: Any, per_req_name: str, exact: bool) -> None:
    """ValueError unless indptr is 1-D with B + 1 >= 1 entries and per_req 1-D with B entries (at least B unless
    exact); shapes only, no sync. A length-1 per_req would otherwise broadcast silently."""
    ni = tuple(int(d) for d in (indptr.shape if T.is_torch(indptr) else np.shape(indptr)))
    nr = tuple(int(d) for d in (per_req.shape if T.is_torch(per_req) else np.shape(per_req)))
    if len(ni) != 1 or ni[0] < 1 or len(nr) != 1 or (nr[0] != ni[0] - 1 if exact else nr[0] < ni[0] - 1):
        raise ValueError("kvattn: %s (shape %s) must be 1-D with batch_size + 1 elements and %s (shape %s) 1-D with "
                         "%sbatch_size elements" % (indptr_name, ni, per_req_name, nr, "" if exact else "at least "))


def get_batch_indices_positions(append_indptr: Any, seq_lens: Any, nnz: int, batch_indices: Any = None,
                                positions: Any = None) -> Tuple[Any, Any]:
    """For each appended token j (``append_indptr[b] <= j < append_indptr[b+1]``): its request b and absolute
    position ``seq_lens[b] - append_len[b] + (j - append_indptr[b])``. Returns int32 ``(batch_indices,
    positions)`` of length nnz (written into the given arrays when passed)."""
    nnz = int(nnz)
    _check_batch_lens(append_indptr, "append_indptr", seq_lens, "seq_lens", exact=False)
    if T.is_torch(append_indptr) or T.is_torch(seq_lens):
        torch = T._torch()
        ref = append_indptr if T.is_torch(append_indptr) else seq_lens
        dev = ref.device
        ip = torch.as_tensor(append_indptr, device=dev).to(torch.int64)
        sl = torch.as_tensor(seq_lens, device=dev).to(torch.int64)
        B = ip.numel() - 1
        j = torch.arange(nnz, device=dev, dtype=torch.int64)
        b = torch.searchsorted(ip[1:].contiguous(), j, right=True).clamp(max=max(B - 1, 0))
        if B > 0:
            pos = sl[b] - (ip[b + 1] - ip[b]) + (j - ip[b])
        else:
            pos = torch.zeros_like(j)
        bi32, pos32 = b.to(torch.int32), pos.to(torch.int32)
        if batch_indices is not None:
            batch_indices[:nnz].copy_(bi32)
            bi32 = batch_indices
        if positions is not None:
            positions[:nnz].copy_(pos32)
            pos32 = positions
        return bi32, pos32
    ip = np.asarray(append_indptr).astype(np.int64)
    sl = np.asarray(seq_lens).astype(np.int64)
    B = ip.size - 1
    j = np.arange(nnz, dtype=np.int64)
    b = np.minimum(np.searchsorted(ip[1:], j, side="right"), max(B - 1, 0))
    pos = sl[b] - (ip[b + 1] - ip[b]) + (j - ip[b]) if B > 0 else np.zeros_like(j)
    bi32, pos32 = b.astype(np.int32), pos.astype(np.int32)
    if batch_indices is not None:
        batch_indices[:nnz] = bi32
        bi32 = batch_indices
    if positions is not None:
        positions[:nnz] = pos32
        pos32 = positions
    return bi32, pos32


def get_seq_lens(kv_indptr: Any, kv_last_page_len: Any, page_size: int) -> Any:
    """KV length of each request: ``(num_pages - 1) * page_size + last_page_len``, 0 for a request without
    pages (int32; same library/device as the inputs). A length past INT32_MAX raises ValueError on host inputs
    (NumPy, CPU tensors); a CUDA tensor is not checked (that would synchronise)."""
    ps = _core.size_arg(page_size, "page_size")
    _check_batch_lens(kv_indptr, "kv_indptr", kv_last_page_len, "kv_last_page_len", exact=True)
    if T.is_torch(kv_indptr) or T.is_torch(kv_last_page_len):
        torch = T._torch()
        dev = (kv_indptr if T.is_torch(kv_indptr) else kv_last_page_len).device
        ip = torch.as_tensor(kv_indptr, device=dev).to(torch.int64)
        lpl = torch.as_tensor(kv_last_page_len, device=dev).to(torch.int64)
        pages = ip[1:] - ip[:-1]
        lens = torch.where(pages > 0, (pages - 1) * ps + lpl, torch.zeros_like(pages))
        if lens.device.type == "cpu":
            _check_int32_lens(lens)
        return lens.to(torch.int32)
    ip = np.asarray(kv_indptr).astype(np.int64)
    lpl = np.asarray(kv_last_page_len).astype(np.int64)
    pages = np.diff(ip)
    lens = np.where(pages > 0, (pages - 1) * ps + lpl, 0)
    _check_int32_lens(lens)
    return lens.astype(np.int32)


def _check_int32_lens(lens: Any) -> None:
    """get_seq_lens returns int32 (FlashInfer's dtype): a length past INT32_MAX is an error, not a wrapped value.
    Host lengths only (NumPy, CPU tensors: 1-D int64); on a CUDA tensor the check would synchronise."""
    if len(lens) and int(lens.max()) > 2147483647:
        at = int(lens.argmax())
        raise ValueError("kvattn: get_seq_lens: request %d has %d KV tokens, more than int32 holds" % (at, int(lens[at])))
