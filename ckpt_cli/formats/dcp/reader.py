"""PyTorch Distributed Checkpoint: `.metadata` + `__{rank}_{i}.distcp` files (reader and checks).

`.metadata` is unpickled through inert stand-ins of DCP's dataclasses (formats/dcp/metadata.py), never with
torch's raw `pickle.load`. Each `storage_data` byte range is one complete `torch.save` archive; a tensor
chunk is located by the zip local header of its `data/0` record, so chunks are read (or copied)
as byte ranges. Saved with SerializationFormat.SAFETENSORS, tensor chunks are entries of one safetensors
document per file (formats/dcp/hf_storage.py). Facts: docs/formats.md §1.
"""

from __future__ import annotations

import functools
import re
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

from ckpt_cli import store
from ckpt_cli.core import roles
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.file_times import rewrite_note
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import (
    Box,
    Checkpoint,
    FileInfo,
    LazyPieces,
    ObjectEntry,
    Opaque,
    Piece,
    StoredArray,
    TensorEntry,
    contiguous_strides,
    unsafe_value_problem,
)
from ckpt_cli.core.paths import file_size, open_regular, plain_component, present, shown
from ckpt_cli.core.pickles import zipio
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.tree import holds_tensor
from ckpt_cli.errors import DataError, UnsafePickleError, UsageError
from ckpt_cli.formats.dcp import chunks as dcp_chunks
from ckpt_cli.formats.dcp.hf_storage import Blobs
from ckpt_cli.formats.dcp.metadata import (
    METADATA_GLOBALS,
    BytesStorageRec,
    MetadataRec,
    StorageIndex,
    StorageInfoRec,
    TensorStorageRec,
    as_tuple,
    is_count,
    load_metadata,
    shared_tensors,
    storage_index,
)
from ckpt_cli.formats.dcp.twins import Twins, forget_predicted, prefetch_edges
from ckpt_cli.formats.torch_save import load_archive, stored_array

METADATA = ".metadata"
DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")
RANK_METADATA = re.compile(r"__(\d+)\.metadata$")


@dataclass(frozen=True)
class DCPSource:
    """What `read` parsed, kept on the Checkpoint for check(): the folder and its `.metadata`, read once with
    the user's --trust-pickle setting (check() neither reads it again nor trusts it more)."""

    folder: Path
    metadata: MetadataRec  # its storage_data dropped once read: `storage` holds the same entries
    storage: StorageIndex  # by (fqn, chunk offsets); None for bytes
    safetensors: frozenset[tuple[str, int]] = frozenset()  # (file, offset) of the safetensors documents
    problems: tuple[str, ...] = ()  # what parsing them found that does not stop a read


@dataclass
class _Files:
    """Open data files of one checkpoint, with their sizes (and the safetensors documents found in them)."""

    folder: Path
    handles: dict[str, BinaryIO] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    blobs: Blobs = field(default_factory=Blobs)
    paths: dict[str, str] = field(default_factory=dict)  # relative path -> the file's path, for messages
    boxes: dict[tuple[Any, Any], Box] = field(default_factory=dict)  # equal chunk boxes as one: thousands of tensors, a few layouts

    def box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
        found = self.boxes.get((offsets, sizes))
        if found is None:
            found = self.boxes[offsets, sizes] = Box(offsets, sizes)
        return found

    def where(self, relative: str) -> str:
        if relative not in self.paths:
            self.paths[relative] = str(self.folder / relative)
        return self.paths[relative]

    def open(self, relative: str) -> BinaryIO:
        if relative not in self.handles:
            path = self.folder / plain_component(relative, f"{self.folder / METADATA}: storage_data relative_path")
            try:
                self.handles[relative] = open_regular(path)
            except FileNotFoundError:
                raise DataError(f"{path}: missing (named by {METADATA})") from None
            self.sizes[relative] = file_size(self.handles[relative])
        return self.handles[relative]

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()

    def __del__(self) -> None:
        self.close()


def _range(files: _Files, info: StorageInfoRec, fqn: str) -> tuple[BinaryIO, str]:
    if getattr(info, "transform_descriptors", None):
        raise UsageError(
            f"{files.folder}: '{fqn}' is stored with stream extensions {list(info.transform_descriptors)} "
            "(e.g. zstd compression); ckpt reads uncompressed DCP checkpoints only"
        )
    f = files.open(info.relative_path)
    where = files.where(info.relative_path)
    if info.offset < 0 or info.length <= 0 or info.offset + info.length > files.sizes[info.relative_path]:
        raise DataError(
            f"{where}: '{fqn}' needs bytes {info.offset}..{info.offset + info.length} but the file has "
            f"{files.sizes[info.relative_path]} (truncated?)"
        )
    f.seek(info.offset)
    return f, where


