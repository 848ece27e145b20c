"""Exceptions raised by kvattn.

Every error reported by the C library becomes an instance of a :class:`KvattnError` subclass chosen by its
``kva_status`` code; the exception text is the C library's ``kva_last_error_message()``. Each subclass also
derives from the builtin exception a Python caller would expect (``ValueError`` for bad input,
``NotImplementedError`` for valid but unsupported configurations, ``RuntimeError`` for device/runtime
failures), so ``except ValueError`` keeps working for code written against FlashInfer.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Type

__all__ = [
    "KvattnError",
    "InvalidArgumentError",
    "UnsupportedError",
    "WorkspaceTooSmallError",
    "PageTableMalformedError",
    "PageIndexOutOfRangeError",
    "PlanMismatchError",
    "AlignmentError",
    "KvattnOutOfMemoryError",
    "BackendError",
    "JitError",
    "CaptureActiveError",
    "NoDeviceError",
    "InternalError",
    "LibraryNotFoundError",
    "error_for_status",
]


class KvattnError(Exception):
    """Base class of every error kvattn raises on purpose.

    Attributes:
        status: the ``kva_status`` integer (0 when the error was detected by the Python layer itself and
            has no C status; the subclass still tells the kind).
        status_name: e.g. ``"KVA_ERR_INVALID_ARGUMENT"``.
        message: the detailed message (the C library's ``kva_last_error_message()`` for C errors).
    """

    status: int = 0
    status_name: str = "KVA_OK"

    def __init__(self, message: str, status: Optional[int] = None, status_name: Optional[str] = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if status_name is not None:
            self.status_name = status_name


class InvalidArgumentError(KvattnError, ValueError):
    status, status_name = 1, "KVA_ERR_INVALID_ARGUMENT"


class UnsupportedError(KvattnError, NotImplementedError):
    status, status_name = 2, "KVA_ERR_UNSUPPORTED"


class WorkspaceTooSmallError(KvattnError, ValueError):
    """The workspace buffer is smaller than a plan needs. ``needed_bytes`` holds the size when known."""

    status, status_name = 3, "KVA_ERR_WORKSPACE_TOO_SMALL"

    def __init__(self, message: str, status: Optional[int] = None, status_name: Optional[str] = None,
                 needed_bytes: Optional[int] = None):
        super().__init__(message, status, status_name)
        if needed_bytes is None:
            m = re.search(r"needs (\d+) bytes", message)
            needed_bytes = int(m.group(1)) if m else None
        self.needed_bytes = needed_bytes


class PageTableMalformedError(KvattnError, ValueError):
    status, status_name = 4, "KVA_ERR_PAGETABLE_MALFORMED"


class PageIndexOutOfRangeError(KvattnError, ValueError):
    status, status_name = 5, "KVA_ERR_PAGE_INDEX_OUT_OF_RANGE"


class PlanMismatchError(KvattnError, ValueError):
    """A run-time argument (tensor dtype/shape, scalar parameter, workspace) disagrees with the plan."""

    status, status_name = 6, "KVA_ERR_PLAN_MISMATCH"


class AlignmentError(KvattnError, ValueError):
    status, status_name = 7, "KVA_ERR_ALIGNMENT"


class KvattnOutOfMemoryError(KvattnError, MemoryError):
    status, status_name = 8, "KVA_ERR_OUT_OF_MEMORY"


class BackendError(KvattnError, RuntimeError):
    status, status_name = 9, "KVA_ERR_BACKEND"


class JitError(KvattnError, RuntimeError):
    status, status_name = 10, "KVA_ERR_JIT"


class CaptureActiveError(KvattnError, RuntimeError):
    status, status_name = 11, "KVA_ERR_CAPTURE_ACTIVE"


class NoDeviceError(KvattnError, RuntimeError):
    status, status_name = 12, "KVA_ERR_NO_DEVICE"


class InternalError(KvattnError, RuntimeError):
    status, status_name = 13, "KVA_ERR_INTERNAL"


class LibraryNotFoundError(KvattnError, ImportError):
    """The kvattn shared library could not be found or loaded."""


_BY_STATUS: Dict[int, Type[KvattnError]] = {
    cls.status: cls
    for cls in (
        InvalidArgumentError,
        UnsupportedError,
        WorkspaceTooSmallError,
        PageTableMalformedError,
        PageIndexOutOfRangeError,
        PlanMismatchError,
        AlignmentError,
        KvattnOutOfMemoryError,
        BackendError,
        JitError,
        CaptureActiveError,
        NoDeviceError,
        InternalError,
    )
}


def error_for_status(status: int, message: str, status_name: Optional[str] = None) -> KvattnError:
    """Build the exception for a C status code (unknown codes map to :class:`KvattnError`)."""
    cls = _BY_STATUS.get(int(status), KvattnError)
    if status_name is None:
        status_name = cls.status_name if cls is not KvattnError else "KVA_STATUS_%d" % int(status)
    if not message:
        message = status_name
    return cls(message, int(status), status_name)
