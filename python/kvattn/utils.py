"""Enums with FlashInfer's names (``flashinfer.utils``): accepted wherever a mode string is."""

from __future__ import annotations

from enum import Enum

__all__ = ["PosEncodingMode", "TensorLayout", "MaskMode"]


class PosEncodingMode(Enum):
    NONE = 0
    ROPE_LLAMA = 1
    ALIBI = 2


class TensorLayout(Enum):
    NHD = 0
    HND = 1


class MaskMode(Enum):
    NON_CAUSAL = 0
    CAUSAL = 1
    CUSTOM = 2