def _archive(files: _Files, info: StorageInfoRec, fqn: str) -> tuple[BinaryIO, str]:
    """The byte range of an item stored as a torch.save archive (every BYTE_IO item, tensors under TORCH_SAVE)."""
    f, where = _range(files, info, fqn)
    if f.read(4) != zipio.ZIP_MAGIC:
        raise DataError(f"{where}: '{fqn}' at byte {info.offset} is neither a torch.save archive nor a safetensors tensor")
    return f, where


def _tensor_pieces(
    files: _Files, fqn: str, meta: TensorStorageRec, storage: StorageIndex, options: ReadOptions, twins: Twins | None = None
) -> list[Piece]:
    pieces = []
    dtype = meta.properties.dtype
    for offsets, sizes, info in _chunks(files.folder, fqn, meta, storage):
        kind = (dtype, sizes, info.length)
        laid_out = twins.predict(files.where(info.relative_path), kind, info, fqn) if twins is not None else None
        if laid_out is not None:  # from its parsed twin, checked when fetched (formats/dcp/twins.py)
            _range(files, info, fqn)
            pieces.append(Piece(files.box(offsets, sizes), laid_out))
            continue
        f, where = _range(files, info, fqn)
        if f.read(4) != zipio.ZIP_MAGIC:  # SerializationFormat.SAFETENSORS: an entry of the file's safetensors document
            pieces.append(Piece(files.box(offsets, sizes), files.blobs.chunk(f, where, info.offset, fqn, offsets, sizes, dtype)))
            continue  # (its twins are then parsed too: only a torch.save archive is learnt)
        obj, records = load_archive(f, f"{where} ('{fqn}' at {info.offset})", options, info.offset, info.length)
        if not isinstance(obj, TensorRef):
            raise DataError(f"{where}: '{fqn}' chunk at offset {info.offset} does not hold a tensor")
        if obj.dtype != dtype or obj.shape != sizes:
            raise DataError(f"{where}: '{fqn}' chunk holds {obj.dtype}{list(obj.shape)}; metadata says {dtype}{list(sizes)}")
        pieces.append(Piece(files.box(offsets, sizes), stored_array(obj, records, where, fqn)))
        if twins is not None and "data.pkl" in records:
            pkl = records["data.pkl"]
            f.seek(pkl.data_offset)
            twins.learn(kind, info, obj, records, f.read(pkl.size))
    return pieces


def _chunks(
    folder: Path, fqn: str, meta: TensorStorageRec, storage: StorageIndex
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], StorageInfoRec]]:
    """Each chunk of a tensor: its offsets, sizes and storage entry (DataError for a chunk without one)."""
    for chunk in meta.chunks:
        offsets, sizes = as_tuple(chunk.offsets), as_tuple(chunk.sizes)
        info = storage.get((fqn, offsets))
        if info is None:
            raise DataError(f"{folder / METADATA}: chunk {list(offsets)} of '{fqn}' has no storage entry")
        yield offsets, sizes, info


def _check_stored(folder: Path, fqn: str, meta: TensorStorageRec, storage: StorageIndex) -> None:
    """Every chunk has a storage entry (what _chunks checks, without making the pieces)."""
    for _ in _chunks(folder, fqn, meta, storage):
        pass


class _PiecesOf:
    """A tensor's pieces made by `make(fqn, item)` when asked for (slotted: an MoE checkpoint holds 82,000)."""

    __slots__ = ("make", "fqn", "item")

    def __init__(self, make: Callable[[str, TensorStorageRec], list[Piece]], fqn: str, item: TensorStorageRec) -> None:
        self.make, self.fqn, self.item = make, fqn, item

    def __call__(self) -> list[Piece]:
        return self.make(self.fqn, self.item)


def _layout_pieces(folder: Path, fqn: str, meta: TensorStorageRec, storage: StorageIndex) -> list[Piece]:
    """The chunks as boxes of the tensor, each over its stored item's byte range, unread (ReadOptions.layout_only:
    inspect reports names, shapes, dtypes and files; where the bytes lie inside each item is left to the commands
    that read them)."""
    dtype, pieces = meta.properties.dtype, []
    for offsets, sizes, info in _chunks(folder, fqn, meta, storage):
        array = StoredArray(_file_path(folder, info.relative_path), info.offset, dtype, sizes, contiguous_strides(sizes))
        pieces.append(Piece(Box(offsets, sizes), array))
    return pieces


