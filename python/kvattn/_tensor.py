"""Array adaptation: NumPy arrays and torch tensors -> pointers, shapes, element strides, dtypes, devices.

NumPy never imports torch; torch is only touched when a torch tensor is passed (then it is already imported).
Everything here except :func:`data_ptr` and the ``*_struct`` builders is safe to run under torch.compile
(it reads shapes, strides, dtypes and devices only).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _ffi as F

DeviceKey = Tuple[str, int]  # ("cpu", -1) or ("cuda", ordinal)
CPU: DeviceKey = ("cpu", -1)

try:  # optional: NumPy has no bfloat16 / fp8 of its own
    import ml_dtypes as _ml_dtypes  # type: ignore
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None

# ---- NumPy dtypes -------------------------------------------------------------------------------

_NP_TO_KVA = {
    np.dtype(np.float32): F.KVA_DTYPE_F32,
    np.dtype(np.float16): F.KVA_DTYPE_F16,
    np.dtype(np.int32): F.KVA_DTYPE_I32,
    np.dtype(np.uint8): F.KVA_DTYPE_U8,
    np.dtype(np.bool_): F.KVA_DTYPE_U8,
}
_KVA_TO_NP = {
    F.KVA_DTYPE_F32: np.dtype(np.float32),
    F.KVA_DTYPE_F16: np.dtype(np.float16),
    F.KVA_DTYPE_I32: np.dtype(np.int32),
    F.KVA_DTYPE_U8: np.dtype(np.uint8),
}
if _ml_dtypes is not None:  # pragma: no branch
    for _name, _code in (("bfloat16", F.KVA_DTYPE_BF16), ("float8_e4m3fn", F.KVA_DTYPE_E4M3),
                         ("float8_e5m2", F.KVA_DTYPE_E5M2)):
        _t = getattr(_ml_dtypes, _name, None)
        if _t is not None:
            _NP_TO_KVA[np.dtype(_t)] = _code
            _KVA_TO_NP[_code] = np.dtype(_t)

# ---- names accepted for dtype arguments (q_data_type="float16", ...) -----------------------------

_NAME_TO_KVA = {
    "float32": F.KVA_DTYPE_F32, "fp32": F.KVA_DTYPE_F32, "float": F.KVA_DTYPE_F32, "f32": F.KVA_DTYPE_F32,
    "float16": F.KVA_DTYPE_F16, "fp16": F.KVA_DTYPE_F16, "half": F.KVA_DTYPE_F16, "f16": F.KVA_DTYPE_F16,
    "bfloat16": F.KVA_DTYPE_BF16, "bf16": F.KVA_DTYPE_BF16,
    "float8_e4m3fn": F.KVA_DTYPE_E4M3, "e4m3": F.KVA_DTYPE_E4M3, "fp8_e4m3": F.KVA_DTYPE_E4M3,
    "float8_e5m2": F.KVA_DTYPE_E5M2, "e5m2": F.KVA_DTYPE_E5M2, "fp8_e5m2": F.KVA_DTYPE_E5M2,
}

FLOAT_DTYPES = (F.KVA_DTYPE_F32, F.KVA_DTYPE_F16, F.KVA_DTYPE_BF16)
FP8_DTYPES = (F.KVA_DTYPE_E4M3, F.KVA_DTYPE_E5M2)
KV_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def dtype_name(code: int) -> str:
    return F.KVA_DTYPE_NAMES.get(code, "dtype#%d" % code)


_TORCH_MOD = None


def _torch():
    """The torch module if it has been imported (kvattn never imports it itself). Cached so that code traced by
    torch.compile does not touch sys.modules."""
    global _TORCH_MOD
    if _TORCH_MOD is None:
        _TORCH_MOD = sys.modules.get("torch")
    return _TORCH_MOD


_TORCH_TENSOR = None


def is_torch(x: Any) -> bool:
    global _TORCH_TENSOR
    tt = _TORCH_TENSOR
    if tt is None:  # torch not seen yet (kvattn never imports it); cached once it is there
        t = _torch()
        if t is None:
            return False
        tt = _TORCH_TENSOR = t.Tensor
    return isinstance(x, tt)


def _torch_dtype_map():
    t = _torch()
    m = {
        t.float32: F.KVA_DTYPE_F32,
        t.float16: F.KVA_DTYPE_F16,
        t.bfloat16: F.KVA_DTYPE_BF16,
        t.int32: F.KVA_DTYPE_I32,
        t.uint8: F.KVA_DTYPE_U8,
        t.bool: F.KVA_DTYPE_U8,
    }
    for name, code in (("float8_e4m3fn", F.KVA_DTYPE_E4M3), ("float8_e5m2", F.KVA_DTYPE_E5M2)):
        d = getattr(t, name, None)
        if d is not None:
            m[d] = code
    return m


_TORCH_MAP = None


def torch_dtype_map():
    global _TORCH_MAP
    if _TORCH_MAP is None:
        _TORCH_MAP = _torch_dtype_map()
    return _TORCH_MAP


_TORCH_INV = None


def torch_dtype_of(code: int):
    global _TORCH_INV
    if _TORCH_INV is None:
        t = _torch()
        inv = {F.KVA_DTYPE_F32: t.float32, F.KVA_DTYPE_F16: t.float16, F.KVA_DTYPE_BF16: t.bfloat16,
               F.KVA_DTYPE_I32: t.int32, F.KVA_DTYPE_U8: t.uint8}
        for name, c in (("float8_e4m3fn", F.KVA_DTYPE_E4M3), ("float8_e5m2", F.KVA_DTYPE_E5M2)):
            if hasattr(t, name):
                inv[c] = getattr(t, name)
        _TORCH_INV = inv
    return _TORCH_INV[code]


def numpy_dtype_of(code: int) -> np.dtype:
    try:
        return _KVA_TO_NP[code]
    except KeyError:
        raise TypeError("kvattn: dtype %s has no NumPy equivalent here%s" % (
            dtype_name(code),
            " (install ml_dtypes for bfloat16 / float8)" if _ml_dtypes is None else "")) from None


def parse_dtype(spec: Any, what: str = "dtype") -> int:
    """kva dtype code of a dtype spec: a string ("float16", "bfloat16", ...), a torch.dtype, a NumPy dtype."""
    if isinstance(spec, str):
        s = spec.lower()
        if s.startswith("torch."):
            s = s[6:]
        if s in _NAME_TO_KVA:
            return _NAME_TO_KVA[s]
        raise TypeError("kvattn: %s=%r is not a supported dtype (float32, float16, bfloat16, float8_e4m3fn, "
                        "float8_e5m2)" % (what, spec))
    t = _torch()
    if t is not None and isinstance(spec, t.dtype):
        m = torch_dtype_map()
        if spec in m and m[spec] in KV_DTYPES:
            return m[spec]
        raise TypeError("kvattn: %s=%s is not a supported dtype" % (what, spec))
    try:
        nd = np.dtype(spec)
    except TypeError:
        raise TypeError("kvattn: %s=%r is not a dtype" % (what, spec)) from None
    if nd in _NP_TO_KVA and _NP_TO_KVA[nd] in KV_DTYPES:
        return _NP_TO_KVA[nd]
    raise TypeError("kvattn: %s=%s is not a supported dtype (float32, float16%s)" % (
        what, nd, ", bfloat16 via ml_dtypes" if _ml_dtypes is not None else "; install ml_dtypes for bfloat16"))


def dtype_of(x: Any, what: str = "tensor") -> int:
    """kva dtype code of an array's element type (TypeError if unsupported)."""
    if is_torch(x):
        m = torch_dtype_map()
        if x.dtype in m:
            return m[x.dtype]
        raise TypeError("kvattn: %s has dtype %s, which kvattn does not support" % (what, x.dtype))
    if isinstance(x, np.ndarray):
        if x.dtype in _NP_TO_KVA:
            return _NP_TO_KVA[x.dtype]
        hint = ""
        if x.dtype.name == "bfloat16" or "float8" in x.dtype.name:
            hint = " (this ml_dtypes type is not recognised)"
        raise TypeError("kvattn: %s has NumPy dtype %s, which kvattn does not support (float32, float16%s)%s" % (
            what, x.dtype, ", bfloat16" if _ml_dtypes is not None else "", hint))
    raise TypeError("kvattn: %s must be a NumPy array or a torch tensor, got %s" % (what, type(x).__name__))


