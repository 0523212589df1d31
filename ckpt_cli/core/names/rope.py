"""The rotary-embedding row order of q/k projections, changed without reading the tensor (a name map's `permute`).

Rotary embeddings rotate pairs of a head's dimensions. Meta's Llama code and torchtitan pair rows 2i and 2i+1 of
each head (`interleaved`: they view the head as complex numbers); Hugging Face's Llama family pairs row i with row
i + head_dim/2 (`halves`: `rotate_half`). The same weights in the other convention are the rows permuted within
each head, which is what Hugging Face's convert_llama_weights_to_hf.py and torchtitan's state-dict adapter do:

    interleaved -> halves:  w.view(heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    halves -> interleaved:  w.view(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)

Every output row is one source row, so the permuted tensor is a list of row ranges of the source's stored bytes
(core/names/row_split.py `_gather`): the export copies them as bytes, with no torch and no buffer beyond a row, and the
values are the source's, moved, never changed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ckpt_cli.core.model import Box, LazyPieces, Piece, StoredArray, TensorEntry
from ckpt_cli.core.names.row_split import gather
from ckpt_cli.errors import UsageError

LAYOUTS = ("interleaved", "halves")


def source_rows(heads: int, head_dim: int, to_halves: bool) -> list[int]:
    """For each output row in order, the source row it is: within head h, output row j * head_dim/2 + i is source
    row 2i + j (interleaved -> halves), and the other way round."""
    half = head_dim // 2
    if to_halves:
        within = [2 * i + j for j in range(2) for i in range(half)]
    else:
        within = [i // 2 + (i % 2) * half for i in range(head_dim)]
    return [h * head_dim + r for h in range(heads) for r in within]


def permuted(entry: TensorEntry, name: str, heads: int, to: str) -> TensorEntry:
    """`entry` under `name` with each head's rows in the `to` rotary layout, pointing at the source's bytes."""
    if to not in LAYOUTS:
        raise UsageError(f"permute of '{entry.name}': rope layout is one of {', '.join(LAYOUTS)}, not '{to}'")
    rows = entry.shape[0] if entry.shape else 0
    if heads < 1 or rows % heads or (rows // heads) % 2:
        raise UsageError(
            f"permute of '{entry.name}' {list(entry.shape)}: {rows} rows are not {heads} heads of an even head_dim; "
            "check the head count the map takes from the config"
        )
    row, to_halves = math.prod(entry.shape[1:]), to == "halves"
    if entry.derived is not None:  # a computed tensor: its rows read through it, in the permuted order
        ranges = [(r * row, row) for r in source_rows(heads, rows // heads, to_halves)]
        return gather(entry, name, ranges, entry.shape)

    def pieces() -> list[Piece]:
        ranges = [(r * row, row) for r in source_rows(heads, rows // heads, to_halves)]
        return list(gather(entry, name, ranges, entry.shape).pieces)

    # One piece per row, made when the tensor is read and not kept: an export holds one tensor's rows at a time
    # (a 70B model's q/k have 600,000 rows), not every permuted tensor's
    lazy = LazyPieces(pieces, keep=False, arrays=entry.stored_arrays)
    return TensorEntry(name, entry.dtype, entry.shape, entry.role, lazy, (name,))


def transposed(entry: TensorEntry, name: str) -> TensorEntry:
    """A 2-D `entry` [rows, cols] as [cols, rows] (a name map's `transpose`: GPT-2's Conv1D keeps Linear weights
    transposed), without reading it: each stored piece of whole rows becomes a strided view of the same bytes (a
    column block of the result); the export reads such a view through torch, one piece at a time."""
    if len(entry.shape) != 2:
        raise UsageError(f"transpose of '{entry.name}' {list(entry.shape)}: only 2-D tensors transpose")
    rows, cols = entry.shape
    if entry.derived is not None:  # a computed tensor (an Orbax array): read by boxes of its columns, if it can be
        if getattr(entry.derived, "read_box", None) is None:
            raise UsageError(f"transpose of '{entry.name}': a computed tensor, which ckpt cannot read by columns")
        return TensorEntry(name, entry.dtype, (cols, rows), entry.role, entry.pieces, (name,), derived=Columns(entry, rows, cols))
    pieces = []
    for start, length, piece, local in entry.runs():
        data = piece.data
        if start % cols or length % cols or not data.is_contiguous:
            raise UsageError(f"transpose of '{entry.name}': a stored piece holds part of a row; ckpt transposes whole stored rows")
        r0, n = start // cols, length // cols
        view = StoredArray(data.path, data.offset, data.dtype, (cols, n), (1, cols), data.storage_offset + local, data.record)
        pieces.append(Piece(Box((0, r0), (cols, n)), view))
    return TensorEntry(name, entry.dtype, (cols, rows), entry.role, pieces, (name,))


class Columns:
    """A computed 2-D tensor [rows, cols] read as its transpose [cols, rows]: a window of output rows is a box of the
    source's columns (its `derived.read_box(offsets, sizes)`), transposed in memory; at most BLOCK_BYTES of them."""

    __slots__ = ("entry", "rows", "cols")

    def __init__(self, entry: TensorEntry, rows: int, cols: int) -> None:
        self.entry, self.rows, self.cols = entry, rows, cols

    def windows(self) -> Iterator[tuple[int, int]]:
        from ckpt_cli.core.reading import BLOCK_BYTES

        band = max(1, BLOCK_BYTES // max(self.rows * self.entry.dtype.itemsize, 1))
        for first in range(0, self.cols, band):
            yield first * self.rows, min(band, self.cols - first) * self.rows

    def read(self, start: int, count: int, sources: Any) -> Any:
        if count == 0 or self.rows == 0:
            return self.entry.derived.read(0, 0, sources)  # type: ignore[union-attr]
        first, last = start // self.rows, (start + count - 1) // self.rows + 1
        box = self.entry.derived.read_box((0, first), (self.rows, last - first))  # type: ignore[union-attr]
        flat = box.reshape(self.rows, last - first).t().contiguous().reshape(-1)
        return flat[start - first * self.rows : start - first * self.rows + count]
