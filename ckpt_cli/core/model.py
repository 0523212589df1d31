"""The logical model every format reads into and writes from.

A checkpoint is a set of logical tensors (name, dtype, global shape, role) and non-tensor objects.
Each tensor is stored as one or more *pieces*: an N-d box of the global tensor (DCP chunks, row
shards) or a flat element range of it (DeepSpeed ZeRO partitions). A piece points at a
`StoredArray`, a strided array at a byte offset of a file, so data is read lazily.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, final

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.pickles.zipio import Record
from ckpt_cli.errors import DataError

ROLES = ("model", "optimizer", "other")
PathKey = tuple[str | int, ...]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=1 << 12)  # a few distinct layouts, asked for every chunk a write copies
def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return all(st == want for sz, st, want in zip(shape, stride, contiguous_strides(shape)) if sz != 1)


@dataclass(frozen=True, slots=True)  # slots: a wide checkpoint holds one per chunk (200,000 at 64 ranks)
class StoredArray:
    """A strided array stored at `offset` (byte position of storage element 0) in `path`."""

    path: str
    offset: int
    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0  # elements
    record: Record | None = field(default=None, compare=False)  # the zip record holding the storage: checked while copied

    def __post_init__(self) -> None:
        # A view that starts before its storage or steps backwards would read bytes outside it.
        if self.offset < 0 or self.storage_offset < 0 or len(self.stride) != len(self.shape) or any(st < 0 for st in self.stride):
            raise DataError(f"{self.path}: a tensor view with a negative offset or stride")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self.numel <= 1 or _contiguous(self.shape, self.stride)

    def extent(self) -> tuple[int, int]:
        """Byte range [start, end) of the file that the elements occupy (empty arrays: start == end)."""
        start = self.offset + self.storage_offset * self.dtype.itemsize
        if self.numel == 0:
            return start, start
        last = sum((n - 1) * st for n, st in zip(self.shape, self.stride))
        return start, start + (last + 1) * self.dtype.itemsize


ZEROS = "<zeros>"  # the `path` of a stored array that is all zeros and lives nowhere (padding a writer adds)


def zeros(dtype: DType, numel: int) -> StoredArray:
    return StoredArray(ZEROS, 0, dtype, (numel,), (1,))


@final  # `type(region) is Box` then tells the checker the rest are FlatRanges
@dataclass(frozen=True, slots=True)
class Box:
    """An N-d box of the global tensor: `offsets` and `sizes` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@final
@dataclass(frozen=True, slots=True)
class FlatRange:
    """Elements [start, start + length) of the flattened (row-major) global tensor."""

    start: int
    length: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a logical tensor: `region` of the global tensor is held by `data`.

    For a flat range, its elements are those of `data` (row-major) from `data_start` on, which
    lets a piece be a slice of a larger stored array (a DeepSpeed partition, a resharded chunk).
    """

    region: Box | FlatRange
    data: StoredArray
    data_start: int = 0

    def runs(self, shape: tuple[int, ...]) -> Iterable[tuple[int, int, int]]:
        """Contiguous runs (global flat start, length, local flat start) this piece covers, in order."""
        region = self.region
        if type(region) is FlatRange:
            return ((region.start, region.length, self.data_start),) if region.length else ()
        return box_runs(region.offsets, region.sizes, shape)


def box_runs(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> Iterable[tuple[int, int, int]]:
    """Row-major runs of a box: one run when the box spans whole trailing dims (FSDP row shards). Boxes of a few runs
    are remembered: a wide write cuts the same few boxes out of thousands of tensors, once per output chunk."""
    few = _few_runs(offsets, sizes, shape)
    return few if few is not None else _box_runs(offsets, sizes, shape)


@functools.lru_cache(maxsize=4096)
def _few_runs(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int, int], ...] | None:
    """The box's runs when there are at most 8 (None: more; a column split of a large matrix has one per row)."""
    runs = tuple(itertools.islice(_box_runs(offsets, sizes, shape), 9))
    return runs if len(runs) <= 8 else None