def device_of(x: Any) -> DeviceKey:
    if is_torch(x):
        if x.is_cuda:  # no torch.device object on the common path
            return ("cuda", int(x.get_device()))
        d = x.device
        if d.type == "cpu":
            return CPU
        if d.type == "cuda":
            idx = d.index
            if idx is None:  # pragma: no cover - tensors always carry an index
                idx = _torch().cuda.current_device()
            return ("cuda", int(idx))
        raise ValueError("kvattn: tensors on device %s are not supported (cpu or cuda)" % d)
    if isinstance(x, np.ndarray):
        return CPU
    raise TypeError("kvattn: expected a NumPy array or a torch tensor, got %s" % type(x).__name__)


def sig(x: Any) -> Tuple[Any, ...]:
    """A torch tensor's signature for the prepared-call caches: what argument checks and kva_tensor descriptions read
    of it (shape, strides, dtype, device), but not its data pointer."""
    return (x.shape, x.stride(), x.dtype, x.get_device())


def sig_key(tag: Any, xs: Sequence[Any], cuda_only: bool = False) -> Optional[Tuple[Any, ...]]:
    """(tag, signatures of xs): the key of a prepared or checked call; None entries of xs stay None. None when an
    entry is not a torch tensor (or, with cuda_only, not a CUDA one): such calls take the checked path."""
    tt = _TORCH_TENSOR
    if tt is None:
        return None
    key = [tag]
    for x in xs:
        if x is None:
            key.append(None)
        elif isinstance(x, tt) and (x.is_cuda or not cuda_only):
            key.append(sig(x))
        else:
            return None
    return tuple(key)


