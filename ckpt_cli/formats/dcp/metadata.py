"""DCP's `.metadata`: inert stand-ins for the dataclasses it pickles, and its safe load (formats/dcp/reader.py reads the rest).

`.metadata` is unpickled through these, never with torch's raw `pickle.load`: the allow list names DCP's classes
in their current and legacy modules, and path objects become text. Facts: docs/formats.md §1.2, §1.8.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, ClassVar

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.paths import plain_component, shown
from ckpt_cli.core.pickles.frozen import Sealed
from ckpt_cli.core.pickles.pickle_guard import PickleRefused, charge
from ckpt_cli.core.pickles.pickle_stream import OwnCopy, read_pickle_file
from ckpt_cli.core.pickles.safe_pickle import safe_loads
from ckpt_cli.errors import DataError


# Inert stand-ins for the pickled classes of dcp/metadata.py and dcp/filesystem.py (Sealed: a pickle cannot
# change the classes themselves; each instance is the pickle's own). Slots, not a __dict__ per record: a wide
# checkpoint's `.metadata` holds three records per chunk (200,000 chunks at 64 ranks x 2,000 parameters).
class _Record(metaclass=Sealed):
    __slots__ = ("_more",)  # fields a newer torch adds (and a non-dict state, as `_state`), read by name
    _DEFAULTS: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            self._put(key, value)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            charge(len(state))
            fields = type(self)._DEFAULTS
            for key, value in state.items():
                if type(key) is str and key in fields:
                    object.__setattr__(self, key, value)
                else:
                    self._put(key, value)
        else:
            self._put("_state", state)

    def _put(self, key: Any, value: Any) -> None:
        if type(key) is str and key in type(self)._DEFAULTS:
            object.__setattr__(self, key, value)
            return
        try:
            more = object.__getattribute__(self, "_more")
        except AttributeError:
            more = {}
            object.__setattr__(self, "_more", more)
        more[key] = value

    def __getattr__(self, name: str) -> Any:  # a field the pickle did not set: its default, or one kept in _more
        if name.startswith("__") or name == "_more":
            raise AttributeError(name)
        try:
            return object.__getattribute__(self, "_more")[name]
        except (AttributeError, KeyError):
            pass
        defaults = type(self)._DEFAULTS
        if name in defaults and defaults[name] is not _REQUIRED:
            return defaults[name]
        raise AttributeError(name)


_REQUIRED = object()  # a field without a default: reading it unset is an AttributeError (getattr(x, f, None) is None)


class MetadataRec(_Record):
    __slots__ = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    _DEFAULTS: ClassVar[dict[str, Any]] = {
        "state_dict_metadata": _REQUIRED, "planner_data": None, "storage_data": None, "storage_meta": None, "version": None
    }  # fmt: skip
    state_dict_metadata: dict[str, Any]
    planner_data: Any
    storage_data: Any
    storage_meta: Any
    version: str | None


class TensorStorageRec(_Record):
    __slots__ = ("properties", "size", "chunks")
    _DEFAULTS: ClassVar[dict[str, Any]] = {"properties": _REQUIRED, "size": _REQUIRED, "chunks": _REQUIRED}
    properties: Any
    size: tuple[int, ...]
    chunks: list[Any]


class BytesStorageRec(_Record):
    __slots__ = ()


class ChunkRec(_Record):
    __slots__ = ("offsets", "sizes")
    _DEFAULTS: ClassVar[dict[str, Any]] = {"offsets": _REQUIRED, "sizes": _REQUIRED}
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class TensorPropertiesRec(_Record):
    __slots__ = ("dtype",)
    _DEFAULTS: ClassVar[dict[str, Any]] = {"dtype": _REQUIRED}
    dtype: DType

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and state and isinstance(state[0], DType):  # the 5-tuple __getstate__
            self._put("dtype", state[0])
        else:
            super().__setstate__(state)


class IndexRec(_Record):
    __slots__ = ("fqn", "offset", "index")
    _DEFAULTS: ClassVar[dict[str, Any]] = {"fqn": _REQUIRED, "offset": None, "index": None}
    fqn: str
    offset: tuple[int, ...] | None
    index: int | None

    def key(self) -> tuple[str, tuple[int, ...] | None]:
        return self.fqn, as_tuple(self.offset)


def as_tuple(values: Any) -> Any:
    """Offsets or sizes as a tuple: the pickle's own (a torch.Size is one), a copy only of a list."""
    return values if values is None or isinstance(values, tuple) else tuple(values)


class StorageInfoRec(_Record):
    __slots__ = ("relative_path", "offset", "length", "transform_descriptors")
    _DEFAULTS: ClassVar[dict[str, Any]] = {
        "relative_path": _REQUIRED, "offset": _REQUIRED, "length": _REQUIRED, "transform_descriptors": None
    }  # fmt: skip
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any


