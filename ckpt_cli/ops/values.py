"""Two tensors' values compared as they stream: bytes first, then max |a-b|, relative L2 and cosine.

`verify --against` and `diff` compare through this. Both tensors are read window by window (at most
BLOCK_BYTES of stored elements, widened to float64 for the arithmetic), so memory stays a small
multiple of a window whatever the tensor's size. Tensors of the same dtype are compared as bytes
first: identical ones cost one read of each side and no arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core.model import TensorEntry
from ckpt_cli.core.reading import BLOCK_BYTES, SourceFiles, element_windows, read_elements

WIDE = 8  # bytes per element of the arithmetic (float64)


@dataclass
class ValueDiff:
    """How two tensors of one shape differ. Norms and the dot product run over the elements finite on both
    sides; `mismatched` counts the elements outside atol + rtol * |b| (as torch.isclose: NaN equals NaN)."""

    numel: int
    dtype_equal: bool
    identical: bool = False  # same dtype and the same bytes
    mismatched: int = 0
    max_abs: float = 0.0  # inf where a side is NaN or infinite and the other is not
    sq_diff: float = 0.0
    sq_a: float = 0.0
    sq_b: float = 0.0
    dot: float = 0.0

    def within(self, atol: float, rtol: float) -> bool:
        """Equal within the tolerance; with none, the same dtype and bytes (bit-exact)."""
        if atol == 0 and rtol == 0:
            return self.identical
        return self.identical or self.mismatched == 0

    @property
    def rel_l2(self) -> float:
        """||a - b|| / ||a|| (0 when both are zero, inf when only a is)."""
        if self.identical or self.sq_diff == 0:
            return 0.0
        return math.sqrt(self.sq_diff / self.sq_a) if self.sq_a else math.inf

    @property
    def cosine(self) -> float | None:
        """a . b / (||a|| ||b||); None when one side is all zeros and the other is not."""
        if self.identical or (self.sq_a == 0 and self.sq_b == 0):
            return 1.0
        if self.sq_a == 0 or self.sq_b == 0:
            return None
        return max(-1.0, min(1.0, self.dot / math.sqrt(self.sq_a * self.sq_b)))


def _add_norms(diff: ValueDiff, u: Any, v: Any) -> None:
    import torch

    finite = torch.isfinite(u) & torch.isfinite(v)
    uf, vf = torch.where(finite, u, 0.0), torch.where(finite, v, 0.0)
    diff.sq_a += float(torch.dot(uf, uf))
    diff.sq_b += float(torch.dot(vf, vf))
    diff.dot += float(torch.dot(uf, vf))
    uf.sub_(vf)
    diff.sq_diff += float(torch.dot(uf, uf))


def _wide(values: Any, complex_pair: bool) -> Any:
    """float64 for the arithmetic; with `complex_pair` (a side is complex), real and imaginary parts side by side."""
    import torch

    if not complex_pair:
        return values.to(torch.float64)
    if not values.is_complex():
        values = torch.complex(values.to(torch.float64), torch.zeros(values.shape, dtype=torch.float64))
    return torch.view_as_real(values).reshape(-1).to(torch.float64)


def _add_window(diff: ValueDiff, u: Any, v: Any, atol: float, rtol: float, complex_pair: bool) -> None:
    import torch

    u, v = _wide(u, complex_pair), _wide(v, complex_pair)
    close = torch.isclose(u, v, rtol=rtol, atol=atol, equal_nan=True)
    diff.mismatched += int((~close).sum())
    gap = (u - v).abs_()
    gap.masked_fill_(torch.isnan(u) & torch.isnan(v), 0.0)  # NaN against NaN: no difference
    gap.masked_fill_(torch.isnan(gap), math.inf)  # NaN against a number, or inf against inf of the other sign
    gap.masked_fill_(torch.isinf(u) & (u == v), 0.0)  # the same infinity
    if gap.numel():
        diff.max_abs = max(diff.max_abs, float(gap.max()))
    del gap, close
    _add_norms(diff, u, v)


def compare_values(a: TensorEntry, b: TensorEntry, atol: float, rtol: float, sources_a: SourceFiles, sources_b: SourceFiles) -> ValueDiff:
    """Compare two tensors of the same shape, element by element, reading a window of each at a time."""
    import torch

    diff = ValueDiff(a.numel, a.dtype == b.dtype)
    complex_pair = "complex" in a.dtype.name or "complex" in b.dtype.name
    begin = 0
    if diff.dtype_equal:
        first = None
        for start, count in element_windows(a):
            u, v = read_elements(a, start, count, sources_a), read_elements(b, start, count, sources_b)
            if not torch.equal(u.view(torch.uint8), v.view(torch.uint8)):
                first = start
                break
        if first is None:
            diff.identical = True
            return diff
        for start, count in _windows(0, first):  # equal so far: their norms still count
            u = _wide(read_elements(a, start, count, sources_a), complex_pair)
            _add_norms(diff, u, u)
        begin = first
    for start, count in _windows(begin, a.numel):
        _add_window(diff, read_elements(a, start, count, sources_a), read_elements(b, start, count, sources_b), atol, rtol, complex_pair)
    return diff


def _windows(begin: int, end: int) -> list[tuple[int, int]]:
    """Windows of float64 size covering elements [begin, end)."""
    step = max(BLOCK_BYTES // WIDE, 1)
    return [(s, min(step, end - s)) for s in range(begin, end, step)]
