"""A DCP tensor's located chunks, packed: three numbers and a shared box a chunk instead of five objects.

A 64-rank MoE checkpoint holds 581,160 chunks. As a Piece, a StoredArray, a zip Record and their integers each took
about 400 bytes, 230 MB in all: more than the `.metadata` they were read from. A chunk stored the usual way (its own
torch.save archive holding one contiguous tensor whose storage record is exactly its bytes) is kept as its file, the
offset of its bytes and their CRC32, and its pieces are made again whenever they are asked for (LazyPieces with
keep=False; a structural check and a write each walk them once). A read of part of the tensor (a reshard cuts each
output chunk's box out of it, once per output file) makes only the chunks whose flat extent meets the range asked
for (`span`), found by bisection in an index shared by the tensors stored in the same boxes. A tensor with any other
chunk (a strided view, a safetensors-serialized save) keeps its list of pieces as read.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from array import array
from collections.abc import Iterable

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import Box, LazyPieces, Piece, StoredArray, contiguous_strides
from ckpt_cli.core.pickles.zipio import Record

FIELDS = 3  # numbers a chunk: index of its file, byte offset of its data, CRC32 of its data


class Paths:
    """The data files named by a checkpoint's chunks, each held once and referred to by number; and the boxes the
    tensors are stored in, each distinct tuple of boxes (thousands of tensors, a few layouts) held once with its index."""

    __slots__ = ("names", "numbers", "layouts")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.numbers: dict[str, int] = {}
        self.layouts: dict[tuple[tuple[Box, ...], tuple[int, ...]], Extents] = {}

    def number(self, path: str) -> int:
        found = self.numbers.get(path)
        if found is None:
            found = self.numbers[path] = len(self.names)
            self.names.append(path)
        return found


class Extents:
    """A tuple of boxes a tensor is stored in (held once for all the tensors stored alike) and, once a range is asked
    for, the flat extent of each box (first element, one past its last: a box that is not whole rows has elements of
    other boxes between), sorted by first element with the running largest end, so that the boxes meeting a flat
    range are found by bisection."""

    __slots__ = ("boxes", "shape", "order", "starts", "reach")

    def __init__(self, boxes: tuple[Box, ...], shape: tuple[int, ...]) -> None:
        self.boxes, self.shape = boxes, shape
        self.order = self.starts = self.reach = array("q")

    def _index(self) -> None:
        strides = contiguous_strides(self.shape)
        spans = []
        for i, box in enumerate(self.boxes):
            if 0 in box.sizes:
                continue  # an empty chunk holds no element
            first = sum(o * s for o, s in zip(box.offsets, strides))
            last = sum((o + n - 1) * s for o, n, s in zip(box.offsets, box.sizes, strides))
            spans.append((first, last + 1, i))
        spans.sort()
        self.starts = array("q", (first for first, _, _ in spans))
        self.reach = array("q", itertools.accumulate((end for _, end, _ in spans), max))
        self.order = array("q", (i for _, _, i in spans))  # last: a thread that finds it made finds the others made

    def meeting(self, start: int, count: int) -> list[int]:
        """The boxes (by index) whose extent meets elements [start, start + count)."""
        if not self.order and self.boxes:
            self._index()
        lo = bisect.bisect_right(self.reach, start)  # before lo every box ends at or before `start`
        hi = bisect.bisect_left(self.starts, start + count)  # from hi every box starts at or after the range's end
        return [self.order[k] for k in range(lo, hi)]


class PackedChunks:
    """Makes a tensor's pieces from its packed chunks (the `make` and `span` of its LazyPieces)."""

    __slots__ = ("extents", "numbers", "paths", "dtype", "record_name")

    def __init__(self, extents: Extents, numbers: array, paths: Paths, dtype: DType, record_name: str) -> None:
        self.extents, self.numbers, self.paths, self.dtype, self.record_name = extents, numbers, paths, dtype, record_name

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

    def span(self, start: int, count: int) -> list[Piece]:
        """The pieces of the chunks that may hold elements [start, start + count): the rest are not made."""
        return self._make(self.extents.meeting(start, count))

    def _make(self, which: Iterable[int] | None = None) -> list[Piece]:
        names, numbers, dtype, name, boxes = self.paths.names, self.numbers, self.dtype, self.record_name, self.extents.boxes
        pieces = []
        for i in range(len(boxes)) if which is None else which:
            box = boxes[i]
            file, offset, crc = numbers[FIELDS * i : FIELDS * i + FIELDS]
            shape = box.sizes
            strides, nbytes = _layout(shape, dtype.itemsize)
            array = StoredArray(names[file], offset, dtype, shape, strides, 0, Record(name, offset, nbytes, crc))
            pieces.append(Piece(box, array))
        return pieces


@functools.lru_cache(maxsize=1 << 12)  # a few distinct chunk shapes; the strides took a fifth of making a piece
def _layout(shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], int]:
    return contiguous_strides(shape), math.prod(shape) * itemsize


def _plain(piece: Piece, dtype: DType, record_name: str) -> tuple[Record, Box] | None:
    """A chunk the packing rebuilds exactly (its own contiguous array over a record that is exactly its bytes): its
    record and box; else None."""
    data, box = piece.data, piece.region
    record = data.record
    plain = (
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
    return (record, box) if plain and record is not None and isinstance(box, Box) else None


def pack(pieces: list[Piece], dtype: DType, shape: tuple[int, ...], paths: Paths) -> list[Piece] | LazyPieces:
    """`pieces` packed behind a LazyPieces when each is a plain chunk and there are several, else as they are."""
    if len(pieces) < 2 or pieces[0].data.record is None:
        return pieces
    record_name = pieces[0].data.record.name
    plain: list[tuple[Record, Box]] = []
    for p in pieces:
        found = _plain(p, dtype, record_name)
        if found is None:
            return pieces
        plain.append(found)
    numbers = array("q")
    for p, (record, _) in zip(pieces, plain):
        numbers.extend((paths.number(p.data.path), p.data.offset, record.crc))
    boxes = tuple(box for _, box in plain)
    extents = paths.layouts.setdefault((boxes, shape), Extents(boxes, shape))
    packed = PackedChunks(extents, numbers, paths, dtype, record_name)
    return LazyPieces(packed, len(pieces), span=packed.span, keep=False)
