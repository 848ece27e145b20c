"""ctypes mirror of include/kvattn.h: enums, structs, function prototypes and library loading.

The structs here must match the C header byte for byte (python/tests/test_abi.py compiles a probe against the
header and compares every size and field offset). Keep the field order identical to the header.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char_p,
    c_float,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import List, Optional

from .exceptions import LibraryNotFoundError, error_for_status

# --------------------------------------------------------------------------------------------------
# Enums (C enums are int-sized on every ABI kvattn targets)

c_enum = c_int

KVA_OK = 0
KVA_ERR_INVALID_ARGUMENT = 1
KVA_ERR_UNSUPPORTED = 2
KVA_ERR_WORKSPACE_TOO_SMALL = 3
KVA_ERR_PAGETABLE_MALFORMED = 4
KVA_ERR_PAGE_INDEX_OUT_OF_RANGE = 5
KVA_ERR_PLAN_MISMATCH = 6
KVA_ERR_ALIGNMENT = 7
KVA_ERR_OUT_OF_MEMORY = 8
KVA_ERR_BACKEND = 9
KVA_ERR_JIT = 10
KVA_ERR_CAPTURE_ACTIVE = 11
KVA_ERR_NO_DEVICE = 12
KVA_ERR_INTERNAL = 13

KVA_DTYPE_F32 = 0
KVA_DTYPE_F16 = 1
KVA_DTYPE_BF16 = 2
KVA_DTYPE_E4M3 = 3
KVA_DTYPE_E5M2 = 4
KVA_DTYPE_I32 = 5
KVA_DTYPE_U8 = 6

KVA_DTYPE_NAMES = {
    KVA_DTYPE_F32: "float32",
    KVA_DTYPE_F16: "float16",
    KVA_DTYPE_BF16: "bfloat16",
    KVA_DTYPE_E4M3: "float8_e4m3fn",
    KVA_DTYPE_E5M2: "float8_e5m2",
    KVA_DTYPE_I32: "int32",
    KVA_DTYPE_U8: "uint8",
}
KVA_DTYPE_SIZES = {
    KVA_DTYPE_F32: 4,
    KVA_DTYPE_F16: 2,
    KVA_DTYPE_BF16: 2,
    KVA_DTYPE_E4M3: 1,
    KVA_DTYPE_E5M2: 1,
    KVA_DTYPE_I32: 4,
    KVA_DTYPE_U8: 1,
}

KVA_BACKEND_AUTO = 0
KVA_BACKEND_CPU = 1
KVA_BACKEND_CUDA = 2

KVA_LAYOUT_NHD = 0
KVA_LAYOUT_HND = 1

KVA_MASK_NONE = 0
KVA_MASK_CAUSAL = 1
KVA_MASK_CUSTOM = 2

KVA_POS_NONE = 0
KVA_POS_ROPE_LLAMA = 1
KVA_POS_ALIBI = 2

KVA_SCORE_SOFTMAX = 0
KVA_SCORE_SIGMOID = 1

KVA_LOG_ERROR = 0
KVA_LOG_WARN = 1
KVA_LOG_INFO = 2
KVA_LOG_DEBUG = 3

KVA_OP_BATCH_DECODE = 0
KVA_OP_BATCH_PREFILL_PAGED = 1
KVA_OP_BATCH_PREFILL_RAGGED = 2

KVA_MAX_DIMS = 4
KVA_WS_ALIGN = 256  # alignment the C library requires of both workspace pointers

# --------------------------------------------------------------------------------------------------
# Structs

kva_log_fn = CFUNCTYPE(None, c_void_p, c_enum, c_char_p)


class kva_context_options(Structure):
    _fields_ = [
        ("backend", c_enum),
        ("device", c_int32),
        ("num_threads", c_int32),
        ("log_fn", kva_log_fn),
        ("log_user", c_void_p),
        ("log_level", c_enum),
        ("jit_cache_dir", c_char_p),
    ]


class kva_tensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_enum),
        ("ndim", c_int32),
        ("shape", c_int64 * KVA_MAX_DIMS),
        ("stride", c_int64 * KVA_MAX_DIMS),
    ]


class kva_paged_kv(Structure):
    _fields_ = [
        ("k_data", c_void_p),
        ("v_data", c_void_p),
        ("dtype", c_enum),
        ("num_pages", c_int64),
        ("page_size", c_int32),
        ("num_heads", c_int32),
        ("head_dim_qk", c_int32),
        ("head_dim_vo", c_int32),
        ("k_stride_page", c_int64),
        ("k_stride_token", c_int64),
        ("k_stride_head", c_int64),
        ("v_stride_page", c_int64),
        ("v_stride_token", c_int64),
        ("v_stride_head", c_int64),
        ("indices", c_void_p),  # const int32_t*
        ("indptr", c_void_p),  # const int32_t*
        ("last_page_len", c_void_p),  # const int32_t*
        ("num_indices", c_int64),  # entries in indices (0 = unchecked)
    ]


class kva_attention_desc(Structure):
    _fields_ = [
        ("num_qo_heads", c_int32),
        ("num_kv_heads", c_int32),
        ("head_dim_qk", c_int32),
        ("head_dim_vo", c_int32),
        ("q_dtype", c_enum),
        ("kv_dtype", c_enum),
        ("o_dtype", c_enum),
        ("mask_mode", c_enum),
        ("window_left", c_int32),
        ("logits_soft_cap", c_float),
        ("sm_scale", c_float),
        ("pos_encoding", c_enum),
        ("rope_scale", c_float),
        ("rope_theta", c_float),
        ("score_mode", c_enum),
        ("sigmoid_bias", c_float),
        ("variant", c_void_p),  # const kva_variant*
    ]


class kva_variant_spec(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("source", c_char_p),
        ("hooks", c_uint32),
        ("use_softmax", c_int32),
        ("num_scalar_params", c_int32),
        ("num_tensor_params", c_int32),
    ]


class kva_plan_params(Structure):
    _fields_ = [
        ("batch_size", c_int32),
        ("qo_indptr", c_void_p),  # const int32_t*
        ("kv_indptr", c_void_p),
        ("kv_last_page_len", c_void_p),
        ("page_size", c_int32),
        ("num_pages", c_int64),
        ("kv_indices", c_void_p),
        ("fixed_split_size", c_int32),
        ("disable_split_kv", c_int32),
        ("graph_mode", c_int32),
        ("max_batch_size", c_int32),
        ("max_total_qo_rows", c_int64),
        ("kv_seq_lens", c_void_p),  # const int32_t*: the block-table form (NULL: CSR)
        ("block_table_stride", c_int32),
    ]


class kva_workspace(Structure):
    _fields_ = [
        ("device", c_void_p),
        ("device_bytes", c_size_t),
        ("host", c_void_p),
        ("host_bytes", c_size_t),
        ("scratch", c_void_p),
        ("scratch_bytes", c_size_t),
    ]


class kva_plan(Structure):
    _fields_ = [("opaque", c_uint64 * 160)]


class kva_plan_info(Structure):
    _fields_ = [
        ("op", c_enum),
        ("batch_size", c_int32),
        ("total_qo_rows", c_int64),
        ("num_workers", c_int32),
        ("tile_q", c_int32),
        ("kv_chunk_size", c_int32),
        ("num_work_items", c_int32),
        ("num_merge_tasks", c_int32),
        ("num_partials", c_int32),
        ("graph_mode", c_int32),
        ("kv_head_group", c_int32),
        ("max_worker_cost", c_int64),
        ("total_cost", c_int64),
        ("device_bytes", c_size_t),
        ("host_bytes", c_size_t),
        ("scratch_bytes", c_size_t),
    ]


class kva_run_args(Structure):
    _fields_ = [
        ("q", kva_tensor),
        ("o", kva_tensor),
        ("lse", kva_tensor),
        ("paged", kva_paged_kv),
        ("k", kva_tensor),
        ("v", kva_tensor),
        ("custom_mask", c_void_p),  # const uint8_t*
        ("custom_mask_bytes", c_int64),
        ("alibi_slopes", c_void_p),  # const float*
        ("k_scale", c_float),
        ("v_scale", c_float),
        ("stream", c_void_p),
        ("variant_scalars", c_void_p),  # const float* (host)
        ("num_variant_scalars", c_int32),
        ("num_variant_tensors", c_int32),
        ("variant_tensors", c_void_p),  # const void* const* (host array of backend pointers)
        ("enable_pdl", c_int32),
    ]


class kva_fault_report(Structure):
    _fields_ = [
        ("faulted", c_int32),
        ("request", c_int32),
        ("page_index", c_int64),
    ]


STRUCTS = {
    "kva_context_options": kva_context_options,
    "kva_tensor": kva_tensor,
    "kva_paged_kv": kva_paged_kv,
    "kva_attention_desc": kva_attention_desc,
    "kva_variant_spec": kva_variant_spec,
    "kva_plan_params": kva_plan_params,
    "kva_workspace": kva_workspace,
    "kva_plan": kva_plan,
    "kva_plan_info": kva_plan_info,
    "kva_run_args": kva_run_args,
    "kva_fault_report": kva_fault_report,
}

# --------------------------------------------------------------------------------------------------
# Prototypes: name -> (restype, argtypes)

_P = POINTER
_ctx_p = c_void_p  # kva_context* (opaque)

_PROTOTYPES = {
    "kva_version": (c_int, []),
    "kva_version_string": (c_char_p, []),
    "kva_status_string": (c_char_p, [c_enum]),
    "kva_last_error_message": (c_char_p, []),
    "kva_last_error_status": (c_enum, []),
    "kva_clear_last_error": (None, []),
    "kva_dtype_size": (c_size_t, [c_enum]),
    "kva_dtype_name": (c_char_p, [c_enum]),
    "kva_context_options_init": (None, [_P(kva_context_options)]),
    "kva_context_create": (c_enum, [_P(kva_context_options), _P(c_void_p)]),
    "kva_context_destroy": (c_enum, [_ctx_p]),
    "kva_context_backend": (c_enum, [_ctx_p]),
    "kva_context_num_workers": (c_int32, [_ctx_p]),
    "kva_paged_kv_init": (
        c_enum,
        [_P(kva_paged_kv), c_void_p, c_void_p, c_enum, c_enum, c_int64, c_int32, c_int32, c_int32, c_int32],
    ),
    "kva_attention_desc_init": (None, [_P(kva_attention_desc), c_int32, c_int32, c_int32, c_enum]),
    "kva_attention_desc_check": (c_enum, [_ctx_p, _P(kva_attention_desc)]),
    "kva_variant_spec_init": (None, [_P(kva_variant_spec)]),
    "kva_variant_create": (c_enum, [_ctx_p, _P(kva_variant_spec), _P(c_void_p)]),
    "kva_variant_destroy": (c_enum, [c_void_p]),
    "kva_plan_params_init": (None, [_P(kva_plan_params)]),
    "kva_plan_workspace_size": (
        c_enum,
        [_ctx_p, _P(kva_attention_desc), c_enum, _P(kva_plan_params), _P(c_size_t), _P(c_size_t)],
    ),
    "kva_workspace_bound": (
        c_enum,
        [_ctx_p, _P(kva_attention_desc), c_enum, c_int32, c_int64, _P(c_size_t), _P(c_size_t)],
    ),
    "kva_plan_workspace_parts": (
        c_enum,
        [_ctx_p, _P(kva_attention_desc), c_enum, _P(kva_plan_params), _P(c_size_t), _P(c_size_t), _P(c_size_t)],
    ),
    "kva_workspace_bound_parts": (
        c_enum,
        [_ctx_p, _P(kva_attention_desc), c_enum, c_int32, c_int64, _P(c_size_t), _P(c_size_t), _P(c_size_t)],
    ),
    "kva_plan_make": (
        c_enum,
        [_ctx_p, _P(kva_attention_desc), c_enum, _P(kva_plan_params), _P(kva_workspace), _P(kva_plan), c_void_p],
    ),
    "kva_plan_get_info": (c_enum, [_P(kva_plan), _P(kva_plan_info)]),
    "kva_run_args_init": (None, [_P(kva_run_args)]),
    "kva_run": (c_enum, [_ctx_p, _P(kva_plan), _P(kva_workspace), _P(kva_run_args)]),
    "kva_single_workspace_size": (
        c_enum,
        [_ctx_p, _P(kva_attention_desc), c_int64, c_int64, _P(c_size_t), _P(c_size_t)],
    ),
    "kva_single_decode": (c_enum, [_ctx_p, _P(kva_attention_desc), _P(kva_run_args), _P(kva_workspace)]),
    "kva_single_prefill": (c_enum, [_ctx_p, _P(kva_attention_desc), _P(kva_run_args), _P(kva_workspace)]),
    "kva_merge_state": (
        c_enum,
        [_ctx_p, _P(kva_tensor), _P(kva_tensor), _P(kva_tensor), _P(kva_tensor), _P(kva_tensor), _P(kva_tensor),
         c_void_p],
    ),
    "kva_merge_state_in_place": (
        c_enum,
        [_ctx_p, _P(kva_tensor), _P(kva_tensor), _P(kva_tensor), _P(kva_tensor), c_void_p, c_void_p],
    ),
    "kva_merge_states": (
        c_enum,
        [_ctx_p, _P(kva_tensor), _P(kva_tensor), c_void_p, c_int64, _P(kva_tensor), _P(kva_tensor), c_void_p],
    ),
    "kva_append_paged_kv_cache": (
        c_enum,
        [_ctx_p, _P(kva_tensor), _P(kva_tensor), c_void_p, c_void_p, c_int64, _P(kva_paged_kv), c_int32, c_void_p],
    ),
    "kva_append_paged_kv_cache_by_slot": (
        c_enum,
        [_ctx_p, _P(kva_tensor), _P(kva_tensor), c_void_p, c_int64, _P(kva_paged_kv), c_void_p],
    ),
    "kva_read_faults": (c_enum, [_ctx_p, _P(kva_workspace), _P(kva_fault_report), c_void_p]),
    "kva_alibi_slopes": (c_enum, [c_int32, _P(c_float)]),
}

# --------------------------------------------------------------------------------------------------
# Library loading

_LIB_NAMES = ("libkvattn.so", "libkvattn.dylib", "kvattn.dll")
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None


def candidate_paths() -> List[str]:
    """Where kvattn looks for the shared library, in order."""
    out: List[str] = []
    env = os.environ.get("KVATTN_LIBRARY")
    if env:
        out.append(env)
    here = Path(__file__).resolve().parent
    for name in _LIB_NAMES:
        out.append(str(here / name))
    # In-tree use (PYTHONPATH=python): the repository's build directory.
    repo = here.parent.parent
    for name in _LIB_NAMES:
        out.append(str(repo / "build" / name))
    return out


def _load() -> ctypes.CDLL:
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        env = os.environ.get("KVATTN_LIBRARY")
        for path in candidate_paths():
            if not os.path.exists(path):
                tried.append(path + " (missing)")
                if env and path == env:
                    raise LibraryNotFoundError(
                        "KVATTN_LIBRARY=%s does not exist; point it at a built libkvattn.so" % env)
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:  # pragma: no cover - depends on the machine
                tried.append("%s (%s)" % (path, e))
                if env and path == env:
                    raise LibraryNotFoundError("KVATTN_LIBRARY=%s could not be loaded: %s" % (env, e)) from e
                continue
            _bind(lib, path)
            _lib, _lib_path = lib, path
            return lib
        raise LibraryNotFoundError(
            "kvattn: the shared library libkvattn.so was not found. Install the package with "
            "`pip install ./python` (it builds the library with cmake), build it in-tree with "
            "`cmake -S . -B build && cmake --build build`, or set KVATTN_LIBRARY. Tried:\n  " + "\n  ".join(tried))


def _bind(lib: ctypes.CDLL, path: str) -> None:
    missing = []
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    if missing:
        raise LibraryNotFoundError("%s does not export %s (an older or incomplete kvattn build?)"
                                   % (path, ", ".join(missing)))


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use)."""
    return _lib if _lib is not None else _load()


