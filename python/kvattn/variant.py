"""User-defined attention variants (docs/variants.md): C source of up to five hooks, compiled by the C library
for the backend of each device the variant is used on (``kva_variant_create``), and the run-time parameters
(scalars and f32 tensors) a run passes to the hooks.

A :class:`Variant` holds one compiled C variant per device (the CPU backend's shared object; NVRTC kernels on a
CUDA device), created on first use or by :meth:`Variant.compile`, and destroys them on :meth:`Variant.close` or
when it is garbage collected, never after the context they belong to has been destroyed.
"""

from __future__ import annotations

import ctypes
import enum
import os
import re
import threading
import weakref
from typing import Any, Dict, Iterable, Optional, Tuple

import numpy as np

from . import _context as C
from . import _ffi as F
from . import _tensor as T
from .exceptions import InvalidArgumentError, UnsupportedError

__all__ = ["Variant", "VariantHook", "MAX_SCALARS", "MAX_TENSORS"]

MAX_SCALARS = 16  # KVA_VARIANT_MAX_SCALARS
MAX_TENSORS = 4  # KVA_VARIANT_MAX_TENSORS
MAX_NAME = 48  # KVA_VARIANT_MAX_NAME


class VariantHook(enum.IntFlag):
    """The hook flags of include/kvattn.h (``KVA_VARIANT_*``)."""

    QUERY_TRANSFORM = 1
    KEY_TRANSFORM = 2
    LOGITS_TRANSFORM = 4
    LOGITS_MASK = 8
    OUTPUT_TRANSFORM = 16


_ALL_HOOKS = 31
_HOOK_NAMES = {
    "query": VariantHook.QUERY_TRANSFORM,
    "key": VariantHook.KEY_TRANSFORM,
    "logits": VariantHook.LOGITS_TRANSFORM,
    "mask": VariantHook.LOGITS_MASK,
    "output": VariantHook.OUTPUT_TRANSFORM,
}
for _f in VariantHook:  # also the C flag names: "QUERY_TRANSFORM", "KVA_VARIANT_LOGITS_MASK", "logits_mask", ...
    _HOOK_NAMES[_f.name.lower()] = _f
    _HOOK_NAMES["kva_variant_" + _f.name.lower()] = _f


def parse_hooks(hooks: Any) -> int:
    """The OR of KVA_VARIANT_* flags from an int (or VariantHook), a name ("query", "key", "logits", "mask",
    "output", or a C flag name such as "KVA_VARIANT_LOGITS_TRANSFORM"; "a|b" allowed), or a sequence of those."""
    if hooks is None:
        return 0
    if isinstance(hooks, bool):
        raise TypeError("kvattn: Variant hooks must be flags or hook names, got %r" % (hooks,))
    if isinstance(hooks, (int, np.integer)):
        h = int(hooks)
        if h < 0 or h & ~_ALL_HOOKS:
            raise InvalidArgumentError("kvattn: Variant hooks = %#x has bits outside the KVA_VARIANT_* flags (%#x)"
                                       % (h, _ALL_HOOKS))
        return h
    if isinstance(hooks, str):
        out = 0
        for part in hooks.split("|"):
            key = part.strip().lower()
            if key not in _HOOK_NAMES:
                raise InvalidArgumentError(
                    "kvattn: unknown variant hook %r (query, key, logits, mask, output, or a KVA_VARIANT_* flag "
                    "name)" % part.strip())
            out |= int(_HOOK_NAMES[key])
        return out
    if isinstance(hooks, Iterable):
        out = 0
        for h in hooks:
            out |= parse_hooks(h)
        return out
    raise TypeError("kvattn: Variant hooks must be flags or hook names, got %s" % type(hooks).__name__)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_device(device: Any) -> T.DeviceKey:
    """A device key from "cpu", "cuda", "cuda:N", a torch.device, or an array / tensor (its device)."""
    if isinstance(device, np.ndarray) or T.is_torch(device):
        return T.device_of(device)
    if isinstance(device, str):
        s = device.strip().lower()
        if s == "cpu":
            return T.CPU
        m = re.fullmatch(r"cuda(?::(\d+))?", s)
        if m:
            if m.group(1) is not None:
                return ("cuda", int(m.group(1)))
            t = T._torch()
            if t is None:
                raise ValueError("kvattn: device 'cuda' without an index needs torch (to know the current device); "
                                 "pass 'cuda:N'")
            return ("cuda", int(t.cuda.current_device()))
        raise ValueError("kvattn: device %r is not supported ('cpu', 'cuda' or 'cuda:N')" % device)
    t = T._torch()
    if t is not None and isinstance(device, t.device):
        if device.type == "cpu":
            return T.CPU
        if device.type == "cuda":
            return ("cuda", int(device.index if device.index is not None else t.cuda.current_device()))
    raise ValueError("kvattn: device %r is not supported ('cpu', 'cuda', 'cuda:N', a torch.device or a tensor)"
                     % (device,))


