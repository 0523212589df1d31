"""GGUF's numbers, as llama.cpp's gguf-py (gguf/constants.py) and ggml.h define them: the file's magic and version, the
metadata value types, and each tensor type's block (elements per block, bytes per block)."""

from __future__ import annotations

import enum

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32  # `general.alignment` when the file does not set it


class ValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class TensorType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30


# (elements per block, bytes per block): a row of n elements takes n // block * bytes
BLOCKS: dict[TensorType, tuple[int, int]] = {
    TensorType.F32: (1, 4),
    TensorType.F16: (1, 2),
    TensorType.Q4_0: (32, 18),
    TensorType.Q4_1: (32, 20),
    TensorType.Q5_0: (32, 22),
    TensorType.Q5_1: (32, 24),
    TensorType.Q8_0: (32, 34),
    TensorType.Q8_1: (32, 40),
    TensorType.Q2_K: (256, 84),
    TensorType.Q3_K: (256, 110),
    TensorType.Q4_K: (256, 144),
    TensorType.Q5_K: (256, 176),
    TensorType.Q6_K: (256, 210),
    TensorType.Q8_K: (256, 292),
    TensorType.I8: (1, 1),
    TensorType.I16: (1, 2),
    TensorType.I32: (1, 4),
    TensorType.I64: (1, 8),
    TensorType.F64: (1, 8),
    TensorType.BF16: (1, 2),
}


def nbytes(kind: TensorType, elements: int) -> int:
    """The bytes `elements` values of `kind` take; elements must be a whole number of blocks."""
    block, size = BLOCKS[kind]
    return elements // block * size
