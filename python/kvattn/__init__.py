"""kvattn: an attention engine for LLM serving, with FlashInfer's Python API.

Switch an engine written against FlashInfer with one line::

    import kvattn as flashinfer

NumPy arrays run on the CPU backend; torch CUDA tensors run on the CUDA backend on the caller's current
stream; torch CPU tensors run on the CPU backend. The C library (libkvattn.so) is found through
$KVATTN_LIBRARY, next to this package, or in the repository's build/ directory.
"""

from . import cascade, decode, page, prefill, quantization, utils  # noqa: F401 (flashinfer.<module> paths)
from ._ffi import candidate_paths, library_path
from .cascade import MultiLevelCascadeAttentionWrapper, merge_state, merge_state_in_place, merge_states
from .decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
)
from .exceptions import (
    AlignmentError,
    BackendError,
    CaptureActiveError,
    InternalError,
    InvalidArgumentError,
    JitError,
    KvattnError,
    KvattnOutOfMemoryError,
    LibraryNotFoundError,
    NoDeviceError,
    PageIndexOutOfRangeError,
    PageTableMalformedError,
    PlanMismatchError,
    UnsupportedError,
    WorkspaceTooSmallError,
)
from .page import append_paged_kv_cache, append_paged_kv_cache_by_slot, get_batch_indices_positions, get_seq_lens
from .prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .quantization import packbits, segment_packbits
from . import sparse  # noqa: F401 (flashinfer.sparse path)
from .sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper
from .utils import MaskMode, PosEncodingMode, TensorLayout
from . import variant  # noqa: F401
from .variant import Variant, VariantHook

__version__ = "0.1.0"


def library_version() -> str:
    """Version string of the loaded C library."""
    from ._ffi import version

    return version()


__all__ = [
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "BlockSparseAttentionWrapper",
    "VariableBlockSparseAttentionWrapper",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "append_paged_kv_cache",
    "append_paged_kv_cache_by_slot",
    "get_batch_indices_positions",
    "get_seq_lens",
    "packbits",
    "segment_packbits",
    "PosEncodingMode",
    "TensorLayout",
    "MaskMode",
    "Variant",
    "VariantHook",
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
    "library_path",
    "library_version",
    "candidate_paths",
]
