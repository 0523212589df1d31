"""NaN and Inf counted from the bits of IEEE floats, block by block, in the same pass that reads the bytes for
digests (`verify --finite` beside `--deep` or a manifest reads each tensor once, and needs no torch).

An IEEE value is not finite when its exponent bits are all ones: Inf when the mantissa is zero, NaN otherwise.
float8 formats do not all follow that rule (e4m3fn has no Inf and one NaN pattern), so they are counted
through torch by the caller.
"""

from __future__ import annotations

from typing import Any

# dtype name -> (unsigned integer type of its width, exponent mask, mantissa mask)
_IEEE = {
    "float16": ("<u2", 0x7C00, 0x03FF),
    "bfloat16": ("<u2", 0x7F80, 0x007F),
    "float32": ("<u4", 0x7F800000, 0x007FFFFF),
    "float64": ("<u8", 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
}


class NonFinite:
    """Counts of NaN and Inf in the little-endian bytes fed to update(), in element-aligned blocks."""

    def __init__(self, dtype_name: str) -> None:
        self.int_type, self.exponent, self.mantissa = _IEEE[dtype_name]
        self.nan = self.inf = 0

    @staticmethod
    def handles(dtype_name: str) -> bool:
        return dtype_name in _IEEE

    def update(self, block: Any) -> None:
        import numpy as np

        bits = np.frombuffer(block, dtype=self.int_type)
        special = (bits & self.exponent) == self.exponent
        if not special.any():  # the common case: one pass over the block, one reduction
            return
        fraction = (bits[special] & self.mantissa) != 0
        nans = int(np.count_nonzero(fraction))
        self.nan += nans
        self.inf += len(fraction) - nans
