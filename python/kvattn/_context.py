"""kvattn contexts (one CPU context per process, one CUDA context per device, created lazily), streams and
workspaces."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _ffi as F
from . import _tensor as T
from .exceptions import CaptureActiveError, WorkspaceTooSmallError

_log = logging.getLogger("kvattn")
_lock = threading.Lock()
_contexts: Dict[T.DeviceKey, int] = {}
# One token object per created context: objects owned by a context (user variants) remember the token and touch
# their C handles only while it is still the current one (kva_context_destroy frees what a context owns).
_tokens: Dict[T.DeviceKey, object] = {}


def _log_cb(user, level, message):  # pragma: no cover - only with KVATTN_LOG set
    text = message.decode("utf-8", "replace") if message else ""
    _log.log({0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO}.get(level, logging.DEBUG), "%s", text)


_LOG_FN = F.kva_log_fn(_log_cb)


def get_context(dev: T.DeviceKey) -> int:
    """The kva_context* (as an int) for a device key; created on first use."""
    ctx = _contexts.get(dev)
    if ctx is not None:
        return ctx
    with _lock:
        ctx = _contexts.get(dev)
        if ctx is not None:
            return ctx
        lib = F.lib()
        opt = F.kva_context_options()
        lib.kva_context_options_init(ctypes.byref(opt))
        if dev[0] == "cpu":
            opt.backend = F.KVA_BACKEND_CPU
            nt = os.environ.get("KVATTN_NUM_THREADS")
            if nt:
                opt.num_threads = int(nt)
        else:
            opt.backend = F.KVA_BACKEND_CUDA
            opt.device = dev[1]
        level = os.environ.get("KVATTN_LOG")
        if level:
            opt.log_fn = _LOG_FN
            opt.log_level = {"error": 0, "warn": 1, "info": 2, "debug": 3}.get(level.lower(), 1)
        out = ctypes.c_void_p()
        F.check(lib.kva_context_create(ctypes.byref(opt), ctypes.byref(out)),
                "kva_context_create(%s)" % T.device_str(dev))
        _tokens[dev] = object()
        _contexts[dev] = out.value
        return out.value


def context_token(dev: T.DeviceKey) -> object:
    """The liveness token of the device's context (creating the context if needed)."""
    get_context(dev)
    return _tokens[dev]


def context_alive(dev: T.DeviceKey, token: object) -> bool:
    """Whether the context that `token` was issued for is still alive (not destroyed at exit)."""
    return _tokens.get(dev) is token


@atexit.register
def _destroy_all() -> None:  # pragma: no cover - process exit
    lib = F._lib
    if lib is None:
        return
    _tokens.clear()  # first: variant finalizers that run later must not touch freed handles
    for dev, ctx in list(_contexts.items()):
        try:
            lib.kva_context_destroy(ctx)
        except Exception:
            pass
    _contexts.clear()


def num_workers(dev: T.DeviceKey) -> int:
    return int(F.lib().kva_context_num_workers(get_context(dev)))


def current_stream(dev: T.DeviceKey) -> Optional[int]:
    """cudaStream_t of torch's current stream on the device (None for the CPU)."""
    if dev[0] == "cpu":
        return None
    t = T._torch()
    raw = getattr(t._C, "_cuda_getCurrentRawStream", None)  # one C call; the Stream object costs several us
    if raw is not None:
        return int(raw(dev[1])) or None
    return int(t.cuda.current_stream(dev[1]).cuda_stream) or None


def is_capturing(dev: T.DeviceKey) -> bool:
    if dev[0] == "cpu":
        return False
    t = T._torch()
    try:
        # the device's current stream (torch's query is about the current device's, which may be another one); the
        # two torch._C calls directly where they exist (the public wrappers cost several us per run)
        c = t._C
        get_dev = getattr(c, "_cuda_getDevice", None)
        capturing = getattr(c, "_cuda_isCurrentStreamCapturing", None)
        if get_dev is not None and capturing is not None and get_dev() == dev[1]:
            return bool(capturing())
        if t.cuda.current_device() == dev[1]:
            return bool(t.cuda.is_current_stream_capturing())
        with t.cuda.device(dev[1]):
            return bool(t.cuda.is_current_stream_capturing())
    except Exception:  # pragma: no cover
        return False


def sync_device_stream(dev: T.DeviceKey) -> None:
    if dev[0] != "cpu":
        T._torch().cuda.current_stream(dev[1]).synchronize()


def _align(p: int) -> int:
    return (p + F.KVA_WS_ALIGN - 1) // F.KVA_WS_ALIGN * F.KVA_WS_ALIGN