def _release(live: Dict[T.DeviceKey, Tuple[object, int]]) -> None:
    """Destroy the C variants in `live` whose context is still alive (finalizer: no reference to the Variant)."""
    lib = F._lib
    items = list(live.items())
    live.clear()
    if lib is None:
        return
    for dev, (token, ptr) in items:
        if not C.context_alive(dev, token):
            continue  # the context is gone and has freed the variant with it
        try:
            lib.kva_variant_destroy(ptr)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class Variant:
    """A user-defined attention variant: C source of some of the five hooks (docs/variants.md).

    Args:
        source: the C source of the hooks (compiled after kvattn's prelude: ``KVA_HOOK``, ``kva_vparams``, ...).
        hooks: the hooks the source defines: ``VariantHook`` flags or their OR (an int), or names: ``"query"``,
            ``"key"``, ``"logits"``, ``"mask"``, ``"output"`` (also the C flag names, e.g.
            ``"KVA_VARIANT_LOGITS_TRANSFORM"``), a list of them or ``"logits|mask"``.
        use_softmax: True: softmax over the (transformed) logits; False: ``o = sum_j w_j v_j`` with ``w_j`` the
            transformed logit (no lse).
        num_scalars: how many floats a run passes (``variant_scalars``; ``p->s[i]`` in the hooks), 0..16.
        num_tensors: how many f32 arrays a run passes (``variant_tensors``; ``p->t[i]``), 0..4.
        name: a C identifier of at most 48 characters (logs, kernel names); default ``"user_variant"``.
        device: compile now for this device (``"cpu"``, ``"cuda:N"``, a torch.device or a tensor), so that a
            source that does not compile raises here; otherwise each device compiles on first use.

    The variant is compiled once per device, on the kvattn context of that device (the CPU backend with its C
    compiler, ``$KVA_CC`` / ``cc`` / ``gcc`` / ``clang``; a CUDA device with NVRTC), and cached on disk by the C
    library. :class:`~kvattn.JitError` carries the compiler's log; :class:`~kvattn.UnsupportedError` says that the
    backend cannot compile (no C compiler, no NVRTC). :meth:`close` (or ``with Variant(...) as v:``) destroys the
    compiled variants; plans made with it then refuse to run (``PlanMismatchError``).
    """

    def __init__(self, source: str, hooks: Any, use_softmax: bool = True, num_scalars: int = 0,
                 num_tensors: int = 0, name: Optional[str] = None, device: Any = None) -> None:
        if isinstance(source, bytes):
            try:
                source = source.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidArgumentError("kvattn: Variant source (bytes) is not UTF-8: %s" % e) from None
        if not isinstance(source, str):
            raise TypeError("kvattn: Variant source must be a str of C code, got %s" % type(source).__name__)
        try:
            source.encode("utf-8")
        except UnicodeEncodeError as e:  # e.g. a lone surrogate
            raise InvalidArgumentError("kvattn: Variant source cannot be encoded as UTF-8: %s" % e) from None
        if not source.strip():
            raise InvalidArgumentError("kvattn: Variant source is empty")
        if "\0" in source:
            raise InvalidArgumentError("kvattn: Variant source contains a NUL character")
        name = "user_variant" if name is None else str(name)
        if not _IDENT.match(name) or len(name) > MAX_NAME:
            raise InvalidArgumentError("kvattn: Variant name %r must be a C identifier of 1..%d characters"
                                       % (name, MAX_NAME))
        ns, nt = int(num_scalars), int(num_tensors)
        if not 0 <= ns <= MAX_SCALARS:
            raise InvalidArgumentError("kvattn: num_scalars=%d must be in [0, %d]" % (ns, MAX_SCALARS))
        if not 0 <= nt <= MAX_TENSORS:
            raise InvalidArgumentError("kvattn: num_tensors=%d must be in [0, %d]" % (nt, MAX_TENSORS))
        self._source = source
        self._hooks = VariantHook(parse_hooks(hooks))
        self._use_softmax = bool(use_softmax)
        self._num_scalars = ns
        self._num_tensors = nt
        self._name = name
        self._lock = threading.Lock()
        self._closed = False
        # device -> (context token, kva_variant* as int); shared with the finalizer, which must not hold self
        self._live: Dict[T.DeviceKey, Tuple[object, int]] = {}
        self._finalizer = weakref.finalize(self, _release, self._live)
        if device is not None:
            self.compile(device)

    @classmethod
    def from_file(cls, path: Any, hooks: Any, **kwargs: Any) -> "Variant":
        """A variant whose source is the file at `path` (e.g. examples/variants/flash_sigmoid.c); the name
        defaults to the file's stem."""
        with open(os.fspath(path), "r", encoding="utf-8") as f:
            source = f.read()
        if kwargs.get("name") is None:
            stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
            kwargs["name"] = stem if _IDENT.match(stem) and len(stem) <= MAX_NAME else None
        return cls(source, hooks, **kwargs)

    # ---- properties ----
    @property
    def name(self) -> str:
        return self._name

    @property
    def source(self) -> str:
        return self._source

    @property
    def hooks(self) -> VariantHook:
        return self._hooks

    @property
    def use_softmax(self) -> bool:
        return self._use_softmax

    @property
    def num_scalars(self) -> int:
        return self._num_scalars

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def devices(self) -> Tuple[str, ...]:
        """The devices the variant is compiled for (and whose contexts are alive)."""
        return tuple(T.device_str(d) for d, (tok, _) in list(self._live.items()) if C.context_alive(d, tok))

    def __repr__(self) -> str:
        hooks = "|".join(f.name for f in VariantHook if f & self._hooks) or "0"
        return "Variant(name=%r, hooks=%s, use_softmax=%s, num_scalars=%d, num_tensors=%d%s)" % (
            self._name, hooks, self._use_softmax, self._num_scalars, self._num_tensors,
            ", closed" if self._closed else "")

    # ---- compilation and lifetime ----
    def compile(self, device: Any = "cpu") -> "Variant":
        """Compile for `device` now (a no-op when already compiled there). Returns self."""
        self.handle(parse_device(device))
        return self

    def handle(self, dev: T.DeviceKey) -> int:
        """The kva_variant* (as an int) for a device key, compiled on first use."""
        if self._closed:
            raise InvalidArgumentError("kvattn: variant %r is closed (Variant.close() was called); create a new "
                                       "Variant" % self._name)
        entry = self._live.get(dev)
        if entry is not None and C.context_alive(dev, entry[0]):
            return entry[1]
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("kvattn: variant %r is closed" % self._name)
            entry = self._live.get(dev)
            if entry is not None and C.context_alive(dev, entry[0]):
                return entry[1]
            ctx = C.get_context(dev)
            token = C.context_token(dev)
            lib = F.lib()
            spec = F.kva_variant_spec()
            lib.kva_variant_spec_init(ctypes.byref(spec))
            name_b = self._name.encode("ascii")
            source_b = self._source.encode("utf-8")
            spec.name = name_b
            spec.source = source_b
            spec.hooks = int(self._hooks)
            spec.use_softmax = 1 if self._use_softmax else 0
            spec.num_scalar_params = self._num_scalars
            spec.num_tensor_params = self._num_tensors
            out = ctypes.c_void_p()
            F.check(lib.kva_variant_create(ctx, ctypes.byref(spec), ctypes.byref(out)),
                    "kva_variant_create(%s, %s)" % (self._name, T.device_str(dev)))
            self._live[dev] = (token, int(out.value))
            return int(out.value)

    def close(self) -> None:
        """Destroy the compiled variants (idempotent). Plans made with this variant refuse to run afterwards; do
        not close a variant while a run that uses it is in flight on another thread."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> "Variant":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Run-time parameters

class RunParams:
    """The variant fields of one kva_run_args: ctypes arrays plus references to the tensors they point into (kept
    alive while the object lives)."""

    __slots__ = ("scalars", "num_scalars", "tensor_ptrs", "num_tensors", "keep")

    def __init__(self) -> None:
        self.scalars: Any = None
        self.num_scalars = 0
        self.tensor_ptrs: Any = None
        self.num_tensors = 0
        self.keep: Tuple[Any, ...] = ()

    def apply(self, args: "F.kva_run_args") -> None:
        args.variant_scalars = ctypes.cast(self.scalars, ctypes.c_void_p).value if self.num_scalars else None
        args.num_variant_scalars = self.num_scalars
        args.variant_tensors = ctypes.cast(self.tensor_ptrs, ctypes.c_void_p).value if self.num_tensors else None
        args.num_variant_tensors = self.num_tensors


def check_scalars(variant: Variant, scalars: Any, where: str) -> Tuple[float, ...]:
    """A tuple of exactly variant.num_scalars floats (host values)."""
    if scalars is None:
        vals: Tuple[float, ...] = ()
    else:
        if T.is_torch(scalars) and scalars.device.type != "cpu":
            raise TypeError("kvattn: %s: variant_scalars must be host floats (reading a %s tensor would "
                            "synchronise); pass a list of floats, or use a variant tensor for values that live on "
                            "the device" % (where, scalars.device))
        if isinstance(scalars, (int, float, np.number)) or isinstance(scalars, (str, bytes)):
            raise TypeError("kvattn: %s: variant_scalars must be a sequence of floats, got %r" % (where, scalars))
        try:
            vals = tuple(float(x) for x in (scalars.reshape(-1).tolist() if hasattr(scalars, "reshape")
                                            else scalars))
        except (TypeError, ValueError) as e:
            raise TypeError("kvattn: %s: variant_scalars must be a sequence of floats (%s)" % (where, e)) from None
    if len(vals) != variant.num_scalars:
        raise InvalidArgumentError("kvattn: %s: variant %r takes %d scalar parameter%s (variant_scalars), got %d"
                                   % (where, variant.name, variant.num_scalars,
                                      "" if variant.num_scalars == 1 else "s", len(vals)))
    return vals


def check_tensors(variant: Variant, tensors: Any, dev: T.DeviceKey, where: str) -> Tuple[Any, ...]:
    """A tuple of exactly variant.num_tensors contiguous f32 arrays on `dev`."""
    if tensors is None:
        ts: Tuple[Any, ...] = ()
    elif isinstance(tensors, np.ndarray) or T.is_torch(tensors):
        raise TypeError("kvattn: %s: variant_tensors must be a sequence of arrays (e.g. [sink]), got one %s"
                        % (where, type(tensors).__name__))
    else:
        ts = tuple(tensors)
    if len(ts) != variant.num_tensors:
        raise InvalidArgumentError("kvattn: %s: variant %r takes %d tensor parameter%s (variant_tensors), got %d"
                                   % (where, variant.name, variant.num_tensors,
                                      "" if variant.num_tensors == 1 else "s", len(ts)))
    for i, x in enumerate(ts):
        what = "variant_tensors[%d]" % i
        if not (T.is_torch(x) or isinstance(x, np.ndarray)):
            raise TypeError("kvattn: %s: %s must be a NumPy array or a torch tensor, got %s"
                            % (where, what, type(x).__name__))
        if T.device_of(x) != dev:
            raise ValueError("kvattn: %s: %s is on %s but the attention runs on %s"
                             % (where, what, T.device_str(T.device_of(x)), T.device_str(dev)))
        if str(x.dtype).replace("torch.", "") != "float32":
            raise TypeError("kvattn: %s: %s must be float32, got %s" % (where, what, str(x.dtype)))
        if not T.is_contiguous(x):
            raise ValueError("kvattn: %s: %s must be contiguous (the hooks index it as a flat f32 array)"
                             % (where, what))
        n = 1
        for s in x.shape:
            n *= int(s)
        if n == 0:
            raise ValueError("kvattn: %s: %s is empty" % (where, what))
    return ts


def run_params(variant: Optional[Variant], scalars: Tuple[float, ...], tensors: Tuple[Any, ...]) -> RunParams:
    """Checked scalars / tensors -> the ctypes arrays of kva_run_args (no variant: all empty)."""
    rp = RunParams()
    if variant is None:
        return rp
    if scalars:
        rp.scalars = (ctypes.c_float * len(scalars))(*scalars)
        rp.num_scalars = len(scalars)
    if tensors:
        rp.tensor_ptrs = (ctypes.c_void_p * len(tensors))(*[T.data_ptr(x) for x in tensors])
        rp.num_tensors = len(tensors)
        rp.keep = tensors
    return rp


def check_variant(variant: Any) -> Optional[Variant]:
    if variant is None:
        return None
    if not isinstance(variant, Variant):
        raise TypeError("kvattn: variant must be a kvattn.Variant, got %s" % type(variant).__name__)
    if variant.closed:
        raise InvalidArgumentError("kvattn: variant %r is closed (Variant.close() was called)" % variant.name)
    return variant


def refuse(variant: Any, what: str, why: str) -> None:
    """UnsupportedError for an op that takes no user variant."""
    if variant is not None:
        raise UnsupportedError("kvattn: %s does not support user variants (%s)" % (what, why))