def _stat_size(path: Path) -> int:
    """A data file's size when nothing was read from it (layout_only); 0 when it is missing (check() reports it)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _refuse_short(folder: Path, storage: StorageIndex, sizes: dict[str, int]) -> None:
    """DataError naming the first data file shorter than the byte ranges `.metadata` records in it (from the sizes
    at hand: nothing read); a missing one has size 0 here."""
    ends: dict[str, int] = {}
    for rel, offset, length in storage.spans():
        if offset + length > ends.get(rel, 0):
            ends[rel] = offset + length
    for rel in sorted(ends):
        if ends[rel] > sizes.get(rel, 0):
            where = folder / rel
            if not store.exists(where):
                raise DataError(f"{where}: missing (named by {METADATA}); the checkpoint is incomplete")
            raise DataError(
                f"{where}: {sizes[rel]} bytes but {METADATA} records data up to byte {ends[rel]} (truncated); the checkpoint is incomplete"
            )


@functools.lru_cache(maxsize=4096)
def _file_path(folder: Path, relative: str) -> str:
    return str(folder / relative)


def _serialization(files: _Files, storage: StorageIndex) -> str:
    """How the chunks are stored, from the first tensor item's magic (all items of a save share it)."""
    for (_, offsets), info in storage.items():
        if offsets is not None:
            f, _ = _range(files, info, "")
            return "torch_save" if f.read(4) == zipio.ZIP_MAGIC else "safetensors"
    return "torch_save"


def _object(files: _Files, fqn: str, info: StorageInfoRec, options: ReadOptions) -> tuple[Any, tuple[str, int, int]]:
    f, where = _archive(files, info, fqn)
    raw = (str(files.folder / info.relative_path), info.offset, info.length)
    try:
        value, _ = load_archive(f, f"{where} ('{fqn}')", options, info.offset, info.length)
    except UnsafePickleError as exc:  # kept unparsed: inspect shows it, verify reports it, writers refuse it
        return Opaque(f"needs {exc.global_name}; --trust-pickle to parse", exc.global_name), raw
    if holds_tensor(value, lambda v: isinstance(v, TensorRef)):
        return Opaque("holds tensors inside a pickled value"), raw
    return value, raw


def _counts(values: Any) -> TypeGuard[tuple[Any, ...] | list[Any]]:
    return isinstance(values, tuple | list) and all(is_count(v) for v in values)


def _check_tensor_metadata(meta_path: Path, fqn: str, item: TensorStorageRec) -> None:
    """The tensor's global size and its chunks' offsets and sizes: non-negative ints, one per dimension."""
    size = getattr(item, "size", None)
    if not _counts(size):
        raise DataError(f"{meta_path}: {shown(fqn)} has size {shown(size)}; sizes are non-negative integers")
    if not isinstance(getattr(getattr(item, "properties", None), "dtype", None), DType):
        raise DataError(f"{meta_path}: {shown(fqn)} has no dtype")
    chunks = getattr(item, "chunks", None)
    if not isinstance(chunks, list | tuple):
        raise DataError(f"{meta_path}: {shown(fqn)} has no list of chunks")
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not _counts(offsets) or not _counts(sizes) or len(offsets) != len(size) or len(sizes) != len(size):
            raise DataError(
                f"{meta_path}: a chunk of {shown(fqn)} has offsets {shown(offsets)} and sizes {shown(sizes)}; "
                f"it needs {len(size)} non-negative integers each"
            )


def world_size_of(storage: StorageIndex) -> int:
    ranks = {int(m.group(1)) for path in {span[0] for span in storage.spans()} if (m := DATA_FILE.search(path))}
    return max(ranks) + 1 if ranks else 1