# Device bytes written by plans and runs, per device: {(start, end): owner}, where owner is the commit id of the plan
# (or SCRATCH_WRITES) that last wrote them. Batch plans live in their wrapper's own plan memory and write split-KV
# partials to the float workspace; the block-sparse planners keep their plans in the float workspace, so before a
# run a wrapper checks that nobody has written over its plan's bytes since (engines share one float workspace
# between wrappers, as FlashInfer allows).
_ws_writes: Dict[T.DeviceKey, Dict[Tuple[int, int], Any]] = {}
_last_claim: Dict[T.DeviceKey, Tuple[int, int, Any]] = {}


def claim_workspace(dev: T.DeviceKey, start: int, nbytes: int, owner: Any) -> None:
    """Record that `owner` wrote bytes [start, start + nbytes) of device memory (forgetting the writers it
    overwrote)."""
    end = start + int(nbytes)
    last = _last_claim.get(dev)
    if last is not None and last[0] == start and last[1] == end and last[2] is owner:
        return  # the same claim again (the runs of a step): nothing changes
    with _lock:
        d = _ws_writes.setdefault(dev, {})
        if start < end:
            for key in [k for k in d if k[0] < end and k[1] > start]:
                del d[key]
        d[(start, end)] = owner
        _last_claim[dev] = (start, end, owner)


def workspace_intact(dev: T.DeviceKey, start: int, nbytes: int, owner: Any) -> bool:
    """Whether bytes [start, start + nbytes) still hold what `owner` last wrote there."""
    d = _ws_writes.get(dev)
    return d is not None and d.get((start, start + int(nbytes))) is owner


def replan_if_overwritten(dev: T.DeviceKey, start: int, nbytes: int, owner: Any, wrapper: str, replan: Any) -> None:
    """Before a run of a plan that lives in the float workspace: if another wrapper planned or ran in its bytes
    since, call replan() (refused during CUDA-graph capture, where the plan cannot be written again)."""
    if workspace_intact(dev, start, nbytes, owner):
        return
    if is_capturing(dev):
        raise CaptureActiveError(
            "kvattn: %s.run: another wrapper used this wrapper's float workspace since its plan(), and the plan "
            "cannot be written again during CUDA-graph capture; give wrappers whose runs are captured together "
            "separate float workspaces" % wrapper)
    replan()


class HostStaging:
    """Page-locked host staging memory for the CUDA backend's plan copies (grown on demand)."""

    def __init__(self, dev: T.DeviceKey):
        self.dev = dev
        self.buf: Any = None
        self.ptr = 0
        self.nbytes = 0

    def ensure(self, nbytes: int) -> None:
        if self.dev[0] == "cpu" or nbytes <= self.nbytes:
            return
        t = T._torch()
        if self.buf is not None:
            # A plan copy from the old buffer may still be in flight on the stream.
            sync_device_stream(self.dev)
        want = max(int(nbytes), 2 * self.nbytes, 1 << 16)
        buf = t.empty(want + F.KVA_WS_ALIGN, dtype=t.uint8, pin_memory=True)
        base = int(buf.data_ptr())
        self.buf = buf
        self.ptr = _align(base)
        self.nbytes = want - (self.ptr - base) + F.KVA_WS_ALIGN


# Owner of the float-workspace bytes that batch runs write their split-KV partials to (see commit_plan): plans that
# live in those bytes (the block-sparse wrappers') are then known to be overwritten.
SCRATCH_WRITES = object()


class PlanRegion:
    """A wrapper's own device memory for its batch plans (work list, merge map, fault word): the C workspace's
    `device` part, while the caller's float workspace buffer is its `scratch` (split-KV partials). FlashInfer keeps
    its schedules in a per-wrapper int workspace the same way, so wrappers can share one float workspace and keep
    their plans side by side."""

    def __init__(self, dev: T.DeviceKey):
        self.dev = dev
        self.buf: Any = None
        self.ptr = 0
        self.nbytes = 0

    def ensure(self, nbytes: int, fixed: bool, what: str) -> None:
        if nbytes <= self.nbytes:
            return
        if fixed and self.buf is not None:
            # a CUDA-graph wrapper's plans must stay where the captured kernels read them
            raise WorkspaceTooSmallError(
                "kvattn: %s: this plan needs %d bytes of the wrapper's plan memory, more than the %d bytes its first "
                "plan in CUDA-graph mode allocated (captured graphs read the plan there); create the wrapper again "
                "for the larger bounds" % (what, nbytes, self.nbytes), needed_bytes=int(nbytes))
        want = max(int(nbytes), 2 * self.nbytes, 64 << 10)
        if self.dev[0] == "cpu":
            import numpy as np
            buf = np.empty(want + F.KVA_WS_ALIGN, dtype=np.uint8)
            base = int(buf.ctypes.data)
        else:
            t = T._torch()
            if self.buf is not None:
                sync_device_stream(self.dev)  # a run of the previous plan may still read the old memory
            buf = t.empty(want + F.KVA_WS_ALIGN, dtype=t.uint8, device="cuda:%d" % self.dev[1])
            base = int(buf.data_ptr())
        self.buf = buf
        self.ptr = _align(base)
        self.nbytes = want


