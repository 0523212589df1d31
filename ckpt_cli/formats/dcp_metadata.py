"""DCP's `.metadata`: inert stand-ins for the dataclasses it pickles, and its safe load (formats/dcp.py reads the rest).

`.metadata` is unpickled through these, never with torch's raw `pickle.load`: the allow list names DCP's classes
in their current and legacy modules, and path objects become text. Facts: docs/formats.md §1.2, §1.8.
"""

from __future__ import annotations

import functools
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.paths import read_regular_bytes
from ckpt_cli.core.pickle_guard import PickleRefused, charge
from ckpt_cli.core.safe_pickle import Sealed, safe_loads
from ckpt_cli.errors import DataError


# Inert stand-ins for the pickled classes of dcp/metadata.py and dcp/filesystem.py (Sealed: a pickle cannot
# change the classes themselves; each instance is the pickle's own).
class _Record(metaclass=Sealed):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            charge(len(state))
            self.__dict__.update(state)
        else:
            self._state = state


class MetadataRec(_Record):
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: str | None = None


class TensorStorageRec(_Record):
    properties: Any
    size: tuple[int, ...]
    chunks: list[Any]


class BytesStorageRec(_Record):
    pass


class ChunkRec(_Record):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class TensorPropertiesRec(_Record):
    dtype: DType

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and state and isinstance(state[0], DType):  # the 5-tuple __getstate__
            self.dtype = state[0]
        else:
            super().__setstate__(state)


class IndexRec(_Record):
    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = None

    def key(self) -> tuple[str, tuple[int, ...] | None]:
        return self.fqn, None if self.offset is None else tuple(self.offset)


class StorageInfoRec(_Record):
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


class StorageMetaRec(_Record):
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = []  # noqa: RUF012 - absent before torch 2.7


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


def load_metadata(path: Path, trust: bool, globals_table: dict[tuple[str, str], Any] = METADATA_GLOBALS) -> MetadataRec:
    try:
        data = read_regular_bytes(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
    meta = safe_loads(data, str(path), globals_table, trust)
    if not isinstance(meta, MetadataRec) or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise DataError(f"{path}: not a DCP Metadata pickle")
    if not isinstance(getattr(meta, "storage_data", None), dict):
        raise DataError(f"{path}: no storage_data; written by a storage writer ckpt does not know")
    return meta
