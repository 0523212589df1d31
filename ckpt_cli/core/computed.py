"""Tensors computed from other tensors as they are read, that the writers lay out (a computed tensor is one whose
`derived` reads it: an Orbax array, a dequantized weight, a merged LoRA weight): cast to another dtype, and placed in
the flat partitions of a ZeRO optimizer, where a stored tensor's pieces would be (core/model.lazy_flat)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import FlatLayout, FlatPart, LazyPieces, TensorEntry, lazy_flat
from ckpt_cli.core.reading import BLOCK_BYTES, element_windows, read_elements


def flat(name: str, dtype: DType, length: int, parts: list[FlatPart], role: str = "other") -> TensorEntry:
    """core/model.lazy_flat, or where a part is a computed tensor, a flat read through the parts' own reads."""
    if not any(p[1].derived is not None for p in parts):
        return lazy_flat(name, dtype, length, parts, role)
    parts = sorted((p for p in parts if p[3] > 0), key=lambda p: p[0])
    layout = FlatLayout(dtype, length, parts, [p[0] for p in parts])
    return TensorEntry(name, dtype, (length,), role, LazyPieces(layout, keep=False), derived=ComputedFlat(layout))


class Cast:
    """A tensor read through another, as another dtype (a computed tensor in a training dtype, optax's int32 `count`
    as torch's float32 `step`): the source's windows, each read and cast."""

    __slots__ = ("entry", "dtype")

    def __init__(self, entry: TensorEntry, dtype: DType) -> None:
        self.entry, self.dtype = entry, dtype

    def windows(self) -> Iterator[tuple[int, int]]:
        return element_windows(self.entry)

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        return torch.as_tensor(read_elements(self.entry, start, count, sources)).to(self.dtype.torch())


class ComputedFlat:
    """A lazy_flat whose parts are computed tensors: a window is read part by part through their own `derived`
    (or their stored bytes), zeros between, cast to the flat's dtype; BLOCK_BYTES at a time."""

    __slots__ = ("layout",)

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout

    def windows(self) -> Iterator[tuple[int, int]]:
        step = max(1, BLOCK_BYTES // self.layout.dtype.itemsize)
        for start in range(0, self.layout.length, step):
            yield start, min(step, self.layout.length - start)

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        layout, end = self.layout, start + count
        out = torch.zeros(count, dtype=layout.dtype.torch())
        for i in range(max(0, bisect.bisect_right(layout.starts, start) - 1), len(layout.parts)):
            at, source, src_start, n = layout.parts[i]
            if at >= end:
                break
            lo, hi = max(at, start), min(at + n, end)
            if lo < hi:
                out[lo - start : hi - start] = torch.as_tensor(read_elements(source, src_start + lo - at, hi - lo, sources))
        return out