StorageKey = tuple[str, Any]  # (fqn, chunk offsets); offsets None for a non-tensor value


class StorageIndex:
    """`.metadata`'s storage_data by (fqn, chunk offsets), packed: per fqn its chunks' offsets (once looked up: one
    tuple and one lookup table shared by the fqns stored alike) and three numbers a chunk (its file's number, offset,
    length); a StorageInfoRec is made again when asked for. As records, the 581,160 chunks of a 64-rank MoE checkpoint
    held ~120 MB to the end of a write, and `diff` holds two of these. An entry with anything else (transform
    descriptors, a newer torch's field, a number past 64 bits) is kept as read."""

    __slots__ = ("by_fqn", "paths", "numbers", "layouts", "kept")

    def __init__(self) -> None:
        self.by_fqn: dict[str, list[Any]] = {}  # fqn -> [offsets of its chunks, array of 3 numbers a chunk, table or None]
        self.paths: list[str] = []
        self.numbers: dict[str, int] = {}
        self.layouts: dict[tuple[Any, ...], tuple[tuple[Any, ...], dict[Any, int]]] = {}
        self.kept: dict[StorageKey, StorageInfoRec] = {}

    def __setitem__(self, key: StorageKey, info: StorageInfoRec) -> None:
        fqn, offsets = key
        if not _plain_info(info):
            self.kept[key] = info
            return
        found = self.by_fqn.get(fqn)
        if found is None:
            found = self.by_fqn[fqn] = [[], array("q"), None]
        elif found[2] is not None:  # looked up already: its offsets become its own list again
            found[0], found[2] = list(found[0]), None
        path = info.relative_path
        number = self.numbers.get(path)
        if number is None:
            number = self.numbers[path] = len(self.paths)
            self.paths.append(path)
        found[0].append(offsets)
        found[1].extend((number, info.offset, info.length))

    def get(self, key: StorageKey) -> StorageInfoRec | None:
        if self.kept and key in self.kept:
            return self.kept[key]
        found = self.by_fqn.get(key[0])
        if found is None:
            return None
        if found[2] is None:
            self._settle(found)
        position = found[2].get(key[1])
        return None if position is None else self._info(found[1], position)

    def items(self) -> Iterator[tuple[StorageKey, StorageInfoRec]]:
        for fqn, found in self.by_fqn.items():
            if found[2] is None:
                self._settle(found)
            for i, offsets in enumerate(found[0]):
                yield (fqn, offsets), self._info(found[1], i)
        yield from self.kept.items()

    def values(self) -> Iterator[StorageInfoRec]:
        for _, info in self.items():
            yield info

    def spans(self) -> Iterator[tuple[str, int, int]]:
        """(relative_path, offset, length) of every entry, no record made (a check of 581,000 chunks made them all)."""
        for found in self.by_fqn.values():
            numbers = found[1]
            for k in range(0, len(numbers), 3):
                yield self.paths[numbers[k]], numbers[k + 1], numbers[k + 2]
        for info in self.kept.values():
            yield info.relative_path, info.offset, info.length

    def settle(self) -> None:
        """Every fqn's offsets as the shared tuple and table (once the read has put every entry): a list of offsets
        per fqn held 581,160 references to the end of a command."""
        for found in self.by_fqn.values():
            if found[2] is None:
                self._settle(found)

    def _info(self, numbers: array, i: int) -> StorageInfoRec:
        path, offset, length = numbers[3 * i : 3 * i + 3]
        return StorageInfoRec(relative_path=self.paths[path], offset=offset, length=length)

    def _settle(self, found: list[Any]) -> None:
        """A fqn's offsets as the tuple and lookup table shared by the fqns stored alike; of two entries under one
        key, the later (as in the dict they were read from)."""
        keys, numbers = tuple(found[0]), found[1]
        shared = self.layouts.get(keys)
        if shared is None:
            table = {offsets: i for i, offsets in enumerate(keys)}
            if len(table) < len(keys):
                last = sorted(table.values())
                keys = tuple(keys[i] for i in last)
                numbers = array("q", (n for i in last for n in numbers[3 * i : 3 * i + 3]))
                table = {offsets: i for i, offsets in enumerate(keys)}
            shared = self.layouts.setdefault(keys, (keys, table))
        found[0], found[1], found[2] = shared[0], numbers, shared[1]


