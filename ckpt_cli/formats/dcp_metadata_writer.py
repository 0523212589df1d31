"""Writing a DCP `.metadata` as FileSystemWriter.finish pickles it (DCP's dataclasses, written without importing torch:
core/pickler.py), from the writer's placed items: each knows its key (fqn, chunk offsets), its sizes and where it is
stored (file, offset, length). The records DCP pickles per chunk (ChunkStorageMetadata, MetadataIndex, _StorageInfo)
are made only as the pickler writes them; the bytes are joined from the few distinct pieces the pickler writes once
(a chunk's box, a tensor's properties) and each chunk's numbers (`_assembled`), the same bytes as pickling every
record (tests/test_wide_plans.py). Facts: docs/formats.md §1.5-1.9.
"""

from __future__ import annotations

import hashlib
import pickle
import uuid
from pathlib import Path
from typing import Any, Protocol

from ckpt_cli.core import pickler
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import TensorEntry
from ckpt_cli.core.pickler import Fragments, Global, Instance, Reduce, Unannounced, placeholder
from ckpt_cli.core.safe_pickle import TorchSize


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


_META = "torch.distributed.checkpoint.metadata"


def _cls(name: str, module: str = _META) -> Global:
    return Global(module, name)


def _properties(entry: TensorEntry) -> Instance:
    """TensorProperties as its __getstate__ pickles it: (dtype, layout, requires_grad, memory format, pinned)."""
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(_cls("_MEM_FORMAT_ENCODING"), (0,))
    return Instance(_cls("TensorProperties"), (entry.dtype, layout, False, contiguous, False))


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
    return Instance(_cls("MetadataIndex"), {"fqn": key.item.fqn, "index": key.index, "offset": TorchSize(key.item.offsets)})


def _stored_state(at: _StoredAt) -> Instance:
    item = at.item
    return Instance(_STORAGE_INFO, {"relative_path": item.file, "offset": item.pos, "length": item.length})


def _chunk_state(item: Placed) -> Instance:
    """ChunkStorageMetadata(offsets, sizes) of a placed item: the items themselves are the tensors' chunk lists."""
    return Instance(_cls("ChunkStorageMetadata"), {"offsets": TorchSize(item.offsets), "sizes": TorchSize(item.shape)})


_STORAGE_INFO = _cls("_StorageInfo", "torch.distributed.checkpoint.filesystem")
_POSIX_PATH = Global("pathlib", "PosixPath")
pickler.register(_IndexOf, _index_state)
pickler.register(_StoredAt, _stored_state)


