"""DCP's `.metadata`: inert stand-ins for the dataclasses it pickles, and its safe load (formats/dcp.py reads the rest).

`.metadata` is unpickled through these, never with torch's raw `pickle.load`: the allow list names DCP's classes
in their current and legacy modules, and path objects become text. Facts: docs/formats.md §1.2, §1.8.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, ClassVar

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.paths import read_regular_bytes
from ckpt_cli.core.pickle_guard import PickleRefused, charge
from ckpt_cli.core.safe_pickle import Sealed, safe_loads
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
    """`.metadata`'s storage_data by (fqn, chunk offsets), held as fqn -> offsets -> entry: a dict keyed by pairs made
    a tuple per chunk (200,000 at 64 ranks: 11 MB), and `diff` holds two of these."""

    __slots__ = ("by_fqn",)

    def __init__(self) -> None:
        self.by_fqn: dict[str, dict[Any, StorageInfoRec]] = {}

    def __setitem__(self, key: StorageKey, info: StorageInfoRec) -> None:
        self.by_fqn.setdefault(key[0], {})[key[1]] = info

    def get(self, key: StorageKey) -> StorageInfoRec | None:
        inner = self.by_fqn.get(key[0])
        return None if inner is None else inner.get(key[1])

    def items(self) -> Iterator[tuple[StorageKey, StorageInfoRec]]:
        for fqn, inner in self.by_fqn.items():
            for offsets, info in inner.items():
                yield (fqn, offsets), info

    def values(self) -> Iterator[StorageInfoRec]:
        for inner in self.by_fqn.values():
            yield from inner.values()


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


def _read(path: Path) -> bytes:
    try:
        return read_regular_bytes(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc


def load_metadata(path: Path, trust: bool, globals_table: dict[tuple[str, str], Any] = METADATA_GLOBALS) -> MetadataRec:
    meta = safe_loads(_read(path), str(path), globals_table, trust)  # no name for the bytes: safe_loads frees them early
    if not isinstance(meta, MetadataRec) or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise DataError(f"{path}: not a DCP Metadata pickle")
    if not isinstance(getattr(meta, "storage_data", None), dict):
        raise DataError(f"{path}: no storage_data; written by a storage writer ckpt does not know")
    return meta
