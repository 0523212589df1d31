"""One `torch.save` file (`.pt`, `.pth`, `.bin`) holding a (nested) state dict.

Reading unpickles only `data.pkl`, through the allow list, and points each tensor at its
`data/<key>` record: nothing is loaded, nothing runs. Writing lays out a torch-compatible zip
(64-byte aligned records, CRCs in data descriptors) and streams each storage into it; tensors
that share data stay shared, and a view writes only the bytes it sees.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ckpt_cli.core import roles
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.interface import ReadOptions, WriteOptions
from ckpt_cli.core.model import (
    Box,
    Checkpoint,
    FileInfo,
    LazyPieces,
    ObjectEntry,
    Piece,
    StoredArray,
    TensorEntry,
    contiguous_strides,
)
from ckpt_cli.core.paths import open_regular
from ckpt_cli.core.pickles import pickler, zipio
from ckpt_cli.core.pickles.pickler import Global, Reduce
from ckpt_cli.core.pickles.safe_pickle import TensorRef, check_unbuilt, safe_loads, view_problem
from ckpt_cli.core.tree import flatten, unflatten, unique_names
from ckpt_cli.core.write.plan import Deferred, Literal, OutputFile, TensorData, WritePlan
from ckpt_cli.errors import DataError

ZIP_MAGIC = zipio.ZIP_MAGIC
EXTENSIONS = {".pt", ".pth", ".bin", ".ckpt", ".tar"}


@dataclass
class Shared:
    """What one read has parsed, by digest: pickles (of data.pkl) and the records of whole files."""

    pickles: dict[bytes, Any] = field(default_factory=dict)
    records: dict[bytes, dict[str, zipio.Record]] = field(default_factory=dict)


def load_archive(
    f: BinaryIO,
    where: str,
    options: ReadOptions,
    start: int = 0,
    length: int | None = None,
    extra_globals: dict[tuple[str, str], Any] | None = None,
    parsed: Shared | None = None,
) -> tuple[Any, dict[str, zipio.Record]]:
    """The unpickled `data.pkl` (tensors as TensorRef) and the records of one torch.save archive.

    `parsed`: what this read already parsed, for files that repeat one pickle byte for byte (every rank's ZeRO-3 model
    states describe the whole module) or are whole copies of one another: the tree and records are shared, so callers
    must not change them, and each file's tensors are still checked against its own records when their pieces are made."""
    records, data = _pickle_of(f, where, start, length, parsed)
    if parsed is None:
        return safe_loads(data, where, extra_globals, options.trust_pickle), records
    digest = hashlib.blake2b(data, digest_size=32).digest()
    if digest not in parsed.pickles:
        parsed.pickles[digest] = safe_loads(data, where, extra_globals, options.trust_pickle)
    return parsed.pickles[digest], records


def open_archive(
    path: Path,
    options: ReadOptions,
    extra_globals: dict[tuple[str, str], Any] | None = None,
    not_zip: str | None = "not a zip torch.save file",
    parsed: Shared | None = None,
) -> tuple[Any, dict[str, zipio.Record]]:
    """load_archive of the file at `path`: DataError naming it when it cannot be opened or (`not_zip`: the words) does
    not start as a zip."""
    with _opened(path) as f:
        if not_zip is not None and f.read(4) != ZIP_MAGIC:
            raise DataError(f"{path}: {not_zip}")
        return load_archive(f, str(path), options, extra_globals=extra_globals, parsed=parsed)


def crc_problems(paths: Iterable[str | Path]) -> list[str]:
    """--deep: every record of each torch.save archive against its CRC; a file that cannot be read is a problem too."""
    problems = []
    for path in map(str, paths):
        try:
            with open_regular(path) as f:
                problems += zipio.archive_problems(f, path)
        except (OSError, DataError) as exc:
            problems.append(str(exc) if isinstance(exc, DataError) else f"{path}: cannot read ({exc.strerror})")
    return problems