def metadata_bytes(
    chunks: dict[str, tuple[TensorEntry, list[Any]]],
    planner: dict[str, Any],
    objects: list[Any],
    dest: Path,
    order: list[str] | None = None,
    *,
    chunk_class: type,
    generic: bool = False,
) -> bytes:
    """`.metadata` as FileSystemWriter.finish pickles DCP's dataclasses (written without importing torch), from the
    placed items (`objects`: the BYTE_IO ones; `chunk_class`: the class of the tensors' items, pickled as their
    ChunkStorageMetadata); `order`: the keys in the order the global plan first meets them (state_dict_metadata's
    order in a real save). `generic`: pickled object by object (what the assembled bytes are tested against)."""
    pickler.register(chunk_class, _chunk_state)
    sdm: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    dtypes: dict[DType, None] = {}
    for fqn, (entry, listed) in chunks.items():  # sizes as TorchSize: torch.Size(dims) when pickled, a tuple here
        sdm[fqn] = Instance(
            _cls("TensorStorageMetadata"), {"properties": _properties(entry), "size": TorchSize(entry.shape), "chunks": listed}
        )
        dtypes[entry.dtype] = None
        for i, item in enumerate(listed):
            storage_data[_IndexOf(item, i)] = _StoredAt(item)
    for item in objects:
        sdm[item.fqn] = Instance(_cls("BytesStorageMetadata"))
        storage_data[_IndexOf(item, None)] = _StoredAt(item)
    if order:
        sdm = {key: sdm[key] for key in order if key in sdm} | sdm
    save_id = _save_id(storage_data, planner)
    storage_meta = Instance(
        _cls("StorageMeta"),
        {"checkpoint_id": Reduce(_POSIX_PATH, (str(dest),)), "save_id": save_id, "load_id": None, "modules": []},
    )
    expected: list[Global | DType] = [_cls("Metadata"), _cls("StorageMeta"), _POSIX_PATH]
    # Every global the pickle names, known up front: each one met unannounced restarts a dump (it pickled the 200,000
    # chunks of a 1,024-rank `.metadata` four times).
    if objects:
        expected.append(_cls("BytesStorageMetadata"))
    if chunks:
        expected += [_cls(n) for n in ("TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata")]
        expected += [Global("torch.serialization", "_get_layout"), _cls("_MEM_FORMAT_ENCODING"), Global("torch", "Size"), *dtypes]
    if storage_data:
        expected += [_cls("MetadataIndex"), _STORAGE_INFO]
    stand_ins = [(chunk_class, _cls("ChunkStorageMetadata")), (_IndexOf, _cls("MetadataIndex")), (_StoredAt, _STORAGE_INFO)]
    # keys and file names written once each: without the memo every chunk would repeat them (torch's own `.metadata`
    # refers to them; so the file and whatever reads it stay as small)
    texts = [*sdm, *{key.item.file: None for key in storage_data}]
    if not generic:
        try:
            return _assembled(Fragments(expected, texts, stand_ins), sdm, planner, storage_data, storage_meta)
        except Unannounced:  # a value naming a global the list above misses: the pickler finds it
            pass
    meta = {"state_dict_metadata": sdm, "planner_data": planner, "storage_data": storage_data, "storage_meta": storage_meta}
    meta["version"] = VERSION
    return pickler.dumps(Instance(_cls("Metadata"), meta), expected=expected, shared=False, strings=texts, stand_ins=stand_ins)


def _save_id(storage_data: dict[_IndexOf, _StoredAt], planner: dict[str, Any]) -> str:
    """A save id that follows from what is saved where (reproducible, unlike uuid4())."""
    body = hashlib.sha256()  # item by item: the repr of 200,000 entries at once is tens of MB
    placed = sorted((key.item for key in storage_data), key=lambda item: item.key)
    for value in [*((item.key, (item.file, item.pos, item.length)) for item in placed), *sorted(planner)]:
        body.update(repr(value).encode())
    return str(uuid.UUID(bytes=body.digest()[:16], version=4))


# ---- assembled from fragments ----------------------------------------------------------------------------------
# The C pickler calls back into Python for every object of ckpt's (a few per chunk: ~15 us a chunk). Here the few
# distinct pieces (a chunk's box, a tensor's properties, the fixed keys) are pickled once each by the same pickler
# under the same memo (core/pickler.Fragments) and the per-chunk records are joined from them and the numbers, with
# the containers batched as the C pickler batches them: the same bytes (tests/test_wide_plans.py compares them).

BATCH = 1000  # _pickle.c BATCHSIZE
VERSION = "1.0.0"


def _dict_bytes(pairs: list[bytes]) -> bytes:
    """A dict of these (key + value) pairs: EMPTY_DICT, then SETITEM for one pair, else MARK ... SETITEMS per batch of
    1,000, with an empty batch after a full last one (_pickle.c batch_dict_exact loops while a batch was full)."""
    out = [pickle.EMPTY_DICT]
    if len(pairs) == 1:
        out += [pairs[0], pickle.SETITEM]
    elif pairs:
        i = 0
        while True:
            batch = pairs[i : i + BATCH]
            out += [pickle.MARK, *batch, pickle.SETITEMS]
            i += BATCH
            if len(batch) < BATCH:
                break
    return b"".join(out)


def _list_bytes(items: list[bytes]) -> bytes:
    """A list of these values: EMPTY_LIST, then APPEND for one, else MARK ... APPENDS per batch of 1,000."""
    out = [pickle.EMPTY_LIST]
    if len(items) == 1:
        out += [items[0], pickle.APPEND]
    else:
        for i in range(0, len(items), BATCH):
            out += [pickle.MARK, *items[i : i + BATCH], pickle.APPENDS]
    return b"".join(out)