class StorageFiller:
    """`.metadata`'s storage_data as the unpickler fills it (safe_loads' `filler`): each (MetadataIndex,
    _StorageInfo) pair checked and packed into `index` as it comes. A dict of the 581,160 pairs of a 64-rank MoE
    checkpoint held 1.7 million records to the end of the load (`inspect` peaked at 331 MB on it). Where the C
    rewrite is not built the pickle makes a dict, which `storage_index` puts through the same checks."""

    __slots__ = ("meta_path", "index", "named", "lengths", "offsets")

    def __init__(self, meta_path: Path) -> None:
        self.meta_path = meta_path
        self.index = StorageIndex()
        self.named: set[str] = set()  # relative paths already found plain (a few files, named by every chunk)
        self.lengths: dict[int, int] = {}  # a few distinct lengths, one object each
        self.offsets: dict[Any, Any] = {}  # chunk offsets, one tuple for each distinct (until the index is settled)

    def __setitem__(self, key: Any, info: Any) -> None:
        where = self.meta_path
        if not isinstance(key, IndexRec) or not isinstance(info, StorageInfoRec):
            raise DataError(f"{where}: storage_data entry of an unknown kind")
        fqn, relative = getattr(key, "fqn", None), getattr(info, "relative_path", None)
        if type(fqn) is not str:
            raise DataError(f"{where}: storage_data entry named {shown(fqn)}; a name is text")
        if type(relative) is not str or relative not in self.named:
            self.named.add(plain_component(relative, f"{where}: storage_data relative_path"))
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not is_count(offset) or not is_count(length) or not length:
            raise DataError(
                f"{where}: storage_data of {shown(fqn)} has offset {shown(offset)} and length {shown(length)}; "
                "a byte range needs offset >= 0 and length > 0"
            )
        object.__setattr__(info, "length", self.lengths.setdefault(length, length))
        try:
            offsets = as_tuple(getattr(key, "offset", None))
            self.index[fqn, self.offsets.setdefault(offsets, offsets)] = info
        except TypeError:  # offsets holding something unhashable
            raise DataError(f"{where}: storage_data of {shown(fqn)} has chunk offsets that are not numbers") from None

    def __setstate__(self, state: Any) -> None:
        raise PickleRefused("a pickle may not set the state of storage_data")


def storage_index(meta_path: Path, meta: MetadataRec) -> StorageIndex:
    """The checked, packed storage_data of `meta` (taken off it: its records are no longer needed)."""
    entries, meta.storage_data = meta.storage_data, None
    if not isinstance(entries, StorageFiller):  # a dict: the pickle was loaded without the C rewrite
        filler = StorageFiller(meta_path)
        for index, info in drained(entries):
            filler[index] = info
        entries = filler
    entries.index.settle()
    return entries.index


def is_count(value: Any) -> bool:
    """A size, offset or length as DCP writes them: a non-negative int (torch.Size items are ints; never a bool)."""
    return type(value) is int and value >= 0


class SharedRecords:
    """A tensor's chunk list and properties as the objects every tensor stored alike shares. A 64-rank MoE
    checkpoint's 82,080 tensors have 3 distinct chunk lists, and as read they held 581,160 ChunkRecs (~45 MB a
    checkpoint, twice in `diff`). Records with a field a newer torch adds (`_more`) are kept as read."""

    __slots__ = ("chunk_lists", "properties")

    def __init__(self) -> None:
        self.chunk_lists: dict[tuple[Any, ...], list[Any]] = {}
        self.properties: dict[DType, TensorPropertiesRec] = {}

    def share(self, item: TensorStorageRec) -> None:
        """Before the record is checked (formats/dcp/reader.py): a field that is missing, or that cannot be a key, is
        left as read for the check to name."""
        chunks, props = getattr(item, "chunks", None), getattr(item, "properties", None)
        try:
            if type(props) is TensorPropertiesRec and _plain(props):
                object.__setattr__(item, "properties", self.properties.setdefault(props.dtype, props))
            if isinstance(chunks, list) and all(type(c) is ChunkRec and _plain(c) for c in chunks):
                key = tuple(as_tuple(x) for c in chunks for x in (c.offsets, c.sizes))
                if all(type(n) is int for numbers in key for n in numbers):  # True is 1 to a dict, not to the check
                    object.__setattr__(item, "chunks", self.chunk_lists.setdefault(key, chunks))
        except (AttributeError, TypeError):  # a record without a field, offsets holding something unhashable
            pass


class SharedTensors(dict[str, Any]):
    """`.metadata`'s state_dict_metadata as the unpickler fills it (safe_loads' `fillers`): each tensor's chunk
    list and properties shared as it comes (SharedRecords), so that the 581,160 ChunkRecs of a 64-rank MoE
    checkpoint are freed a thousand at a time instead of held to the end of the load (~120 MB)."""

    __slots__ = ("shared",)

    def __init__(self) -> None:
        super().__init__()
        self.shared = SharedRecords()

    def __setitem__(self, fqn: Any, item: Any) -> None:
        if type(item) is TensorStorageRec:
            self.shared.share(item)
        super().__setitem__(fqn, item)

    def __setstate__(self, state: Any) -> None:
        raise PickleRefused("a pickle may not set the state of state_dict_metadata")


