"""Attention-state merging (``flashinfer.cascade``): states are ``(v [rows, heads, dim], s [rows, heads])`` with
``s`` the float32 base-2 log-sum-exp. Merging (v_a, s_a) with (v_b, s_b) gives
``s = log2(2^s_a + 2^s_b)`` and ``v = (2^s_a v_a + 2^s_b v_b) / 2^s``; two empty states (s = -inf) merge to
v = 0, s = -inf."""

from __future__ import annotations

import ctypes
from typing import Any, Tuple

import numpy as np

from . import _context as C
from . import _ffi as F
from . import _tensor as T
from . import _torch_ops

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


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


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> Tuple[Any, Any]:
    """Merge two attention states. Returns ``(v_merged, s_merged)`` (v in v_a's dtype, s float32)."""
    _check_state(v_a, s_a, "merge_state: a")
    _check_state(v_b, s_b, "merge_state: b")
    if tuple(v_a.shape) != tuple(v_b.shape):
        raise ValueError("kvattn: merge_state: v_a %s and v_b %s differ in shape" % (tuple(v_a.shape),
                                                                                      tuple(v_b.shape)))
    _same_device(v_a, s_a, v_b, s_b)
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
    _check_state(v, s, "merge_state_in_place")
    _check_state(v_other, s_other, "merge_state_in_place: other")
    if tuple(v.shape) != tuple(v_other.shape):
        raise ValueError("kvattn: merge_state_in_place: v %s and v_other %s differ in shape"
                         % (tuple(v.shape), tuple(v_other.shape)))
    _same_device(v, s, v_other, s_other, mask)
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
    ts = [T.make_tensor(x, name) for x, name in ((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b"),
                                                  (v_out, "v_out"), (s_out, "s_out"))]
    F.check(F.lib().kva_merge_state(C.get_context(dev), *[ctypes.byref(t) for t in ts], C.current_stream(dev)),
            "merge_state")


def _merge_state_in_place_impl(v: Any, s: Any, v_other: Any, s_other: Any, mask: Any) -> None:
    dev = T.device_of(v)
    ts = [T.make_tensor(x, name) for x, name in ((v, "v"), (s, "s"), (v_other, "v_other"), (s_other, "s_other"))]
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
    tvo, tso = T.make_tensor(v_out, "v_out"), T.make_tensor(s_out, "s_out")
    F.check(F.lib().kva_merge_states(C.get_context(dev), ctypes.byref(tv), ctypes.byref(tsv), indptr.ctypes.data, n,
                                     ctypes.byref(tvo), ctypes.byref(tso), C.current_stream(dev)), "merge_states")
