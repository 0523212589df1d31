"""A DCP tensor's located chunks, packed: three numbers and a shared box a chunk instead of five objects.

A 64-rank MoE checkpoint holds 581,160 chunks. As a Piece, a StoredArray, a zip Record and their integers each took
about 400 bytes, 230 MB in all: more than the `.metadata` they were read from. A chunk stored the usual way (its own
torch.save archive holding one contiguous tensor whose storage record is exactly its bytes) is kept as its file, the
offset of its bytes and their CRC32, and its pieces are made again whenever they are asked for (LazyPieces with
keep=False; a structural check and a write each walk them once). A tensor with any other chunk (a strided view,
a safetensors-serialized save) keeps its list of pieces as read.
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Sequence

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import Box, LazyPieces, Piece, StoredArray, contiguous_strides
from ckpt_cli.core.zipio import Record

FIELDS = 3  # numbers a chunk: index of its file, byte offset of its data, CRC32 of its data


class Paths:
    """The data files named by a checkpoint's chunks, each held once and referred to by number."""

    __slots__ = ("names", "numbers")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.numbers: dict[str, int] = {}

    def number(self, path: str) -> int:
        found = self.numbers.get(path)
        if found is None:
            found = self.numbers[path] = len(self.names)
            self.names.append(path)
        return found


class PackedChunks:
    """Makes a tensor's pieces from its packed chunks (the `make` of its LazyPieces)."""

    __slots__ = ("boxes", "numbers", "paths", "dtype", "record_name")

    def __init__(self, boxes: tuple[Box, ...], numbers: array, paths: Paths, dtype: DType, record_name: str) -> None:
        self.boxes, self.numbers, self.paths, self.dtype, self.record_name = boxes, numbers, paths, dtype, record_name

    # The pieces made last, for the next call: a tensor is asked for its pieces several times in a row (its check,
    # its plan, each window read), and made once then. One tensor's pieces, whichever thread asked.
    _last: tuple[PackedChunks, list[Piece]] | None = None

    def __call__(self) -> list[Piece]:
        last = PackedChunks._last
        if last is not None and last[0] is self:
            return last[1]
        pieces = self._make()
        PackedChunks._last = (self, pieces)
        return pieces

    def _make(self) -> list[Piece]:
        names, numbers, dtype, name = self.paths.names, self.numbers, self.dtype, self.record_name
        pieces = []
        for i, box in enumerate(self.boxes):
            file, offset, crc = numbers[FIELDS * i : FIELDS * i + FIELDS]
            shape = box.sizes
            strides, nbytes = _layout(shape, dtype.itemsize)
            array = StoredArray(names[file], offset, dtype, shape, strides, 0, Record(name, offset, nbytes, crc))
            pieces.append(Piece(box, array))
        return pieces


@functools.lru_cache(maxsize=1 << 12)  # a few distinct chunk shapes; the strides took a fifth of making a piece
def _layout(shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], int]:
    return contiguous_strides(shape), math.prod(shape) * itemsize


def _plain(piece: Piece, dtype: DType, record_name: str) -> bool:
    """A chunk the packing rebuilds exactly: its own contiguous array over a record that is exactly its bytes."""
    data, box = piece.data, piece.region
    record = data.record
    return (
        isinstance(box, Box)
        and piece.data_start == 0
        and record is not None
        and record.name == record_name
        and record.data_offset == data.offset
        and record.size == data.nbytes
        and data.dtype == dtype
        and data.storage_offset == 0
        and data.shape == box.sizes
        and data.stride == contiguous_strides(data.shape)
    )


def pack(pieces: list[Piece], dtype: DType, paths: Paths) -> Sequence[Piece]:
    """`pieces` packed behind a LazyPieces when each is a plain chunk and there are several, else as they are."""
    if len(pieces) < 2 or pieces[0].data.record is None:
        return pieces
    record_name = pieces[0].data.record.name
    if not all(_plain(p, dtype, record_name) for p in pieces):
        return pieces
    numbers = array("q")
    for p in pieces:
        numbers.extend((paths.number(p.data.path), p.data.offset, p.data.record.crc))  # type: ignore[union-attr]
    boxes = tuple(p.region for p in pieces)
    return LazyPieces(PackedChunks(boxes, numbers, paths, dtype, record_name), len(pieces), keep=False)  # type: ignore[arg-type]