class DCPReader:
    name = "dcp"
    metadata_globals = METADATA_GLOBALS  # what `.metadata` may name (formats/dcp/megatron.py adds Megatron's classes)

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (present(path / METADATA) or any(RANK_METADATA.match(p.name) for p in path.iterdir()))

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        if not present(path / METADATA):
            ranks = sorted(p.name for p in path.iterdir() if RANK_METADATA.match(p.name))
            raise UsageError(
                f"{path}: per-rank metadata ({', '.join(ranks[:3])}...) and no global .metadata: saved with "
                "use_collectives=False, which loads only at the same world size; ckpt does not read it yet"
            )
        meta = load_metadata(path / METADATA, options.trust_pickle, self.metadata_globals)
        storage = storage_index(path / METADATA, meta)
        data_files = sorted({span[0] for span in storage.spans()})
        planner = meta.planner_data if isinstance(meta.planner_data, dict) else {}
        files, paths = _Files(path), dcp_chunks.Paths()
        tensors: dict[str, TensorEntry] = {}
        objects: dict[str, ObjectEntry] = {}
        containers: dict[tuple[Any, ...], str] = {}
        try:
            twins = None
            if not store.mappable(path) and not options.layout_only:
                forget_predicted(files.where(relative) for relative in data_files)
                if options.predicted_chunks and not options.pieces_when_read:
                    twins = Twins(shared_tensors(meta), storage)
                prefetch_edges(files.open, [i for i in storage.values() if twins is None or not twins.is_twin(i)])
            layout_of = lambda fqn, item: _layout_pieces(path, fqn, item, storage)  # noqa: E731
            read_of = lambda fqn, item: _tensor_pieces(files, fqn, item, storage, options)  # noqa: E731
            for fqn, item in shared_tensors(meta).items():
                key_path = tuple(planner.get(fqn, (fqn,)))
                for i, part in enumerate(key_path):
                    if isinstance(part, int) and i:  # int path items are list positions in DCP
                        containers[key_path[:i]] = "list"
                if isinstance(item, TensorStorageRec):
                    _check_tensor_metadata(path / METADATA, fqn, item)
                    size = tuple(item.size)
                    pieces: list[Piece] | LazyPieces
                    if options.layout_only:  # made when asked for: inspect counts them, a check walks them
                        _check_stored(path, fqn, item, storage)
                        pieces = LazyPieces(_PiecesOf(layout_of, fqn, item), len(item.chunks))
                    elif options.pieces_when_read:  # each chunk's archive parsed when the tensor is read (files kept open)
                        _check_stored(path, fqn, item, storage)
                        pieces = LazyPieces(_PiecesOf(read_of, fqn, item), len(item.chunks))
                    else:
                        pieces = _tensor_pieces(files, fqn, item, storage, options, twins)
                        pieces = dcp_chunks.pack(pieces, item.properties.dtype, size, paths)
                        object.__setattr__(item, "chunks", ())  # the pieces hold the same boxes (200,000 records at 64 ranks)
                    tensors[fqn] = TensorEntry(fqn, item.properties.dtype, size, roles.tensor_role(key_path), pieces, key_path)
                elif isinstance(item, BytesStorageRec):
                    info = storage.get((fqn, None))
                    if info is None:
                        raise DataError(f"{path / METADATA}: '{fqn}' has no storage entry")
                    value, raw = _object(files, fqn, info, options)
                    objects[fqn] = ObjectEntry(fqn, value, roles.object_role(key_path), key_path, raw)
                else:
                    raise DataError(f"{path / METADATA}: '{fqn}' has an unknown storage type")
            parsed = "safetensors" if files.blobs.parsed else "torch_save"
            serialization = _serialization(files, storage) if options.layout_only or options.pieces_when_read else parsed
        finally:
            if not options.pieces_when_read:  # else closed with the checkpoint (_Files.__del__)
                files.close()
        sizes = {f: files.sizes[f] if f in files.sizes else _stat_size(path / f) for f in data_files}
        if options.layout_only:  # inspect: the sizes it shows tell a truncated file (verify says more, per tensor)
            _refuse_short(path, storage, sizes)
        ckpt = Checkpoint(
            format=self.name,
            path=str(path),
            tensors=tensors,
            objects=objects,
            files=[FileInfo(str(path / METADATA), (path / METADATA).stat().st_size)]
            + [FileInfo(str(path / f), sizes[f]) for f in data_files],
            world_size=world_size_of(storage),
            containers=containers,
            details=self._details(meta, tensors, data_files, planner, serialization),
            source=DCPSource(
                path, meta, storage, frozenset((Path(w).name, o) for w, o in files.blobs.parsed), tuple(files.blobs.problems())
            ),
        )
        ckpt.step = roles.find_step(ckpt)
        refused = {o.name: o.value.unsafe_global for o in ckpt.unsafe_values()}
        if refused:  # values whose pickle the allow list refused: shown, reported by verify, never copied
            ckpt.details["refused_pickles"] = refused
        return ckpt

    def _details(
        self, meta: MetadataRec, tensors: dict[str, TensorEntry], data_files: list[str], planner: dict, serialization: str
    ) -> dict:
        storage_meta = getattr(meta, "storage_meta", None)
        chunk_counts = [len(t.pieces) for t in tensors.values()]
        return {
            "dcp_version": getattr(meta, "version", None),
            "key_layout": roles.key_layout(list(planner.values()) or [(k,) for k in meta.state_dict_metadata]),
            "planner_data": bool(planner),
            "data_files": len(data_files),
            "chunks": sum(chunk_counts),
            "max_chunks_per_tensor": max(chunk_counts, default=0),
            "sharded_tensors": sum(1 for n in chunk_counts if n > 1),
            "save_id": getattr(storage_meta, "save_id", None),
            "serialization": serialization,
        }

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        source = ckpt.source
        if not isinstance(source, DCPSource):
            raise TypeError(f"{ckpt.path}: DCPReader.check needs the checkpoint its read() returned")
        folder = source.folder
        problems = []
        leftovers = sorted(p.name for p in folder.iterdir() if p.name.endswith(".metadata.tmp"))
        if leftovers:
            problems.append(f"{folder / leftovers[0]}: leftover of a save that crashed before it committed")
        referenced = {span[0] for span in source.storage.spans()}
        for p in sorted(folder.glob("*.distcp")):
            if p.name not in referenced:
                problems.append(f"{p}: not referenced by {METADATA} (a leftover of another save?)")
        problems += _overlaps(folder, source.storage.spans(), source.safetensors)
        problems += list(source.problems)
        problems += _bounds(ckpt)
        problems += [unsafe_value_problem(o) for o in ckpt.unsafe_values()]
        if deep:
            problems += _crc_problems(folder, source.storage, source.safetensors)
        return problems

    def notes(self, ckpt: Checkpoint) -> list[str]:
        """What the checks suspect and cannot decide (verify shows it; it never fails a checkpoint): data files
        modified after `.metadata` though created before it (core/file_times.py). Not for objects in a store, whose
        LastModified is their upload, in whatever order a copy made them."""
        source = ckpt.source
        if not isinstance(source, DCPSource) or not store.renames(source.folder):
            return []
        referenced = sorted({span[0] for span in source.storage.spans()})
        note = rewrite_note((source.folder / rel for rel in referenced), source.folder / METADATA)
        return [note] if note else []