def remember(memo: dict, cap: int, key: Any, value: Any) -> None:
    """memo[key] = value in a memo of at most cap entries (emptied when full: the keys of a serving loop recur)."""
    if len(memo) >= cap:
        memo.clear()
    memo[key] = value


def device_str(dev: DeviceKey) -> str:
    return "cpu" if dev[0] == "cpu" else "cuda:%d" % dev[1]


def shape_of(x: Any) -> Tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _c_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(st))


def strides_of(x: Any, what: str = "tensor") -> Tuple[int, ...]:
    """Element strides (ValueError on negative or fractional strides). An array with no elements gets the strides of
    a C-contiguous array of its shape (NumPy reports zeros for it; nothing is ever read through them)."""
    tt = _TORCH_TENSOR
    if tt is not None and isinstance(x, tt):
        shp = x.shape
        if 0 in shp:
            return _c_strides(shape_of(x))
        st = x.stride()  # a tuple of ints
        if not st or min(st) >= 0:
            return st
    elif any(int(n) == 0 for n in x.shape):
        return _c_strides(shape_of(x))
    else:
        isz = x.itemsize
        st = []
        for i, b in enumerate(x.strides):
            if b % isz:
                raise ValueError("kvattn: %s has a byte stride %d in dim %d that is not a multiple of its element "
                                 "size %d" % (what, b, i, isz))
            st.append(b // isz)
        st = tuple(st)
    for i, s in enumerate(st):
        if s < 0:
            raise ValueError("kvattn: %s has a negative stride %d in dim %d; pass a view with non-negative strides "
                             "(e.g. .copy() / .contiguous())" % (what, s, i))
    return st


def check_last_contiguous(x: Any, what: str, st: Optional[Tuple[int, ...]] = None) -> None:
    if x.ndim == 0:
        return
    if st is None:
        st = strides_of(x, what)
    if int(x.shape[-1]) > 1 and st[-1] != 1:
        raise ValueError("kvattn: %s must have a contiguous last dimension (element stride 1), got strides %s"
                         % (what, st))


def check_writable(x: Any, what: str, st: Optional[Tuple[int, ...]] = None) -> None:
    """ValueError unless kvattn may write x: a read-only NumPy array (flags.writeable False, e.g. a view of a bytes
    object) is never written, and an output whose dim of more than one element has stride 0 (a broadcast view) would
    put several results in one place."""
    if not is_torch(x) and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError("kvattn: %s is a read-only array (flags.writeable is False); pass a writable one" % what)
    if st is None:
        st = strides_of(x, what)
    for i, (n, s) in enumerate(zip(x.shape, st)):
        if int(n) > 1 and s == 0:
            raise ValueError("kvattn: %s has stride 0 in dim %d (a broadcast view): its %d entries would overlap; "
                             "pass an array with its own storage" % (what, i, int(n)))


def data_ptr(x: Any) -> int:
    if is_torch(x):
        return int(x.data_ptr())
    return int(x.__array_interface__["data"][0])


def nbytes_of(x: Any) -> int:
    if is_torch(x):
        return int(x.numel() * x.element_size())
    return int(x.nbytes)


def is_bool(x: Any) -> bool:
    """A NumPy or torch bool array (1 byte per element, so dtype_of maps it to uint8; packed bit masks refuse it)."""
    return str(getattr(x, "dtype", "")) in ("bool", "torch.bool")


def check_bool_mask(x: Any, what: str) -> Any:
    """An element mask (True = visible) as given, or as a NumPy array for a sequence: TypeError for a floating (or
    complex) array, which would be an additive mask (0 = visible, -inf = masked) that "nonzero = visible" inverts."""
    if not (is_torch(x) or isinstance(x, np.ndarray)):
        x = np.asarray(x)
    if is_torch(x):
        bad = x.dtype.is_floating_point or x.dtype.is_complex
    else:
        bad = x.dtype.kind not in "biu"
    if bad:
        raise TypeError("kvattn: %s must be a bool array (True = visible), got dtype %s; an additive float mask "
                        "(0 / -inf) is not accepted: pass (mask == 0)" % (what, x.dtype))
    return x


def is_contiguous(x: Any) -> bool:
    if is_torch(x):
        return bool(x.is_contiguous())
    return bool(x.flags["C_CONTIGUOUS"])


# ---- kva_tensor builders -------------------------------------------------------------------------

# kva_tensor descriptions of torch tensors already checked, by (shape, strides, dtype, requested dtype, out): a tensor
# of the same key gets a copy of the description and its own data pointer (the checks depend on nothing else)
_FILLED: dict = {}
_FILLED_MAX = 512
_KT_SIZE = ctypes.sizeof(F.kva_tensor)


def fill_tensor(t: "F.kva_tensor", x: Any, what: str, dtype: Optional[int] = None, out: bool = False) -> None:
    """Describe array x in kva_tensor t (x must have 1..4 dims, non-negative strides, unit last stride; an output
    (out=True) must also be writable without overlap: check_writable)."""
    tt = _TORCH_TENSOR
    key = None
    if tt is not None and isinstance(x, tt):
        key = (x.shape, x.stride(), x.dtype, dtype, out)
        tmpl = _FILLED.get(key)
        if tmpl is not None:
            ctypes.memmove(ctypes.addressof(t), tmpl, _KT_SIZE)
            t.data = x.data_ptr() or None
            return
    _fill_tensor_checked(t, x, what, dtype, out)
    if key is not None:
        tmpl = ctypes.create_string_buffer(_KT_SIZE)
        ctypes.memmove(tmpl, ctypes.addressof(t), _KT_SIZE)
        remember(_FILLED, _FILLED_MAX, key, tmpl)


def _fill_tensor_checked(t: "F.kva_tensor", x: Any, what: str, dtype: Optional[int], out: bool) -> None:
    nd = x.ndim
    if nd < 1 or nd > F.KVA_MAX_DIMS:
        raise ValueError("kvattn: %s has %d dims (1 to 4 supported)" % (what, nd))
    torch_x = is_torch(x)
    st = strides_of(x, what)
    if out:
        check_writable(x, what, st)
    shp = x.shape
    if int(shp[-1]) > 1 and st[-1] != 1:
        raise ValueError("kvattn: %s must have a contiguous last dimension (element stride 1), got strides %s"
                         % (what, st))
    if torch_x:  # one type test for the whole call
        t.data = x.data_ptr() or None
        if dtype is None:
            dtype = torch_dtype_map().get(x.dtype)  # None: dtype_of below raises with the message
    else:
        t.data = data_ptr(x) or None
    t.dtype = dtype_of(x, what) if dtype is None else dtype
    t.ndim = nd
    pad = (0,) * (F.KVA_MAX_DIMS - nd)
    t.shape[:] = tuple(shp) + pad
    t.stride[:] = tuple(st) + pad


def make_tensor(x: Any, what: str, dtype: Optional[int] = None, out: bool = False) -> "F.kva_tensor":
    t = F.kva_tensor()
    fill_tensor(t, x, what, dtype, out)
    return t


# ---- allocation -----------------------------------------------------------------------------------

def empty(like: Any, shape: Sequence[int], code: int) -> Any:
    """Uninitialised array of `shape` and kva dtype `code` on like's device/library."""
    if is_torch(like):
        t = _torch()
        return t.empty(tuple(shape), dtype=torch_dtype_of(code), device=like.device)
    return np.empty(tuple(shape), dtype=numpy_dtype_of(code))


def zeros(like: Any, shape: Sequence[int], code: int) -> Any:
    if is_torch(like):
        t = _torch()
        return t.zeros(tuple(shape), dtype=torch_dtype_of(code), device=like.device)
    return np.zeros(tuple(shape), dtype=numpy_dtype_of(code))


# ---- index arrays ---------------------------------------------------------------------------------

def host_int32(x: Any, what: str, ndim: int = 1) -> np.ndarray:
    """A host (NumPy) contiguous int32 copy-or-view of an index array (torch device tensors are copied to the
    host: this synchronises, as FlashInfer's plan does for device indptr arrays)."""
    if is_torch(x):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == _torch().bool:
            raise TypeError("kvattn: %s must be an integer tensor (int32), got %s" % (what, x.dtype))
        a = x.detach().cpu().numpy()
    else:
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            if a.size == 0:
                a = a.astype(np.int32)
            else:
                raise TypeError("kvattn: %s must be an integer array (int32), got %s" % (what, a.dtype))
    if a.ndim != ndim:
        raise ValueError("kvattn: %s must be %d-D, got shape %s" % (what, ndim, a.shape))
    if a.dtype != np.int32:
        if a.size and (a.min() < -(2 ** 31) or a.max() >= 2 ** 31):
            raise ValueError("kvattn: %s has values outside the int32 range" % what)
        a = a.astype(np.int32)
    return np.ascontiguousarray(a)


def host_int32_owned(x: Any, what: str, ndim: int = 1) -> np.ndarray:
    """host_int32 as a copy of its own: what a plan keeps to re-plan from later (a re-plan for a larger pool,
    forward() with new parameters) must be the plan-time values, not whatever the caller's buffer holds by then."""
    return host_int32(x, what, ndim).copy()


def pinned(x: Any) -> Any:
    """A private page-locked copy of a torch CPU tensor (or NumPy array), for host-to-device copies that do not wait
    for the stream: torch's caching host allocator keeps the block until the copy has run, and the caller may reuse
    its own array (even a page-locked one) as soon as plan() returns. A copy from pageable memory may make the driver
    wait for the stream's earlier work (CUDA's API sync behaviour), which would stall a plan() made while the previous
    step still runs."""
    t = _torch()
    if not is_torch(x):
        x = t.from_numpy(np.ascontiguousarray(x))
    try:
        out = t.empty(tuple(x.shape), dtype=x.dtype, pin_memory=True)
    except RuntimeError:  # pragma: no cover - no page-locked memory to be had: a pageable copy still works
        return x.clone()
    out.copy_(x)
    return out


def to_device(x: Any, dev: DeviceKey) -> Any:
    """A host array (NumPy or torch CPU) copied to CUDA device dev[1] on its current stream, without waiting for it."""
    return pinned(x).to("cuda:%d" % dev[1], non_blocking=True)


def backend_u8(a: np.ndarray, dev: DeviceKey) -> Any:
    """A host uint8 array in `dev` memory (CUDA: a device copy made on the current stream; plan time only)."""
    if dev[0] == "cpu":
        return a
    return to_device(a, dev)


def check_run_array(x: Any, dev: DeviceKey, what: str, dtype: int, shape: Tuple[int, ...], hint: str = "") -> None:
    """A run-time argument against its plan: array kind, device, dtype (hint: how to change it), exact shape, unit
    last stride."""
    from .exceptions import PlanMismatchError
    if not (is_torch(x) or isinstance(x, np.ndarray)):
        raise TypeError("kvattn: %s must be a NumPy array or a torch tensor, got %s" % (what, type(x).__name__))
    if device_of(x) != dev:
        raise ValueError("kvattn: %s is on %s but the wrapper's workspace is on %s"
                         % (what, device_str(device_of(x)), device_str(dev)))
    code = dtype_of(x, what)
    if code != dtype:
        raise PlanMismatchError("kvattn: %s has dtype %s but the plan expects %s%s"
                                % (what, dtype_name(code), dtype_name(dtype), " (%s)" % hint if hint else ""))
    if tuple(int(s) for s in x.shape) != shape:
        raise PlanMismatchError("kvattn: %s has shape %s but the plan expects %s"
                                % (what, tuple(int(s) for s in x.shape), shape))
    check_last_contiguous(x, what)


def backend_int64(x: Any, dev: DeviceKey, what: str) -> Any:
    """A contiguous int64 1-D array in `dev` memory holding x (no copy when x already is one)."""
    if is_torch(x):
        t = _torch()
        if x.ndim != 1:
            raise ValueError("kvattn: %s must be 1-D, got shape %s" % (what, tuple(x.shape)))
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == t.bool:
            raise TypeError("kvattn: %s must be an integer tensor (int64), got %s" % (what, x.dtype))
        if dev[0] == "cpu":
            return x.detach().to(device="cpu", dtype=t.int64).contiguous()
        if x.is_cuda and x.dtype == t.int64 and x.get_device() == dev[1] and x.is_contiguous():
            return x
        if not x.is_cuda:
            return to_device(x.to(dtype=t.int64), dev)
        return x.to(device="cuda:%d" % dev[1], dtype=t.int64, non_blocking=True).contiguous()
    a = np.asarray(x)
    if a.dtype.kind not in "iu" and a.size:
        raise TypeError("kvattn: %s must be an integer array (int64), got %s" % (what, a.dtype))
    if a.ndim != 1:
        raise ValueError("kvattn: %s must be 1-D, got shape %s" % (what, a.shape))
    if a.dtype == np.uint64 and a.size and int(a.max()) >= 2 ** 63:
        raise ValueError("kvattn: %s has values outside the int64 range" % what)
    a = np.ascontiguousarray(a, dtype=np.int64)
    return a if dev[0] == "cpu" else to_device(a, dev)


def backend_int32(x: Any, dev: DeviceKey, what: str) -> Any:
    """A contiguous int32 1-D array in `dev` memory holding x (no copy when x already is one)."""
    if dev[0] == "cpu":
        if is_torch(x) and x.device.type == "cpu" and x.dtype == _torch().int32 and x.is_contiguous() \
                and x.ndim == 1:
            return x
        return host_int32(x, what)
    t = _torch()
    if is_torch(x):
        if x.is_cuda and x.dtype == t.int32 and x.ndim == 1 and x.get_device() == dev[1] and x.is_contiguous():
            return x  # already one (the common case: no conversion, no device string to parse)
        if x.ndim != 1:
            raise ValueError("kvattn: %s must be 1-D, got shape %s" % (what, tuple(x.shape)))
        if x.dtype.is_floating_point or x.dtype == t.bool:
            raise TypeError("kvattn: %s must be an integer tensor (int32), got %s" % (what, x.dtype))
        if not x.is_cuda:  # a host tensor: converted on the host, copied from page-locked memory
            return to_device(x.to(dtype=t.int32), dev)
        y = x.to(device="cuda:%d" % dev[1], dtype=t.int32, non_blocking=True)
        return y.contiguous()
    return to_device(host_int32(x, what), dev)
