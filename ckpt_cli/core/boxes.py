"""A box of a tensor (an N-d offset + size, as DCP chunks and DTensor shards store it) as a tensor of its own, made of
the source's pieces without reading them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from ckpt_cli.core.model import FlatRange, Piece, TensorEntry, box_runs


def sub_box(entry: TensorEntry, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> TensorEntry:
    """The box `offsets` + `sizes` of `entry` as a tensor of its own: one flat piece per contiguous run of the box
    that one source piece holds (whole rows of a row range are one run; a column range is one run per row)."""
    if offsets == (0,) * len(entry.shape) and sizes == entry.shape:
        return dataclasses.replace(entry, name=name)
    if entry.derived is not None:  # computed as read (an Orbax array, a dequantized weight): the box reads it by runs
        return TensorEntry(name, entry.dtype, sizes, entry.role, entry.pieces, entry.path, derived=DerivedBox(entry, offsets, sizes))
    box = tuple(box_runs(offsets, sizes, entry.shape))
    if box and entry.made_by_range():  # only the source pieces the box's extent meets are made
        source = entry.runs_in(box[0][0], box[-1][0] + box[-1][1] - box[0][0])
    else:
        source = entry.runs()
    pieces, i = [], 0
    for gstart, length, lstart in box:
        end = gstart + length
        while i < len(source) and source[i][0] + source[i][1] <= gstart:
            i += 1
        j = i
        while j < len(source) and source[j][0] < end:
            g, n, piece, local = source[j]
            lo, hi = max(g, gstart), min(g + n, end)
            if lo < hi:
                pieces.append(Piece(FlatRange(lstart + lo - gstart, hi - lo), piece.data, local + lo - g))
            j += 1
    return TensorEntry(name, entry.dtype, sizes, entry.role, pieces, entry.path)


class DerivedBox:
    """A box of a computed tensor (core/model.Derived), read as the runs of the tensor it covers: a row range is one
    run, read in the tensor's own windows' size."""

    __slots__ = ("entry", "offsets", "sizes", "numel")

    def __init__(self, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        self.entry, self.offsets, self.sizes, self.numel = entry, offsets, sizes, math.prod(sizes)

    def windows(self) -> Iterator[tuple[int, int]]:
        from ckpt_cli.core.reading import BLOCK_BYTES

        step = max(BLOCK_BYTES // self.entry.dtype.itemsize, 1)
        for start in range(0, self.numel, step):
            yield start, min(step, self.numel - start)

    def read_raw(self, start: int, count: int, sources: Any) -> Any:
        """The elements' bytes (numpy uint8), each run through the source's own `window_bytes` (no torch for an Orbax
        array)."""
        import numpy as np

        from ckpt_cli.core.reading import window_bytes

        size = self.entry.dtype.itemsize
        out = np.empty(count * size, np.uint8)
        for gstart, length, lstart in box_runs(self.offsets, self.sizes, self.entry.shape):
            if lstart >= start + count:
                break
            lo, hi = max(lstart, start), min(lstart + length, start + count)
            if lo < hi:
                part = window_bytes(self.entry, self.entry.dtype, gstart + lo - lstart, hi - lo, sources)
                out[(lo - start) * size : (hi - start) * size] = part
        return out

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        return torch.from_numpy(self.read_raw(start, count, sources)).view(self.entry.dtype.torch())