class Workspace:
    """A caller's float workspace buffer (aligned to 256 bytes inside the buffer) plus the wrapper's own host
    staging buffer and, for batch plans, its own plan memory (PlanRegion)."""

    def __init__(self, buf: Any, what: str = "float_workspace_buffer"):
        if not (T.is_torch(buf) or hasattr(buf, "__array_interface__")):
            raise TypeError("kvattn: %s must be a NumPy array or a torch tensor (uint8), got %s"
                            % (what, type(buf).__name__))
        if not T.is_contiguous(buf):
            raise ValueError("kvattn: %s must be contiguous" % what)
        if not T.is_torch(buf):  # kvattn writes split-KV partials there: a read-only array is refused
            T.check_writable(np.asarray(buf), what)
        self.buf = buf
        self.dev = T.device_of(buf)
        base = T.data_ptr(buf)
        total = T.nbytes_of(buf)
        self.ptr = _align(base)
        self.nbytes = max(0, total - (self.ptr - base))
        self.total_bytes = total
        self.host = HostStaging(self.dev)
        self.plan_region = PlanRegion(self.dev)

    def _check_fits(self, needed: int, what: str) -> None:
        if needed > self.nbytes:
            raise WorkspaceTooSmallError(
                "kvattn: %s: the float workspace buffer has %d usable bytes (%d bytes, aligned to %d) but this plan "
                "needs %d bytes; allocate at least %d bytes" % (
                    what, self.nbytes, self.total_bytes, F.KVA_WS_ALIGN, needed, needed + F.KVA_WS_ALIGN),
                needed_bytes=needed + F.KVA_WS_ALIGN)

    def struct(self, device_needed: int, host_needed: int, what: str) -> "F.kva_workspace":
        """The whole plan in the float workspace buffer (single-request calls, the block-sparse planners)."""
        self._check_fits(device_needed, what)
        self.host.ensure(host_needed)
        ws = F.kva_workspace()
        ws.device = self.ptr or None
        ws.device_bytes = self.nbytes
        ws.host = (self.host.ptr or None) if self.dev[0] != "cpu" else None
        ws.host_bytes = self.host.nbytes if self.dev[0] != "cpu" else 0
        return ws

    def struct_current(self) -> Optional["F.kva_workspace"]:
        """struct_split's workspace over the memory as it is (None before the first batch plan allocated its plan
        memory, or with no float workspace bytes to point the scratch at): for a plan that may fit what an earlier
        plan allocated."""
        if self.plan_region.nbytes == 0 or not self.ptr:
            return None
        return self._split_struct()

    def struct_split(self, plan_needed: int, scratch_needed: int, host_needed: int, fixed: bool,
                     what: str) -> "F.kva_workspace":
        """A batch plan in the wrapper's plan memory, its split-KV partials in the float workspace buffer (the C
        workspace's scratch region). fixed: CUDA-graph mode (the plan memory never moves once allocated)."""
        self._check_fits(scratch_needed, what)
        self.plan_region.ensure(max(int(plan_needed), 1), fixed, what)
        self.host.ensure(host_needed)
        return self._split_struct()

    def _split_struct(self) -> "F.kva_workspace":
        ws = F.kva_workspace()
        ws.device = self.plan_region.ptr or None
        ws.device_bytes = self.plan_region.nbytes
        ws.scratch = self.ptr or None
        ws.scratch_bytes = self.nbytes
        ws.host = (self.host.ptr or None) if self.dev[0] != "cpu" else None
        ws.host_bytes = self.host.nbytes if self.dev[0] != "cpu" else 0
        return ws


class _SingleWorkspaces:
    """Per-device workspaces for the single-request functions on the CUDA backend (the CPU backend allocates
    its own when given none)."""

    def __init__(self):
        self.ws: Dict[T.DeviceKey, Workspace] = {}

    def get(self, dev: T.DeviceKey, device_bytes: int, host_bytes: int) -> "F.kva_workspace":
        w = self.ws.get(dev)
        if w is None or w.nbytes < device_bytes:
            t = T._torch()
            if w is not None:
                sync_device_stream(dev)
            size = max(int(device_bytes) + F.KVA_WS_ALIGN, 32 << 20)
            w = Workspace(t.empty(size, dtype=t.uint8, device="cuda:%d" % dev[1]))
            self.ws[dev] = w
        return w.struct(device_bytes, host_bytes, "single-request attention")


single_workspaces = _SingleWorkspaces()
