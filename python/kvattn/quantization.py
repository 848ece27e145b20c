"""Bit packing for custom attention masks (FlashInfer's ``flashinfer.quantization`` names and semantics).

``packbits`` follows ``numpy.packbits`` on the flattened input (nonzero = 1, the last byte zero-padded);
``bitorder="big"`` puts the first element in the most significant bit (NumPy's default), ``"little"`` in the
least significant bit, which is what the attention functions read.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from . import _tensor as T

__all__ = ["packbits", "segment_packbits"]


def _check_bitorder(bitorder: str) -> None:
    if bitorder not in ("big", "little"):
        raise ValueError("kvattn: bitorder must be 'big' or 'little', got %r" % (bitorder,))


def _pack_torch(flat: Any, bitorder: str) -> Any:
    """Bits of a 1-D bool/integer tensor packed into uint8 (zero-padded), with uint8 temporaries only."""
    torch = T._torch()
    b = (flat != 0).to(torch.uint8)
    pad = (-b.numel()) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    b = b.view(-1, 8)
    out = b[:, 0] << (7 if bitorder == "big" else 0)
    for k in range(1, 8):
        out |= b[:, k] << (7 - k if bitorder == "big" else k)
    return out


def packbits(x: Any, bitorder: str = "big") -> Any:
    """Pack the elements of a (flattened) boolean array into uint8 bytes, like ``numpy.packbits``.

    Args:
        x: NumPy array or torch tensor (any shape; nonzero counts as 1).
        bitorder: ``"big"`` (default, NumPy's) or ``"little"``.

    Returns:
        uint8 array of ``ceil(x.size / 8)`` bytes, same library/device as x.
    """
    _check_bitorder(bitorder)
    if T.is_torch(x):
        return _pack_torch(x.reshape(-1), bitorder)
    return np.packbits(np.asarray(x).reshape(-1) != 0, bitorder=bitorder)


def segment_packbits(x: Any, indptr: Any, bitorder: str = "big") -> Tuple[Any, Any]:
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` separately, each starting on a byte boundary (``indptr[0]``
    may be > 0: the elements before it are not packed).

    Returns:
        ``(packed, new_indptr)``: the concatenated packed segments (uint8) and the int32 byte offsets
        ``new_indptr[i+1] = new_indptr[i] + ceil(len_i / 8)``.
    Memory: the output and about one byte per element of temporaries (torch); segments are packed one by one
    unless every segment but the last has a multiple of 8 elements (then the whole array at once).
    """
    _check_bitorder(bitorder)
    is_t = T.is_torch(x) or T.is_torch(indptr)
    if is_t:
        torch = T._torch()
        xt = x if T.is_torch(x) else torch.as_tensor(np.asarray(x))
        flat = xt.reshape(-1)
        ip = (indptr.detach().cpu().numpy() if T.is_torch(indptr) else np.asarray(indptr)).astype(np.int64)
        n = int(flat.numel())
    else:
        flat = np.asarray(x).reshape(-1)
        ip = np.asarray(indptr).astype(np.int64)
        n = int(flat.size)
    if ip.ndim != 1 or ip.size < 1:
        raise ValueError("kvattn: segment_packbits: indptr must be 1-D with at least one element")
    # as FlashInfer, segment i is x[indptr[i]:indptr[i+1]] whatever indptr[0] is (new_indptr starts at 0)
    if ip[0] < 0 or np.any(np.diff(ip) < 0) or ip[-1] > n:
        raise ValueError("kvattn: segment_packbits: indptr must be >= 0, non-decreasing and end at most at "
                         "len(x) = %d" % n)
    seg_len = np.diff(ip)
    nbytes = (seg_len + 7) // 8
    new_indptr = np.zeros(ip.size, dtype=np.int64)
    np.cumsum(nbytes, out=new_indptr[1:])
    total = int(new_indptr[-1])
    one_piece = seg_len.size == 0 or not np.any(seg_len[:-1] % 8)
    if is_t:
        dev = flat.device
        nip = torch.as_tensor(new_indptr.astype(np.int32)).to(dev)
        empty = lambda size: torch.empty(size, dtype=torch.uint8, device=dev)  # noqa: E731
        pack = lambda a: _pack_torch(a, bitorder)  # noqa: E731
    else:
        nip = new_indptr.astype(np.int32)
        empty = lambda size: np.empty(size, dtype=np.uint8)  # noqa: E731
        pack = lambda a: np.packbits(a != 0, bitorder=bitorder)  # noqa: E731
    if total == 0:
        return empty(0), nip
    if one_piece:
        return pack(flat[int(ip[0]):int(ip[-1])]), nip
    out = empty(total)
    for i in range(seg_len.size):
        if seg_len[i]:
            out[int(new_indptr[i]):int(new_indptr[i + 1])] = pack(flat[int(ip[i]):int(ip[i + 1])])
    return out, nip