def shared_tensors(meta: MetadataRec) -> dict[str, Any]:
    """`meta`'s state_dict_metadata with its tensors' records shared (already, where the pickle filled it)."""
    tensors = meta.state_dict_metadata
    if not isinstance(tensors, SharedTensors):
        shared = SharedRecords()
        for item in tensors.values():
            if type(item) is TensorStorageRec:
                shared.share(item)
    return tensors


def drained(entries: dict[Any, Any]) -> Iterator[tuple[Any, Any]]:
    """The dict's items in order, each taken out of it as it is yielded: the storage entries' records (1.7 million
    objects in a 64-rank MoE `.metadata`) are freed while the StorageIndex that replaces them grows, not after."""
    order = list(entries)
    for i, key in enumerate(order):
        order[i] = None
        yield key, entries.pop(key)


def _plain(record: _Record) -> bool:
    try:
        object.__getattribute__(record, "_more")
        return False
    except AttributeError:
        return True


def _plain_info(info: StorageInfoRec) -> bool:
    """A storage entry the index packs: a text path, two 64-bit numbers, no transform and no other field."""
    if not _plain(info):
        return False
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    return (
        type(getattr(info, "relative_path", None)) is str
        and type(offset) is int
        and type(length) is int
        and 0 <= offset < 1 << 63
        and 0 <= length < 1 << 63
        and getattr(info, "transform_descriptors", None) is None
    )


class StorageMetaRec(_Record):
    __slots__ = ("checkpoint_id", "save_id", "load_id", "modules")
    # modules: absent before torch 2.7
    _DEFAULTS: ClassVar[dict[str, Any]] = {"checkpoint_id": None, "save_id": None, "load_id": None, "modules": ()}
    checkpoint_id: Any
    save_id: str | None
    load_id: str | None
    modules: Any


def _metadata_globals() -> dict[tuple[str, str], Any]:
    classes = {
        "Metadata": MetadataRec,
        "TensorStorageMetadata": TensorStorageRec,
        "BytesStorageMetadata": BytesStorageRec,
        "ChunkStorageMetadata": ChunkRec,
        "TensorProperties": TensorPropertiesRec,
        "MetadataIndex": IndexRec,
        "StorageMeta": StorageMetaRec,
        "_MEM_FORMAT_ENCODING": lambda v: v,
        "MEM_FORMAT_ENCODING": lambda v: v,
    }
    table: dict[tuple[str, str], Any] = {}
    for module in (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed._shard.checkpoint.metadata",
        "torch.distributed._shard.sharded_tensor.metadata",
    ):
        table.update({(module, name): cls for name, cls in classes.items()})
    for module in ("torch.distributed.checkpoint.filesystem", "torch.distributed._shard.checkpoint.filesystem"):
        table[(module, "_StorageInfo")] = StorageInfoRec
    for module in ("pathlib", "pathlib._local"):  # StorageMeta.checkpoint_id, as text: a path object can be changed
        for name in ("PosixPath", "PurePosixPath"):
            table[(module, name)] = functools.partial(_path_text, PurePosixPath)
        for name in ("WindowsPath", "PureWindowsPath"):
            table[(module, name)] = functools.partial(_path_text, PureWindowsPath)
    return table


def _path_text(kind: type, *parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise PickleRefused("a path made of something other than text")
    return str(kind(*parts))


METADATA_GLOBALS = _metadata_globals()


def _read(path: Path) -> bytes | OwnCopy:
    try:
        return read_pickle_file(path, str(path))
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc


def load_metadata(path: Path, trust: bool, globals_table: dict[tuple[str, str], Any] = METADATA_GLOBALS) -> MetadataRec:
    """`.metadata` as records; its storage_data a StorageFiller and state_dict_metadata a SharedTensors (without
    the C rewrite, dicts): see `storage_index` and `shared_tensors`."""
    fillers: dict[str, Callable[[], Any]] = {"storage_data": functools.partial(StorageFiller, path), "state_dict_metadata": SharedTensors}
    meta = safe_loads(_read(path), str(path), globals_table, trust, fillers)  # no name for the bytes: freed early
    if not isinstance(meta, MetadataRec) or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise DataError(f"{path}: not a DCP Metadata pickle")
    if not isinstance(getattr(meta, "storage_data", None), dict | StorageFiller):
        raise DataError(f"{path}: no storage_data; written by a storage writer ckpt does not know")
    return meta