def _newobj(cls: bytes, pairs: list[bytes]) -> bytes:
    """NEWOBJ of a class the memo holds, then BUILD with a state dict of these pairs."""
    return cls + pickle.EMPTY_TUPLE + pickle.NEWOBJ + _dict_bytes(pairs) + pickle.BUILD


def _int_bytes(value: int, frag: Fragments) -> bytes:
    """An int's opcode as the C pickler writes it: BININT1, BININT2, BININT, else LONG1 (from the pickler itself)."""
    if 0 <= value < 256:
        return pickle.BININT1 + bytes((value,))
    if 0 <= value < 65536:
        return pickle.BININT2 + value.to_bytes(2, "little")
    if -(1 << 31) <= value < (1 << 31):
        return pickle.BININT + value.to_bytes(4, "little", signed=True)
    return frag.of(value)


def _assembled(
    frag: Fragments, sdm: dict[str, Instance], planner: dict[str, Any], storage_data: dict[_IndexOf, _StoredAt], storage_meta: Instance
) -> bytes:
    keys = ("fqn", "index", "offset", "relative_path", "length", "properties", "size", "chunks")
    key = {k: frag.of(k) for k in keys}
    memo_texts = {id(t): frag.of(t) for t in frag.texts}  # BINGETs of the fqns and file names
    made: dict[Any, bytes] = {}  # distinct pieces: chunk boxes, sizes, properties, record classes

    def text(value: str) -> bytes:
        found = memo_texts.get(id(value))
        return found if found is not None else frag.of(value)

    def size(value: tuple[int, ...]) -> bytes:
        if ("size", value) not in made:
            made["size", value] = frag.of(TorchSize(value))
        return made["size", value]

    def once(tag: Any, value: Any) -> bytes:
        if tag not in made:
            made[tag] = frag.of(value)
        return made[tag]

    def chunk(item: Placed) -> bytes:
        box = ("chunk", item.offsets, item.shape)
        found = made.get(box)
        if found is None:
            found = made[box] = frag.of(_chunk_state(item))
        return found

    index_cls = once("index", placeholder(_cls("MetadataIndex")))
    stored_cls = once("stored", placeholder(_STORAGE_INFO))
    described = []
    for fqn, value in sdm.items():
        if value.state is None:  # BytesStorageMetadata
            described.append(text(fqn) + once(("object", value.cls), value))
            continue
        state = value.state
        properties = once(("properties", state["properties"].state[0]), state["properties"])
        listed = _list_bytes([chunk(item) for item in state["chunks"]])
        pairs = [key["properties"] + properties, key["size"] + size(state["size"]), key["chunks"] + listed]
        described.append(text(fqn) + _newobj(once(("class", value.cls), placeholder(value.cls)), pairs))
    # Each entry: MetadataIndex(fqn, index, offset) then _StorageInfo(relative_path, offset, length), both NEWOBJ + a
    # state dict of 2-3 pairs (MARK ... SETITEMS) + BUILD, joined from constant runs around the per-chunk values.
    opened = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK
    closed = pickle.SETITEMS + pickle.BUILD
    index_head, stored_head = index_cls + opened + key["fqn"], stored_cls + opened + key["relative_path"]
    entries = []
    for at, where in storage_data.items():
        item = at.item
        if at.index is None:
            index = index_head + text(item.fqn) + key["index"] + pickle.NONE + closed
        else:
            offset = size(item.offsets)
            index = b"".join((index_head, text(item.fqn), key["index"], _int_bytes(at.index, frag), key["offset"], offset, closed))
        stored = where.item
        pos, length = _int_bytes(stored.pos, frag), _int_bytes(stored.length, frag)
        entries.append(b"".join((index, stored_head, text(stored.file), key["offset"], pos, key["length"], length, closed)))
    pairs = [
        frag.of("state_dict_metadata") + _dict_bytes(described),
        frag.of("planner_data") + frag.of(planner),
        frag.of("storage_data") + _dict_bytes(entries),
        frag.of("storage_meta") + frag.of(storage_meta),
        frag.of("version") + frag.of(VERSION),
    ]
    return frag.preamble + _newobj(frag.of(placeholder(_cls("Metadata"))), pairs) + pickle.STOP
