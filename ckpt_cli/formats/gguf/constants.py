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


# --- appended for the reader ---------------------------------------------------------------------------------------
# Every type ggml.h defines (GGML_TYPE_COUNT = 43), with its block, as gguf-py's GGML_QUANT_SIZES has it: a file may
# hold types ckpt does not dequantize (the IQ and ternary ones); their layout is still known, so inspect and verify read
# them. Ids 4, 5, 31-33 and 36-38 were removed from ggml and are refused as unknown.
ALL_BLOCKS: dict[int, tuple[str, int, int]] = {
    **{int(t): (t.name, *BLOCKS[t]) for t in TensorType},
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    29: ("IQ1_M", 256, 56),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
TYPE_COUNT = 43  # ggml.h GGML_TYPE_COUNT: ggml refuses a tensor type id at or past it
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: ggml refuses a tensor name of this many bytes or more
MAX_STRING = 1 << 30  # gguf.cpp GGUF_MAX_STRING_LENGTH
MAX_ARRAY = 1 << 30  # gguf.cpp GGUF_MAX_ARRAY_ELEMENTS
# Bytes of each fixed-size value type (STRING and ARRAY have their own encoding)
VALUE_SIZES: dict[ValueType, tuple[int, str]] = {
    ValueType.UINT8: (1, "<B"),
    ValueType.INT8: (1, "<b"),
    ValueType.UINT16: (2, "<H"),
    ValueType.INT16: (2, "<h"),
    ValueType.UINT32: (4, "<I"),
    ValueType.INT32: (4, "<i"),
    ValueType.FLOAT32: (4, "<f"),
    ValueType.BOOL: (1, "<?"),
    ValueType.UINT64: (8, "<Q"),
    ValueType.INT64: (8, "<q"),
    ValueType.FLOAT64: (8, "<d"),
}