def _box_runs(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    ndim = len(shape)
    if ndim == 0:
        yield 0, 1, 0
        return
    if 0 in sizes:
        return
    full_from = ndim  # dims [full_from, ndim) are covered whole
    while full_from > 0 and offsets[full_from - 1] == 0 and sizes[full_from - 1] == shape[full_from - 1]:
        full_from -= 1
    if full_from == 0:
        yield 0, math.prod(shape), 0
        return
    gstride = contiguous_strides(shape)
    lstride = contiguous_strides(sizes)
    run_dim = full_from - 1
    run_len = sizes[run_dim] * gstride[run_dim]
    for idx in itertools.product(*(range(sizes[d]) for d in range(run_dim))):
        gstart = offsets[run_dim] * gstride[run_dim]
        gstart += sum((offsets[d] + i) * gstride[d] for d, i in enumerate(idx))
        lstart = sum(i * lstride[d] for d, i in enumerate(idx))
        yield gstart, run_len, lstart


Run = tuple[int, int, Piece, int]  # a tensor's contiguous run: (global flat start, length, piece, local flat start)


class RangeLayout(Protocol):
    """A tensor's pieces by a layout's arithmetic (one slotted object per tensor, not three closures: a ZeRO-3 MoE
    checkpoint holds 82,000): all of them when called, those meeting a flat range, the stored arrays they lie in."""

    def __call__(self) -> list[Piece]: ...

    def span(self, start: int, count: int) -> list[Piece]: ...

    def arrays(self) -> Sequence[StoredArray]: ...


class LazyPieces(Sequence["Piece"]):
    """A tensor's pieces, made when first asked for: `inspect` of a ZeRO-3 checkpoint of 64 ranks reports 6,000
    tensors and needs none of their 384,000 pieces. Tensors that share one (tied weights) are tied.

    With `span` (the pieces overlapping a flat range, by the layout's arithmetic) they are never kept: a read takes
    the few pieces each window overlaps, and a tensor of 1,024 ranks' pieces costs its memory only while it is read
    (8,000 such tensors held every piece they ever made: 900 MB).

    With `keep=False` they are made again whenever asked for (a few partitions' arithmetic): a ZeRO-2 checkpoint of
    82,000 tensors would otherwise hold every piece that its structural check made, through the whole write.

    With `layout` (a RangeLayout), it makes them, those of a range and the arrays, as `make`, `span` and `arrays`.

    Slotted, and empty as a shared tuple: an MoE checkpoint of 82,000 tensors holds one per tensor."""

    __slots__ = ("_make", "_remake", "_pieces", "_count", "_keep", "by_layout", "_span", "_arrays", "_layout")

    def __init__(
        self,
        make: Callable[[], list[Piece]],
        count: int | None = None,
        by_layout: bool = False,
        span: Callable[[int, int], list[Piece]] | None = None,
        arrays: Callable[[], Sequence[StoredArray]] | None = None,
        keep: bool = True,
        layout: RangeLayout | None = None,
    ) -> None:
        self._make: Callable[[], list[Piece]] | None = make
        self._remake = make
        self._pieces: Sequence[Piece] = ()
        self._count = count  # how many `make` will return, when the layout tells without making them
        self._keep = keep and span is None and layout is None
        # Made by a layout's arithmetic over arrays whose sizes the reader checked: they tile the tensor and stay
        # inside their arrays by construction, so the structural check need not make and walk them.
        self.by_layout = by_layout
        self._span, self._arrays, self._layout = span, arrays, layout

    @classmethod
    def of(cls, layout: RangeLayout, count: int) -> LazyPieces:
        """The pieces `layout` makes (by its arithmetic: `by_layout`), never kept."""
        return cls(layout, count, by_layout=True, layout=layout)

    @property
    def span(self) -> Callable[[int, int], list[Piece]] | None:
        """The pieces overlapping a flat range, when the layout can tell them without making the rest."""
        return self._layout.span if self._layout is not None else self._span

    @property
    def layout(self) -> RangeLayout | None:
        return self._layout

    @property
    def arrays(self) -> Callable[[], Sequence[StoredArray]] | None:
        """With `span`: the stored arrays its pieces lie in (each rank's flat), without making them."""
        return self._layout.arrays if self._layout is not None else self._arrays

    def _all(self) -> Sequence[Piece]:
        if not self._keep and self._make is not None:
            return self._make()  # made again when asked again: see the class docstring
        if self._make is not None:
            self._pieces, self._make = self._make(), None
        return self._pieces

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]

    def release(self) -> None:
        """Forget the pieces made (made again when asked for): a diff of two wide checkpoints holds one tensor's at a time."""
        self._pieces, self._make = (), self._remake

    def __len__(self) -> int:
        return self._count if self._make is not None and self._count is not None else len(self._all())

    def __iter__(self) -> Iterator[Piece]:
        return iter(self._all())


