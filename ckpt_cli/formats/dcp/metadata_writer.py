"""Writing a DCP `.metadata` as FileSystemWriter.finish pickles it (DCP's dataclasses, written without importing torch:
core/pickles/pickler.py), from the writer's placed items: each knows its key (fqn, chunk offsets), its sizes and where it is
stored (file, offset, length). The records DCP pickles per chunk (ChunkStorageMetadata, MetadataIndex, _StorageInfo)
are made only as the pickler writes them. Facts: docs/formats.md §1.5-1.9.
"""

from __future__ import annotations

import hashlib
import itertools
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import TensorEntry
from ckpt_cli.core.pickles import pickler
from ckpt_cli.core.pickles.pickler import Global, Instance, Reduce
from ckpt_cli.core.pickles.safe_pickle import TorchSize


class Placed(Protocol):
    """A write item once placed in a rank's file."""

    fqn: str
    offsets: tuple[int, ...] | None
    file: str
    pos: int
    length: int

    @property
    def key(self) -> tuple[str, tuple[int, ...] | None]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


class Chunks(Protocol):
    """A tensor's placed items, made as they are iterated."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


_META = "torch.distributed.checkpoint.metadata"


def _cls(name: str, module: str = _META) -> Global:
    return Global(module, name)


def _properties(dtype: DType) -> Instance:
    """TensorProperties as its __getstate__ pickles it: (dtype, layout, requires_grad, memory format, pinned)."""
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(_cls("_MEM_FORMAT_ENCODING"), (0,))
    return Instance(_cls("TensorProperties"), (dtype, layout, False, contiguous, False))


class _IndexOf:
    """MetadataIndex(fqn, index, offset) of an item, made only as the pickler writes it (as are the two below): a wide
    `.metadata` holds hundreds of thousands of each, which as DCP's dataclasses with their state dicts took ~1 KB a
    chunk all at once."""

    __slots__ = ("item", "index")

    def __init__(self, item: Placed, index: int | None) -> None:
        self.item, self.index = item, index


class _StoredAt:
    """_StorageInfo(relative_path, offset, length) of an item."""

    __slots__ = ("item",)

    def __init__(self, item: Placed) -> None:
        self.item = item


def _index_state(key: _IndexOf) -> Instance:
    if key.index is None:
        return Instance(_cls("MetadataIndex"), {"fqn": key.item.fqn, "index": None})
    return Instance(_cls("MetadataIndex"), {"fqn": key.item.fqn, "index": key.index, "offset": TorchSize(_offsets(key.item))})


def _stored_state(at: _StoredAt) -> Instance:
    item = at.item
    return Instance(_STORAGE_INFO, {"relative_path": item.file, "offset": item.pos, "length": item.length})


def _chunk_state(item: Placed) -> Instance:
    """ChunkStorageMetadata(offsets, sizes) of a placed item: the items themselves are the tensors' chunk lists."""
    return Instance(_cls("ChunkStorageMetadata"), {"offsets": TorchSize(_offsets(item)), "sizes": TorchSize(item.shape)})


def _offsets(item: Placed) -> tuple[int, ...]:
    """A tensor chunk's offsets (only a byte item, which is never indexed nor listed as a chunk, has none)."""
    if item.offsets is None:
        raise ValueError(f"{item.fqn}: a byte item has no chunk offsets")
    return item.offsets


_STORAGE_INFO = _cls("_StorageInfo", "torch.distributed.checkpoint.filesystem")
pickler.register(_IndexOf, _index_state)
pickler.register(_StoredAt, _stored_state)


