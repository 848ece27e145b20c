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


def _weights(bitorder: str):
    if bitorder == "big":
        return [128, 64, 32, 16, 8, 4, 2, 1]
    if bitorder == "little":
        return [1, 2, 4, 8, 16, 32, 64, 128]
    raise ValueError("kvattn: bitorder must be 'big' or 'little', got %r" % (bitorder,))


def packbits(x: Any, bitorder: str = "big") -> Any:
    """Pack the elements of a (flattened) boolean array into uint8 bytes, like ``numpy.packbits``.

    Args:
        x: NumPy array or torch tensor (any shape; nonzero counts as 1).
        bitorder: ``"big"`` (default, NumPy's) or ``"little"``.

    Returns:
        uint8 array of ``ceil(x.size / 8)`` bytes, same library/device as x.
    """
    w = _weights(bitorder)
    if T.is_torch(x):
        torch = T._torch()
        flat = (x.reshape(-1) != 0).to(torch.int32)
        n = flat.numel()
        pad = (-n) % 8
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        wt = torch.tensor(w, dtype=torch.int32, device=x.device)
        return (flat.view(-1, 8) * wt).sum(-1).to(torch.uint8)
    return np.packbits(np.asarray(x).reshape(-1) != 0, bitorder=bitorder)


def segment_packbits(x: Any, indptr: Any, bitorder: str = "big") -> Tuple[Any, Any]:
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` separately, each starting on a byte boundary.

    Returns:
        ``(packed, new_indptr)``: the concatenated packed segments (uint8) and the int32 byte offsets
        ``new_indptr[i+1] = new_indptr[i] + ceil(len_i / 8)``.
    """
    w = _weights(bitorder)
    if T.is_torch(x) or T.is_torch(indptr):
        torch = T._torch()
        xt = x if T.is_torch(x) else torch.as_tensor(np.asarray(x))
        dev = xt.device
        ip = (indptr if T.is_torch(indptr) else torch.as_tensor(np.asarray(indptr))).to(dev, torch.int64)
        if ip.ndim != 1 or ip.numel() < 1:
            raise ValueError("kvattn: segment_packbits: indptr must be 1-D with at least one element")
        flat = (xt.reshape(-1) != 0).to(torch.int32)
        seg_len = ip[1:] - ip[:-1]
        nbytes = (seg_len + 7) // 8
        new_indptr = torch.zeros(ip.numel(), dtype=torch.int64, device=dev)
        new_indptr[1:] = torch.cumsum(nbytes, 0)
        total = int(new_indptr[-1].item()) if ip.numel() > 1 else 0
        if total == 0:
            return torch.zeros(0, dtype=torch.uint8, device=dev), new_indptr.to(torch.int32)
        j = torch.arange(total, device=dev)
        seg = torch.searchsorted(new_indptr[1:], j, right=True)
        b = j - new_indptr[seg]
        pos = ip[seg].unsqueeze(1) + 8 * b.unsqueeze(1) + torch.arange(8, device=dev).unsqueeze(0)
        valid = pos < ip[seg + 1].unsqueeze(1)
        n = flat.numel()
        safe = pos.clamp(0, max(n - 1, 0))
        bits = torch.where(valid, flat[safe] if n else torch.zeros_like(safe, dtype=torch.int32),
                           torch.zeros((), dtype=torch.int32, device=dev))
        wt = torch.tensor(w, dtype=torch.int32, device=dev)
        packed = (bits * wt).sum(-1).to(torch.uint8)
        return packed, new_indptr.to(torch.int32)
    xa = np.asarray(x).reshape(-1) != 0
    ip = np.asarray(indptr).astype(np.int64)
    if ip.ndim != 1 or ip.size < 1:
        raise ValueError("kvattn: segment_packbits: indptr must be 1-D with at least one element")
    if ip[0] != 0 or np.any(np.diff(ip) < 0) or ip[-1] > xa.size:
        raise ValueError("kvattn: segment_packbits: indptr must start at 0, be non-decreasing and end at most at "
                         "len(x) = %d" % xa.size)
    seg_len = np.diff(ip)
    nbytes = (seg_len + 7) // 8
    new_indptr = np.zeros(ip.size, dtype=np.int64)
    np.cumsum(nbytes, out=new_indptr[1:])
    total = int(new_indptr[-1])
    if total == 0:
        return np.zeros(0, dtype=np.uint8), new_indptr.astype(np.int32)
    j = np.arange(total)
    seg = np.searchsorted(new_indptr[1:], j, side="right")
    b = j - new_indptr[seg]
    pos = ip[seg][:, None] + 8 * b[:, None] + np.arange(8)[None, :]
    valid = pos < ip[seg + 1][:, None]
    bits = np.where(valid, xa[np.clip(pos, 0, max(xa.size - 1, 0))], False).astype(np.int32)
    packed = (bits * np.array(w, dtype=np.int32)).sum(-1).astype(np.uint8)
    return packed, new_indptr.astype(np.int32)