class PrototypeBinder:
    """Binds a module's extra C prototypes (name -> (restype, argtypes)) to the loaded library on first use, and again
    if the library is reloaded; a missing symbol raises LibraryNotFoundError naming the feature."""

    def __init__(self, prototypes: dict, feature: str) -> None:
        self._prototypes = prototypes
        self._feature = feature
        self._bound = None

    def __call__(self) -> ctypes.CDLL:
        lb = lib()
        if self._bound is not lb:
            missing = []
            for name, (restype, argtypes) in self._prototypes.items():
                fn = getattr(lb, name, None)
                if fn is None:
                    missing.append(name)
                    continue
                fn.restype = restype
                fn.argtypes = argtypes
            if missing:
                raise LibraryNotFoundError("%s does not export %s (a kvattn build without %s?)"
                                           % (library_path(), ", ".join(missing), self._feature))
            self._bound = lb
        return lb


def library_path() -> str:
    lib()
    assert _lib_path is not None
    return _lib_path


def last_error_message() -> str:
    msg = lib().kva_last_error_message()
    return msg.decode("utf-8", "replace") if msg else ""


def status_string(status: int) -> str:
    s = lib().kva_status_string(status)
    return s.decode() if s else "KVA_STATUS_%d" % status


def check(status: int, what: str = "") -> None:
    """Raise the KvattnError subclass for a non-OK status, carrying kva_last_error_message()."""
    if status == KVA_OK:
        return
    msg = last_error_message()
    if not msg:
        msg = "%s failed" % (what or "kvattn call")
    raise error_for_status(status, msg, status_string(status))


def version() -> str:
    return lib().kva_version_string().decode()


if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("kvattn supports little-endian hosts only")