def metadata_parts(
    chunks: Mapping[str, tuple[TensorEntry, Chunks]],
    planner: dict[str, Any],
    objects: list[Any],
    dest: Path,
    order: list[str] | None = None,
    *,
    chunk_class: type,
) -> Iterator[bytes | memoryview]:
    """`.metadata`, in consecutive parts made as they are asked for, as FileSystemWriter.finish pickles DCP's
    dataclasses (written without importing torch), from the placed items (`chunks`: each tensor's, made as they are
    iterated; `objects`: the BYTE_IO ones; `chunk_class`: the class of the tensors' items, pickled as their
    ChunkStorageMetadata); `order`: the keys in the order the global
    plan first meets them (state_dict_metadata's order in a real save). Both dicts that grow with the chunks,
    state_dict_metadata and storage_data, are pickled a thousand entries at a time where their markers stand, so a
    caller writing the parts out holds one batch's bytes at a time, not the file's (100 MB for 600,000 chunks)."""
    pickler.register(chunk_class, _chunk_state)
    dtypes = {entry.dtype: None for entry, _ in chunks.values()}
    properties = {dtype: _properties(dtype) for dtype in dtypes}  # one description per dtype, written in full each time
    byte_keys = {item.fqn for item in objects}
    keys = [*chunks, *(item.fqn for item in objects)]
    if order:
        keys = list(dict.fromkeys([*(key for key in order if key in chunks or key in byte_keys), *keys]))

    def described(fqn: str) -> Instance:  # sizes as TorchSize: torch.Size(dims) when pickled, a tuple here
        if fqn in byte_keys:
            return Instance(_cls("BytesStorageMetadata"))
        entry, listed = chunks[fqn]
        state = {"properties": properties[entry.dtype], "size": TorchSize(entry.shape), "chunks": list(listed)}
        return Instance(_cls("TensorStorageMetadata"), state)

    def tensors() -> Iterator[list[tuple[str, Instance]]]:
        for start in range(0, len(keys), pickler.BATCH):
            yield [(fqn, described(fqn)) for fqn in keys[start : start + pickler.BATCH]]

    count = sum(len(listed) for _, listed in chunks.values()) + len(objects)

    def indexed() -> Iterator[tuple[Any, int | None]]:  # storage_data's keys in the order a dict of them would hold
        for _, listed in chunks.values():
            yield from zip(listed, range(len(listed)))
        yield from ((item, None) for item in objects)

    def batches() -> Iterator[list[tuple[_IndexOf, _StoredAt]]]:
        it = indexed()
        while batch := [(_IndexOf(item, i), _StoredAt(item)) for item, i in itertools.islice(it, pickler.BATCH)]:
            yield batch

    body = hashlib.sha256()  # item by item, in key order (a key's fqn, then its offsets): one fqn's items at a time
    by_fqn: dict[str, Iterable[Any]] = {fqn: listed for fqn, (_, listed) in chunks.items()}
    by_fqn.update((item.fqn, [item]) for item in objects)
    for fqn in sorted(by_fqn):
        for item in sorted(by_fqn[fqn], key=lambda item: item.key):
            body.update(repr((item.key, (item.file, item.pos, item.length))).encode())
    for value in sorted(planner):
        body.update(repr(value).encode())
    save_id = str(uuid.UUID(bytes=body.digest()[:16], version=4))  # reproducible, unlike uuid4()
    storage_meta = Instance(
        _cls("StorageMeta"),
        {"checkpoint_id": Reduce(Global("pathlib", "PosixPath"), (str(dest),)), "save_id": save_id, "load_id": None, "modules": []},
    )
    # state_dict_metadata, a record for each tensor and chunk, and storage_data, two records for each chunk, are
    # written a thousand entries at a time where their markers stand
    state_dict_metadata = pickler.SplicedDict(f"\0ckpt state_dict_metadata {uuid.uuid4()}\0", len(keys), tensors)
    storage_data = pickler.SplicedDict(f"\0ckpt storage_data {uuid.uuid4()}\0", count, batches)
    meta = {
        "state_dict_metadata": state_dict_metadata.marker,
        "planner_data": planner,
        "storage_data": storage_data.marker,
        "storage_meta": storage_meta,
        "version": "1.0.0",
    }
    # Every global the pickle names, known up front: each one met unannounced restarts the dump (it pickled the
    # 200,000 chunks of a 1,024-rank `.metadata` four times), and one met in a spliced dict is an error.
    expected: list[Global | DType] = [_cls("Metadata"), _cls("StorageMeta"), Global("pathlib", "PosixPath")]
    if objects:
        expected.append(_cls("BytesStorageMetadata"))
    if chunks:
        expected += [_cls(n) for n in ("TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata")]
        expected += [Global("torch.serialization", "_get_layout"), _cls("_MEM_FORMAT_ENCODING"), Global("torch", "Size"), *dtypes]
    if count:
        expected += [_cls("MetadataIndex"), _STORAGE_INFO]
    stand_ins = [(chunk_class, _cls("ChunkStorageMetadata")), (_IndexOf, _cls("MetadataIndex")), (_StoredAt, _STORAGE_INFO)]
    # keys and file names written once each: without the memo every chunk would repeat them (torch's own `.metadata`
    # refers to them; so the file and whatever reads it stay as small)
    texts = [*keys, *{item.file: None for item, _ in indexed()}]
    return pickler.dump_parts(
        Instance(_cls("Metadata"), meta),
        expected=expected,
        shared=False,
        strings=texts,
        stand_ins=stand_ins,
        spliced=[state_dict_metadata, storage_data],
    )
