"""Two tensors' values compared as they stream: bytes first, then max |a-b|, relative L2 and cosine.

`verify --against` and `diff` compare through this. Both tensors are read window by window (at most
BLOCK_BYTES of stored elements, widened to float64 for the arithmetic), so memory stays a small
multiple of a window whatever the tensor's size. Tensors of the same dtype are compared as bytes
first: identical ones cost one read of each side, no arithmetic and (stored plainly) no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core.model import ZEROS, TensorEntry
from ckpt_cli.core.reading import BLOCK_BYTES, ByteRun, SourceFiles, byte_runs, element_windows, read_elements

WIDE = 8  # bytes per element of the arithmetic (float64)


@dataclass(slots=True)  # one per tensor compared that is not identical (those share IDENTICAL)
class ValueDiff:
    """How two tensors of one shape differ. Norms and the dot product run over the elements finite on both
    sides; `mismatched` counts the elements outside atol + rtol * |b| (as torch.isclose: NaN equals NaN)."""

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
    """The norms and the dot product over the elements finite on both sides (float64 windows)."""
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


def _add_window(diff: ValueDiff, u: Any, v: Any, atol: float, rtol: float) -> None:
    """One window of float64 values: the finite case in a few passes, NaN and infinities as torch.isclose has them."""
    import torch

    aa, bb, ab = float(torch.dot(u, u)), float(torch.dot(v, v)), float(torch.dot(u, v))
    if not (math.isfinite(aa) and math.isfinite(bb) and math.isfinite(ab)):  # a NaN or an infinity in the window
        _add_nonfinite_window(diff, u, v, atol, rtol)
        return
    diff.sq_a, diff.sq_b, diff.dot = diff.sq_a + aa, diff.sq_b + bb, diff.dot + ab
    gap = u - v
    diff.sq_diff += float(torch.dot(gap, gap))
    gap.abs_()
    worst = float(gap.max()) if gap.numel() else 0.0
    diff.max_abs = max(diff.max_abs, worst)
    if worst <= atol:
        return
    bound = v.abs().mul_(rtol).add_(atol) if rtol else atol
    diff.mismatched += int((gap > bound).sum())


def _add_nonfinite_window(diff: ValueDiff, u: Any, v: Any, atol: float, rtol: float) -> None:
    import torch

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


IDENTICAL = ValueDiff(identical=True)  # the result of every identical pair, shared (never changed): a diff of
# two copies of an 82,000-tensor checkpoint held one each (8 MB)


def compare_values(a: TensorEntry, b: TensorEntry, atol: float, rtol: float, sources_a: SourceFiles, sources_b: SourceFiles) -> ValueDiff:
    """Compare two tensors of the same shape, element by element, reading a window of each at a time."""
    diff = ValueDiff()
    begin = 0
    if a.dtype == b.dtype:
        first = first_difference(a, b, sources_a, sources_b)
        if first is None:
            return IDENTICAL
        begin = first - first % _STEP
    complex_pair = "complex" in a.dtype.name or "complex" in b.dtype.name
    with _one_thread():
        for start in range(0, begin, _STEP):  # identical so far: the norms still count
            u = _wide(read_elements(a, start, min(_STEP, begin - start), sources_a), complex_pair)
            _add_norms(diff, u, u)
        for start in range(begin, a.numel, _STEP):
            count = min(_STEP, a.numel - start)
            u = _wide(read_elements(a, start, count, sources_a), complex_pair)
            v = _wide(read_elements(b, start, count, sources_b), complex_pair)
            _add_window(diff, u, v, atol, rtol)
    return diff


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch's own threads for the window arithmetic: one. A window is a few MB, too small to gain from threads, and
    on a busy machine OpenMP workers spin against each other (a 1 GB diff took 13 s on one thread, 58 s on two)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_STEP = max(BLOCK_BYTES // WIDE, 1)  # elements of a float64 window


def first_difference(a: TensorEntry, b: TensorEntry, sources_a: SourceFiles, sources_b: SourceFiles) -> int | None:
    """Where two tensors of one dtype and shape start to differ: the first element of the first window whose bytes
    differ (None: identical). Plain stored bytes are compared as bytes, a window at a time, without torch; casts and strided pieces
    through torch."""
    runs_a, runs_b = byte_runs(a, a.dtype), byte_runs(b, b.dtype)
    itemsize = a.dtype.itemsize
    if runs_a is not None and runs_b is not None:
        window = min(max(BLOCK_BYTES // itemsize, 1), max(a.numel, 1)) * itemsize  # a small tensor: a small buffer
        for pos, (x, y) in enumerate(zip(_byte_windows(runs_a, sources_a, window), _byte_windows(runs_b, sources_b, window))):
            if x != y:
                return pos * window // itemsize
        return None
    import torch

    for start, count in element_windows(a):
        u, v = read_elements(a, start, count, sources_a), read_elements(b, start, count, sources_b)
        if not torch.equal(u.view(torch.uint8), v.view(torch.uint8)):
            return start
    return None


def _byte_windows(runs: list[ByteRun], sources: SourceFiles, size: int) -> Iterator[memoryview]:
    """The runs' bytes in windows of `size` (the last one shorter), in one buffer reused from window to window."""
    buf = memoryview(bytearray(size))
    filled = 0
    for path, offset, nbytes in runs:
        while nbytes:
            n = min(nbytes, size - filled)
            if path == ZEROS:
                buf[filled : filled + n] = bytes(n)
            else:
                sources.pread_into(path, offset, buf[filled : filled + n])
            filled, offset, nbytes = filled + n, offset + n, nbytes - n
            if filled == size:
                yield buf
                filled = 0
    if filled:
        yield buf[:filled]