def check_archive(path: Path, options: ReadOptions, extra_globals: dict[tuple[str, str], Any] | None = None) -> bool:
    """What load_archive refuses before it builds the pickle's value (the archive's records, the pickle's bounds and
    globals), checked without unpickling: a rank file that a read need not parse is still refused when hostile.
    False where only unpickling would tell the globals (a protocol-4 pickle's STACK_GLOBAL): then load it."""
    with _opened(path) as f:
        return check_unbuilt(_pickle_of(f, str(path), 0, None, None)[1], str(path), extra_globals, options.trust_pickle)


def _opened(path: Path) -> BinaryIO:
    try:
        return open_regular(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot open ({exc.strerror})") from exc


def _pickle_of(f: BinaryIO, where: str, start: int, length: int | None, parsed: Shared | None) -> tuple[dict[str, zipio.Record], bytes]:
    """The archive's records and the bytes of its data.pkl."""
    records, whole = zipio.read_archive(f, where, start, length, parsed.records if parsed is not None else None)
    if "data.pkl" not in records:
        raise DataError(f"{where}: zip archive without data.pkl; not a torch.save file")
    rec = records["data.pkl"]
    if whole is not None:
        return records, whole[rec.data_offset - start : rec.data_offset - start + rec.size]
    f.seek(rec.data_offset)
    return records, f.read(rec.size)


def stored_array(ref: TensorRef, records: dict[str, zipio.Record], path: str, tensor: str = "") -> StoredArray:
    """Where a pickled tensor's elements are; DataError when its storage record is missing or short, or the
    view reaches outside it (`tensor`: its name, for the message)."""
    rec = records.get(f"data/{ref.storage.key}")
    if rec is None:
        raise DataError(f"{path}: storage record data/{ref.storage.key} is missing")
    needed = ref.storage.numel * ref.dtype.itemsize
    if rec.size != needed:
        raise DataError(f"{path}: storage data/{ref.storage.key} has {rec.size} bytes, its header says {needed}")
    problem = view_problem(ref)
    if problem:
        raise DataError(f"{path}: {problem} ({f'{tensor!r}, ' if tensor else ''}storage data/{ref.storage.key})")
    array = StoredArray(path, rec.data_offset, ref.dtype, ref.shape, ref.stride, ref.storage_offset, record=rec)
    start, end = array.extent()
    if end > rec.data_offset + rec.size:
        raise DataError(f"{path}: a tensor view runs past the end of storage data/{ref.storage.key}")
    return array


def entries_from_tree(
    tree: Any, records: dict[str, zipio.Record], path: str
) -> tuple[dict[str, TensorEntry], dict[str, ObjectEntry], dict[Any, str]]:
    """Flatten an unpickled state dict into tensor and object entries with roles."""
    tensor_leaves, object_leaves, containers = flatten(tree, lambda v: isinstance(v, TensorRef), path)
    names = unique_names([p for p, _ in tensor_leaves] + [p for p, _ in object_leaves], path)
    tensors: dict[str, TensorEntry] = {}
    for name, (key_path, ref) in zip(names, tensor_leaves):
        array = stored_array(ref, records, path)
        piece = Piece(Box((0,) * len(ref.shape), ref.shape), array)
        tensors[name] = TensorEntry(name, ref.dtype, ref.shape, roles.tensor_role(key_path), [piece], key_path)
    objects = {
        name: ObjectEntry(name, value, roles.object_role(key_path), key_path)
        for name, (key_path, value) in zip(names[len(tensor_leaves) :], object_leaves)
    }
    return tensors, objects, containers


def is_torch_file(path: Path) -> bool:
    try:
        with open_regular(path) as f:
            magic = f.read(4)
    except (OSError, DataError):
        return False
    return magic == ZIP_MAGIC or (path.suffix in EXTENSIONS and magic[:1] == b"\x80")


class TorchReader:
    name = "torch"

    def detect(self, path: Path) -> bool:
        return path.is_file() and is_torch_file(path)

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        where = str(path)
        legacy = (
            "legacy (pre-1.6, non-zip) torch.save format; it cannot be read lazily. "
            "Re-save it with a current torch (torch.save(torch.load(f), f))."
        )
        tree, records = open_archive(path, options, not_zip=legacy)
        tensors, objects, containers = entries_from_tree(tree, records, where)
        ckpt = Checkpoint(
            format=self.name,
            path=where,
            tensors=tensors,
            objects=objects,
            files=[FileInfo(where, path.stat().st_size)],
            containers=containers,
            details={"records": len(records)},
        )
        ckpt.step = roles.find_step(ckpt)
        return ckpt

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        return crc_problems([ckpt.path]) if deep else []


class Storage:
    """A storage record to be, pickled as torch's persistent id ('storage', class, key, 'cpu', numel)."""

    def __init__(self, key: str, dtype: DType, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def storage_id(obj: Any) -> Any:
    if not isinstance(obj, Storage):
        return None
    if obj.dtype.storage_class:
        return ("storage", Global("torch", obj.dtype.storage_class), obj.key, "cpu", obj.numel)
    return ("storage", Global("torch.storage", "UntypedStorage"), obj.key, "cpu", obj.numel * obj.dtype.itemsize)


def tensor_reduce(storage: Storage, shape: tuple[int, ...]) -> Reduce:
    """A contiguous tensor over `storage`, exactly as torch pickles it (torch/_tensor.py _reduce_ex_internal)."""
    args = (storage, 0, tuple(shape), contiguous_strides(shape), False, Reduce(Global("collections", "OrderedDict"), ()))
    if storage.dtype.storage_class:
        return Reduce(Global("torch._utils", "_rebuild_tensor_v2"), args)
    return Reduce(Global("torch._utils", "_rebuild_tensor_v3"), (*args, storage.dtype))


def pickle_state(ckpt: Checkpoint) -> tuple[bytes, list[tuple[str, TensorEntry]]]:
    """`data.pkl` for the checkpoint, and (storage key, tensor whose data fills it) in key order."""
    storages: dict[Any, Storage] = {}
    owners: list[tuple[str, TensorEntry]] = []
    items: list[tuple[Any, Any]] = []
    for entry in ckpt.tensors.values():
        # Tensors with the very same stored data (tied weights) share one storage, as in the source.
        # Only model weights can be tied; optimizer buffers must never alias (Adam updates them in place).
        pieces = entry.pieces if isinstance(entry.pieces, LazyPieces) else tuple(entry.pieces)  # lazy: one object when tied
        same = (pieces, entry.shape, entry.dtype) if entry.numel and entry.role == "model" else id(entry)
        if same not in storages:
            storages[same] = Storage(str(len(storages)), entry.dtype, entry.numel)
            owners.append((storages[same].key, entry))
        items.append((entry.path, tensor_reduce(storages[same], entry.shape)))
    items += [(obj.path, obj.value) for obj in ckpt.objects.values()]
    return pickler.dumps(unflatten(items, ckpt.containers), storage_id), owners


def archive_segments(records: list[tuple[str, bytes | TensorData]], scope: str = "", prefix: str = "archive") -> list[Any]:
    """Segments of a torch.save zip whose records are literal bytes or streamed tensor data.

    `scope` keeps the CRC keys of several archives in one file apart (DCP files concatenate them).
    """
    # An empty tensor's record is known bytes (its CRC is 0): a ZeRO-3 model-states file's 20,000 parameter placeholders
    # are one literal, not 60,000 segments held until the file is written. Its TensorData, 0 bytes, goes after the
    # rest, so that the write report still names it (as the file holds it).
    empty = [TensorData(p.tensor, p.dtype) for _, p in records if not isinstance(p, bytes) and p.size == 0]
    if empty:
        records = [(name, b"" if not isinstance(payload, bytes) and payload.size == 0 else payload) for name, payload in records]
    shape = tuple((name, payload if isinstance(payload, bytes) else payload.size) for name, payload in records)
    small = sum(len(p) for _, p in shape if isinstance(p, bytes)) <= TEMPLATE_CACHE_BYTES
    template, layouts, crcs, directory = (_archive_template if small else _archive_template.__wrapped__)(shape, prefix)
    tensors = [payload for _, payload in records if not isinstance(payload, bytes)]
    segments: list[Any] = []
    for part in template:
        if isinstance(part, Literal):
            segments.append(part)
        elif isinstance(part, _Slot):
            data = tensors[part.nth]
            segments.append(TensorData(data.tensor, data.dtype, crc_key=f"{scope}/{part.name}"))
        elif isinstance(part, _Trailer):
            segments.append(Deferred(len(part.blank), _Patched(part, f"{scope}/{part.name}")))
            return segments + empty  # the directory is in it
        else:
            segments.append(Deferred(part.descriptor_size, _Descriptor(part, f"{scope}/{part.name}")))
    if not tensors:  # every CRC known: the directory now, not 20,000 entry layouts kept until the file is written
        segments.append(Literal(zipio.central_directory(layouts, crcs)))
    else:
        segments.append(Deferred(directory, _Directory(layouts, crcs, scope)))
    return segments + empty


class _Descriptor:
    """A tensor record's data descriptor, once its CRC is known (a small object, not a closure: one per DCP chunk)."""

    __slots__ = ("entry", "key")

    def __init__(self, entry: zipio.ZipEntryLayout, key: str) -> None:
        self.entry, self.key = entry, key

    def __call__(self, got: dict[str, int]) -> bytes:
        return zipio.data_descriptor(self.entry, got[self.key])


class _Trailer(NamedTuple):
    """All an archive of one tensor holds after its data (its descriptor, the small records, the central directory),
    as bytes with the tensor's CRC32 left 0 at `at`: a DCP file holds thousands of chunk archives of a few shapes."""

    name: str
    blank: bytes
    at: tuple[int, ...]


class _Patched:
    """A _Trailer with the tensor's CRC32 filled in, once known."""

    __slots__ = ("trailer", "key")

    def __init__(self, trailer: _Trailer, key: str) -> None:
        self.trailer, self.key = trailer, key

    def __call__(self, got: dict[str, int]) -> bytes:
        out = bytearray(self.trailer.blank)
        for at in self.trailer.at:
            struct.pack_into("<I", out, at, got[self.key])
        return bytes(out)


def _trailer(template: list[Any], layouts: list[zipio.ZipEntryLayout], crcs: dict[str, int]) -> _Trailer:
    """The _Trailer of a one-tensor template ([literal, slot, descriptor entry, literals]): laid out with CRC 0 and
    with 0xFFFFFFFF, the bytes that differ are where the CRC goes (the descriptor's and the directory entry's)."""
    slot, entry, after = template[1], template[2], b"".join(p.data for p in template[3:])

    def laid_out(crc: int) -> bytes:
        return zipio.data_descriptor(entry, crc) + after + zipio.central_directory(layouts, {**crcs, slot.name: crc})

    blank, full = laid_out(0), laid_out(0xFFFFFFFF)
    differ = [i for i in range(len(blank)) if blank[i] != full[i]]
    trailer = _Trailer(slot.name, blank, tuple(differ[::4]))
    probe = 0x1234ABCD
    assert _Patched(trailer, "k")({"k": probe}) == laid_out(probe), "a CRC field of the trailer was not found"
    return trailer


class _Directory:
    """The archive's central directory, once its tensors' CRCs are known (`crcs`: the literal records')."""

    __slots__ = ("layouts", "crcs", "scope")

    def __init__(self, layouts: list[zipio.ZipEntryLayout], crcs: dict[str, int], scope: str) -> None:
        self.layouts, self.crcs, self.scope = layouts, crcs, scope

    def __call__(self, got: dict[str, int]) -> bytes:
        computed = {e.name: got[f"{self.scope}/{e.name}"] for e in self.layouts if e.name not in self.crcs}
        return zipio.central_directory(self.layouts, {**self.crcs, **computed})


# Archives with more literal bytes (a state dict's data.pkl) are laid out uncached: the cache is for DCP's chunk archives
# (a few hundred bytes, a few shapes); 1,024 ZeRO rank files of 46 KB pickles, each its own, held 100 MB in it.
TEMPLATE_CACHE_BYTES = 1 << 12


class _Slot(NamedTuple):
    """Where an archive template takes the data of its `nth` tensor (record `name`)."""

    nth: int  # not `index`: a tuple's method of that name
    name: str


Template = tuple[list[Any], list[zipio.ZipEntryLayout], dict[str, int], int]


@functools.lru_cache(maxsize=1024)
def _archive_template(records: tuple[tuple[str, bytes | int], ...], prefix: str) -> Template:
    """The layout of an archive whose records are bytes or tensor data of a size: its literal segments (shared by
    every archive of that shape: a DCP file holds thousands of chunk archives of a few shapes; the bytes between two
    tensors joined in one), each tensor's data as a _Slot and its data descriptor as its ZipEntryLayout; the entries,
    the literal records' CRCs and the size of the central directory."""
    template: list[Any] = []
    layouts: list[zipio.ZipEntryLayout] = []
    crcs: dict[str, int] = {}
    pos, tensors = 0, 0
    for name, payload in records:
        full = f"{prefix}/{name}"
        entry = zipio.layout_entry(full, pos, len(payload) if isinstance(payload, bytes) else payload)
        layouts.append(entry)
        template.append(Literal(entry.header))
        if isinstance(payload, bytes):
            crcs[full] = zlib.crc32(payload)
            template += [Literal(payload), Literal(zipio.data_descriptor(entry, crcs[full]))]
        else:
            template += [_Slot(tensors, full), entry]
            tensors += 1
        pos = entry.end
    joined: list[Any] = []
    run: list[bytes | memoryview] = []
    for part in template:  # one write for the ~20 headers and small records around a chunk's data, not one each
        if isinstance(part, Literal):
            run.append(part.data)
            continue
        if run:
            joined.append(Literal(b"".join(run)))
            run = []
        joined.append(part)
    if run:
        joined.append(Literal(b"".join(run)))
    if tensors == 1 and isinstance(joined[1], _Slot):  # a chunk archive: what follows its data is one patched trailer
        return [*joined[:2], _trailer(joined, layouts, crcs)], layouts, crcs, 0
    return joined, layouts, crcs, zipio.central_directory_size(layouts)


def archive(data_pkl: bytes, storages: Sequence[tuple[str, TensorEntry | bytes]], scope: str = "") -> list[Any]:
    """The segments of a torch.save zip: `data.pkl` and each storage's data (a tensor's, or literal bytes)."""
    records: list[tuple[str, bytes | TensorData]] = [
        ("data.pkl", data_pkl),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", b"little"),
    ]
    records += [(f"data/{key}", TensorData(e, e.dtype) if isinstance(e, TensorEntry) else e) for key, e in storages]
    # A deterministic serialization id (torch draws a random one) keeps outputs reproducible.
    serial = str(int(hashlib.sha1(data_pkl).hexdigest(), 16))[:40].rjust(40, "0")
    records += [("version", b"3\n"), (".data/serialization_id", serial.encode())]
    return archive_segments(records, scope)


def torch_file_segments(ckpt: Checkpoint) -> list[Any]:
    data_pkl, owners = pickle_state(ckpt)
    return archive(data_pkl, owners, "")


def tensor_archive(entry: TensorEntry, scope: str) -> list[Any]:
    """The archive `torch.save(tensor)` writes for one contiguous tensor (a DCP chunk)."""
    return archive(_tensor_pickle(entry.dtype, entry.shape), [("0", entry)], scope)


@functools.lru_cache(maxsize=1024)
def tensor_archive_size(dtype: DType, shape: tuple[int, ...]) -> int:
    """The bytes of tensor_archive() for a chunk of this dtype and shape, without making its segments."""
    return sum(s.size for s in tensor_archive(TensorEntry("", dtype, shape, "model", []), ""))


@functools.lru_cache(maxsize=1024)
def _tensor_pickle(dtype: DType, shape: tuple[int, ...]) -> bytes:
    """`data.pkl` of torch.save(tensor): the same for every chunk of one dtype and shape."""
    return pickler.dumps(tensor_reduce(Storage("0", dtype, math.prod(shape)), shape), storage_id)


def object_archive(value: Any) -> bytes:
    """`torch.save(value)` of a plain (non-tensor) value, as DCP stores BYTE_IO items."""
    segments = archive(pickler.dumps(value), [], "")
    return b"".join(s.data if isinstance(s, Literal) else s.build({}) for s in segments)


class TorchWriter:
    name = "torch"
    dest_is_dir = False

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        return WritePlan(self.name, dest, False, [OutputFile("", torch_file_segments(ckpt))])


READER = TorchReader()
WRITER = TorchWriter()
