"""One tensor per index of a stacked axis (a name map's `unstack`), without reading it: the layers of a scanned JAX
model, which keeps every layer's kernel in one array with the layer axis inside it (MaxText's `param_scan_axis: 1`
puts it second: a query kernel [embed, layers, heads, head_dim]).

Layer i of a tensor stacked on axis k is, for each index of the axes before k, one run of the elements after it:
`prod(shape[:k])` ranges of `prod(shape[k+1:])` elements. A stored source becomes those ranges of its bytes
(core/names/row_split.py `gather`); a computed one that reads by boxes (an Orbax array) is read as the source's box with
axis k fixed at i (`Unstacked`), so that a reshape and a transpose after it still read whole boxes, never element by
element. (`split` with `layers: true` is the case k = 0 for stored tensors.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.model import TensorEntry
from ckpt_cli.core.names.row_split import LAYER, gather
from ckpt_cli.errors import UsageError


@dataclass(frozen=True)
class Unstack:
    """`{from: REGEX, axis: K, to: NAME}`: NAME holds {layer} and may use the match's groups (\\1, \\g<name>)."""

    pattern: str
    axis: int
    to: str

    @classmethod
    def parse(cls, item: Any, where: str) -> Unstack:
        if not isinstance(item, dict) or set(item) != {"from", "axis", "to"}:
            raise UsageError(f"{where}: each unstack is {{from: REGEX, axis: K, to: NAME with {LAYER}}}")
        axis, to = item["axis"], item["to"]
        if type(axis) is not int or axis < 0 or not isinstance(to, str) or LAYER not in to:
            raise UsageError(f"{where}: unstack '{item['from']}': axis is an integer >= 0 and 'to' a name holding {LAYER}")
        structured.regex(str(item["from"]), where)
        return cls(str(item["from"]), axis, to)

    def describe(self) -> str:
        return f"unstack /{self.pattern}/ on axis {self.axis} -> {self.to}"

    def apply(self, entry: TensorEntry, name: str) -> list[TensorEntry] | None:
        """One entry per index of the axis, or None when the pattern does not match `name`."""
        match = re.fullmatch(self.pattern, name)
        if match is None:
            return None
        shape, k = entry.shape, self.axis
        if k >= len(shape):
            raise UsageError(f"unstack of '{entry.name}' {list(shape)}: it has no axis {k}")
        if shape[k] > max(entry.numel, 1):  # each output holds >= 1 element: the loop is bounded by the data
            raise UsageError(f"unstack of '{entry.name}' {list(shape)}: {shape[k]} outputs of no elements")
        template = match.expand(self.to)
        out_shape = shape[:k] + shape[k + 1 :]
        outer, inner = math.prod(shape[:k]), math.prod(shape[k + 1 :])
        boxes = entry.derived is not None and getattr(entry.derived, "read_box", None) is not None
        out = []
        for i in range(shape[k]):
            new = template.replace(LAYER, str(i))
            if boxes:
                out.append(TensorEntry(new, entry.dtype, out_shape, entry.role, entry.pieces, (new,), derived=Unstacked(entry, k, i)))
            else:
                ranges = [((o * shape[k] + i) * inner, inner) for o in range(outer)]
                out.append(gather(entry, new, ranges, out_shape))
        return out


class Unstacked:
    """Index `index` of axis `axis` of a computed tensor that reads by boxes: every read is one box of the source
    (the output's box with that axis fixed), so its consumers (a reshape, a transpose) read by boxes too."""

    __slots__ = ("entry", "axis", "index", "shape")

    def __init__(self, entry: TensorEntry, axis: int, index: int) -> None:
        self.entry, self.axis, self.index = entry, axis, index
        self.shape = entry.shape[:axis] + entry.shape[axis + 1 :]

    def windows(self) -> Iterator[tuple[int, int]]:
        """Bands of whole rows of the output's first axis, BLOCK_BYTES at most (one row when a row is larger)."""
        from ckpt_cli.core.reading import BLOCK_BYTES

        if not self.shape:
            yield 0, 1
            return
        row = math.prod(self.shape[1:])
        band = max(1, BLOCK_BYTES // max(row * self.entry.dtype.itemsize, 1))
        for first in range(0, self.shape[0], band):
            yield first * row, min(band, self.shape[0] - first) * row

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        k = self.axis
        source = self.entry.derived
        return source.read_box((*offsets[:k], self.index, *offsets[k:]), (*sizes[:k], 1, *sizes[k:]))  # type: ignore[union-attr]

    def read(self, start: int, count: int, sources: Any) -> Any:
        """Elements [start, start + count), row-major: the box of the first-axis rows that hold them, cut."""
        if not self.shape:
            return self.read_box((), ())
        row = math.prod(self.shape[1:])
        if count == 0 or row == 0:
            return self.read_box((0,) * len(self.shape), (0, *self.shape[1:]))
        first, last = start // row, (start + count - 1) // row + 1
        box = self.read_box((first,) + (0,) * (len(self.shape) - 1), (last - first, *self.shape[1:]))
        return box[start - first * row : start - first * row + count]