def _overlaps(folder: Path, spans: Iterable[tuple[str, int, int]], safetensors: frozenset[tuple[str, int]]) -> list[str]:
    """Byte ranges that overlap; the tensor items of one safetensors document share its offset and count once.
    Held as two numbers a range per file (581,000 at 64 ranks), sorted only where they are not in order already."""
    by_file: dict[str, array] = {}
    seen: set[tuple[str, int]] = set()
    for rel, offset, length in spans:
        if safetensors and (rel, offset) in safetensors:
            if (rel, offset) in seen:
                continue
            seen.add((rel, offset))
        found = by_file.get(rel)
        if found is None:
            found = by_file[rel] = array("q")
        found.extend((offset, length))
    problems = []
    for rel, ranges in by_file.items():
        starts, lengths = ranges[0::2], ranges[1::2]
        order: Iterable[int] = range(len(starts))
        if any(starts[i] > starts[i + 1] for i in range(len(starts) - 1)):
            order = sorted(order, key=lambda i: (starts[i], starts[i] + lengths[i]))
        previous = None
        for i in order:
            if previous is not None and starts[i] < starts[previous] + lengths[previous]:
                a, b = starts[previous], starts[i]
                problems.append(f"{folder / rel}: byte ranges {a}..{a + lengths[previous]} and {b}.. overlap")
                break
            previous = i
    return problems


def _bounds(ckpt: Checkpoint) -> list[str]:
    problems = []
    for t in ckpt.tensors.values():
        for p in t.pieces:
            if isinstance(p.region, Box) and any(o < 0 or o + s > n for o, s, n in zip(p.region.offsets, p.region.sizes, t.shape)):
                problems.append(
                    f"{ckpt.path}: chunk {list(p.region.offsets)}+{list(p.region.sizes)} of '{t.name}' lies "
                    f"outside its shape {list(t.shape)}"
                )
    return problems


def _crc_problems(folder: Path, storage: StorageIndex, safetensors: frozenset[tuple[str, int]]) -> list[str]:
    """Every torch.save archive against its CRC32s (safetensors entries have none: docs/formats.md)."""
    files = _Files(folder)
    problems = []
    try:
        for (fqn, _), info in storage.items():
            if (info.relative_path, info.offset) in safetensors:
                continue
            f, where = _archive(files, info, fqn)
            for rec in zipio.read_records(f, where, info.offset, info.length).values():
                problem = zipio.crc_problem(f, rec, f"{where} ('{fqn}')")
                if problem:
                    problems.append(problem)
    except DataError as exc:
        problems.append(str(exc))
    finally:
        files.close()
    return problems


READER = DCPReader()