class Derived(Protocol):
    """How a tensor that is computed, not stored, is read: in windows of its elements (row-major) that its
    computation makes whole (a block row of a block-scaled weight, one expert). `pieces` of such a tensor are those
    of the tensors it is computed from (the files it reads)."""

    def windows(self) -> Iterator[tuple[int, int]]: ...

    def read(self, start: int, count: int, sources: Any) -> Any: ...


@dataclass(slots=True)  # slots: an MoE checkpoint holds one per stored tensor (82,000 at ZeRO-2)
class TensorEntry:
    """A logical tensor. `dtype` is what it presents; pieces whose stored dtype differs are cast."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    role: str
    pieces: list[Piece] | LazyPieces
    path: PathKey = ()  # key path in the source's nesting (state-dict keys), for nested writers
    copy_of: str | None = None  # another tensor this one is a lower-precision or duplicate copy of (written once)
    derived: Derived | None = None  # computed from other tensors as it is read (a dequantized weight), not stored
    # Set once: a write plan asks for every segment's size many times, and shapes do not change (not a cached_property:
    # Python 3.11's takes one lock for all instances, which the writing threads then queue on).
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.path:
            self.path = (self.name,)
        self.numel = math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def runs(self) -> list[Run]:
        """All (global start, length, piece, local start) runs sorted by global position."""
        return self._sorted_runs(self.pieces)

    def made_by_range(self) -> bool:
        """Whether its pieces are made for the range a read asks for (never all at once: see LazyPieces)."""
        return isinstance(self.pieces, LazyPieces) and self.pieces.span is not None

    def runs_in(self, start: int, count: int) -> list[Run]:
        """The runs that hold elements [start, start + count) (a layout that can tell makes only those pieces)."""
        pieces = self.pieces
        if isinstance(pieces, LazyPieces) and pieces.span is not None:
            return [r for r in self._sorted_runs(pieces.span(start, count)) if r[0] < start + count and r[0] + r[1] > start]
        return [r for r in self._sorted_runs(pieces) if r[0] < start + count and r[0] + r[1] > start]

    def stored_arrays(self) -> Sequence[StoredArray]:
        """The stored arrays the tensor's pieces lie in (what a write reads and checks), made piece by piece only
        where the layout cannot tell them at once."""
        pieces = self.pieces
        if isinstance(pieces, LazyPieces) and pieces.arrays is not None:
            return pieces.arrays()
        return [p.data for p in pieces]

    def _sorted_runs(self, pieces: Iterable[Piece]) -> list[Run]:
        out = [(g, n, p, loc) for p in pieces for g, n, loc in p.runs(self.shape)]
        if len(out) > 1:
            out.sort(key=lambda r: (r[0], r[1]))
        return out

    def tiling_problem(self) -> str | None:
        """Why the pieces do not cover the tensor exactly once (None when they do)."""
        pos = 0
        for start, length, _, _ in self.runs():
            if start < pos:
                return f"pieces overlap at element {start}"
            if start > pos:
                return f"no piece covers elements {pos}..{start - 1}"
            pos = start + length
        if pos != self.numel:
            return f"no piece covers elements {pos}..{self.numel - 1}"
        return None


@dataclass(frozen=True)
class Opaque:
    """A value that could not be parsed safely. `unsafe_global`: the global outside the allow list its pickle
    names (a value ckpt must not copy either: whoever loads the copy would run it)."""

    reason: str
    unsafe_global: str | None = None

    def __str__(self) -> str:
        return f"<unparsed: {self.reason}>"


@dataclass
class ObjectEntry:
    """A non-tensor value (step, scheduler, RNG, dataloader, client state), already parsed safely.

    `raw` locates the value's own serialised bytes (path, offset, length) when a writer of the
    same format can copy them verbatim (DCP BYTE_IO items) instead of re-pickling.
    """

    name: str
    value: Any
    role: str = "other"
    path: PathKey = ()
    raw: tuple[str, int, int] | None = None

    def __post_init__(self) -> None:
        if not self.path:
            self.path = (self.name,)


@dataclass(frozen=True)
class FileInfo:
    path: str
    bytes: int


@dataclass
class Checkpoint:
    """What a reader returns: everything about a checkpoint, tensor data still on disk."""

    format: str
    path: str
    tensors: dict[str, TensorEntry]
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    files: list[FileInfo] = field(default_factory=list)
    tag: str | None = None
    step: int | None = None
    world_size: int | None = None
    containers: dict[PathKey, str] = field(default_factory=dict)  # path prefix -> "list" | "tuple"
    details: dict[str, Any] = field(default_factory=dict)
    training_state: dict[str, Any] | None = None  # set by readers that know better than the heuristic
    notes: list[str] = field(default_factory=list)  # what the reader chose (tag, ...), shown to the user
    source: Any = field(default=None, repr=False)  # the reader's parsed files, for a writer of the same format
    # Files that travel with the weights (config.json, tokenizer): file name -> its path, or the bytes a view rewrote.
    companions: dict[str, str | bytes] = field(default_factory=dict)

    def entries(self) -> list[TensorEntry | ObjectEntry]:
        """The tensors, then the other values."""
        return [*self.tensors.values(), *self.objects.values()]

    def unsafe_values(self) -> list[ObjectEntry]:
        """Non-tensor values left unparsed because their pickle names a global outside the allow list."""
        return [o for o in self.objects.values() if isinstance(o.value, Opaque) and o.value.unsafe_global]

    def tied_groups(self) -> list[list[str]]:
        """Model weights whose data is the very same stored array (tied weights), each group in order."""
        groups: dict[tuple[Any, ...], list[str]] = {}
        for entry in self.tensors.values():
            if entry.role != "model" or entry.numel == 0:
                continue
            same = entry.pieces if isinstance(entry.pieces, LazyPieces) else tuple(entry.pieces)  # lazy: shared when tied
            # a computed tensor's pieces are what it reads, which others computed from the same source share: it is
            # tied only to an entry that is the same computation
            groups.setdefault((same, entry.shape, id(entry.derived)), []).append(entry.name)
        return [names for names in groups.values() if len(names) > 1]


def unsafe_value_problem(obj: ObjectEntry) -> str:
    """One line naming the file and the global of a value whose pickle the allow list refused."""
    where = obj.raw[0] if obj.raw else obj.name
    glob = obj.value.unsafe_global if isinstance(obj.value, Opaque) else None
    return f"{where}: '{obj.name}' is a pickle that needs global '{glob}' (not on the allow list; nothing was executed)"


def sub_tensor(entry: TensorEntry, name: str, start: int, shape: tuple[int, ...]) -> TensorEntry:
    """The elements [start, start + prod(shape)) of `entry` as a tensor of its own (a row range)."""
    count = math.prod(shape)
    pieces = []
    for gstart, length, piece, lstart in entry.runs_in(start, count):
        lo, hi = max(gstart, start), min(gstart + length, start + count)
        if lo < hi:
            pieces.append(Piece(FlatRange(lo - start, hi - lo), piece.data, lstart + lo - gstart))
    return TensorEntry(name, entry.dtype, shape, entry.role, pieces, entry.path)


FlatPart = tuple[int, "TensorEntry", int, int]  # (start in the flat, source tensor, start in the source, element count)


def lazy_flat(name: str, dtype: DType, length: int, parts: list[FlatPart], role: str = "other") -> TensorEntry:
    """A 1-d tensor of `length` elements: each part's source elements placed at its start, zeros everywhere else;
    its pieces made for the range a read asks for (a ZeRO-3 flat partition resharded from 1,024 ranks is a million
    one-element slivers: made a window at a time, never all at once). Parts must not overlap."""
    parts = sorted((p for p in parts if p[3] > 0), key=lambda p: p[0])
    return flat_entry(name, FlatLayout(dtype, length, parts, [p[0] for p in parts]), role)


def flat_entry(name: str, layout: FlatLayout, role: str = "other") -> TensorEntry:
    """The 1-d tensor a FlatLayout places (its pieces made for the range a read asks for)."""
    return TensorEntry(name, layout.dtype, (layout.length,), role, LazyPieces(layout, layout=layout))


class FlatLayout:
    """The RangeLayout of a lazy_flat: `parts` in order of their starts (`starts`); either may be a sequence made
    as it is indexed (a ZeRO-3 rank's flat partition of 20,000 params: its parts follow from the rank's number)."""

    __slots__ = ("dtype", "length", "parts", "starts", "zero")

    def __init__(self, dtype: DType, length: int, parts: Sequence[FlatPart], starts: Sequence[int]) -> None:
        self.dtype, self.length, self.parts, self.starts = dtype, length, parts, starts
        self.zero = zeros(dtype, length)

    def __call__(self) -> list[Piece]:
        return self.span(0, self.length)

    def span(self, start: int, count: int) -> list[Piece]:
        parts, dtype = self.parts, self.dtype
        end, pieces, pos = start + count, [], start
        for i in range(max(0, bisect.bisect_right(self.starts, start) - 1), len(parts)):
            at, source, src_start, n = parts[i]
            if at >= end:
                break
            lo, hi = max(at, start), min(at + n, end)
            if lo >= hi:
                continue
            if lo > pos:
                pieces.append(Piece(FlatRange(pos, lo - pos), zeros(dtype, lo - pos)))
            for gstart, run, piece, lstart in source.runs_in(src_start + lo - at, hi - lo):
                g_lo, g_hi = max(gstart, src_start + lo - at), min(gstart + run, src_start + hi - at)
                pieces.append(Piece(FlatRange(at + g_lo - src_start, g_hi - g_lo), piece.data, lstart + g_lo - gstart))
            pos = hi
        if pos < end:
            pieces.append(Piece(FlatRange(pos, end - pos), zeros(dtype, end - pos)))
        return pieces

    def arrays(self) -> list[StoredArray]:
        lists: dict[int, Sequence[StoredArray]] = {}  # the parts of one sub-group share their ranks' list of flats
        for _, source, _, n in self.parts:
            if n > 0:
                found = source.stored_arrays()
                lists.setdefault(id(found), found)
        return [self.zero, *{id(a): a for found in lists.values() for a in found}.values()]


def concat_flat(name: str, dtype: DType, length: int, parts: list[tuple[int, TensorEntry]], role: str = "other") -> TensorEntry:
    """A 1-d tensor of `length` elements: each (start, tensor) placed at `start`, zeros everywhere else."""
    pieces: list[Piece] = []
    pos = 0
    for start, part in sorted(parts, key=lambda p: p[0]):
        if start > pos:
            pieces.append(Piece(FlatRange(pos, start - pos), zeros(dtype, start - pos)))
        for gstart, run, piece, lstart in part.runs():
            pieces.append(Piece(FlatRange(start + gstart, run), piece.data, lstart))
        pos = start + part.numel
    if pos < length:
        pieces.append(Piece(FlatRange(pos, length - pos), zeros(dtype, length - pos)))
    return TensorEntry(name, dtype, (length,), role, pieces)
