"""Writing a Distributed Checkpoint laid out as FSDP2 (`fully_shard`, Shard(0)) on N ranks saves it.

Every model weight and optimizer moment of rank >= 1 is cut along dim 0 with `torch.chunk`
semantics (ranks past the end keep an empty chunk, listed once); 0-d tensors, buffers and other
replicated tensors are one whole chunk; non-tensor values are BYTE_IO items (copied verbatim from
a DCP source). Replicated items go to the rank file chosen the way `dedup_save_plans` chooses.
`.metadata` is built from DCP's own classes and written last. Facts: docs/formats.md §1.5-1.9.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core import pickler, zipio
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Box, Checkpoint, ObjectEntry, Opaque, PathKey, TensorEntry, sub_tensor, unsafe_value_problem
from ckpt_cli.core.paths import open_regular
from ckpt_cli.core.pickler import Global, Instance, Reduce, size
from ckpt_cli.core.plan import Literal, OutputFile, WritePlan
from ckpt_cli.core.training import apply_per_rank_rule
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import torch_save


def fsdp2_rows(n0: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of dim 0 that `rank` holds under Shard(0): torch.chunk, ceil(n0/W) rows each."""
    per = -(-n0 // world_size)
    return min(rank * per, n0), min((rank + 1) * per, n0)


def is_sharded(entry: TensorEntry, ckpt: Checkpoint) -> bool:
    """FSDP2 shards parameters (and their optimizer moments); buffers, RNG and 0-d values are replicated."""
    if not entry.shape:
        return False
    replicated = ckpt.details.get("replicated")  # buffers, named by a training-state conversion
    if replicated is not None:
        return entry.role in ("model", "optimizer") and entry.name not in replicated
    if ckpt.format == "dcp" and (ckpt.world_size or 1) > 1:
        whole = len(entry.pieces) == 1 and entry.pieces[0].region == Box((0,) * len(entry.shape), entry.shape)
        return not whole
    return entry.role in ("model", "optimizer")


def dcp_path(path: PathKey, containers: dict[PathKey, str]) -> tuple[str | int, ...]:
    """DCP's key path: dict keys as str, list positions as int (dcp/_traverse.py)."""
    return tuple(p if containers.get(path[:i]) in ("list", "tuple") and isinstance(p, int) else str(p) for i, p in enumerate(path))


@dataclass
class Item:
    """One write item of one rank's plan, as DCP's planner would make it."""

    fqn: str
    offsets: tuple[int, ...] | None  # None for BYTE_IO
    planned_bytes: int  # what dedup_save_plans counts: tensor bytes, or 1 for a non-tensor
    tensor: TensorEntry | None = None
    obj: ObjectEntry | None = None

    @property
    def key(self) -> tuple[str, tuple[int, ...] | None]:
        return self.fqn, self.offsets


def _is_leaf(value: Any) -> bool:
    """DCP's _is_terminal: mappings never are; a list is unless it holds a mapping or a non-leaf list."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return all(_is_leaf(v) or not isinstance(v, (dict, list)) for v in value)


def _leaves(path: tuple[str | int, ...], value: Any) -> list[tuple[tuple[str | int, ...], Any]]:
    """A non-tensor value flattened into DCP's BYTE_IO leaves (dcp/_traverse.py); empty dicts vanish."""
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves((*path, str(k)), v)]
    if not _is_leaf(value):
        return [leaf for i, v in enumerate(value) for leaf in _leaves((*path, i), v)]
    return [(path, value)]


def byte_items(ckpt: Checkpoint) -> list[ObjectEntry]:
    """The checkpoint's non-tensor values as DCP leaves; values read from DCP stay as they were saved."""
    out = []
    for obj in ckpt.objects.values():
        path = dcp_path(obj.path, ckpt.containers)
        if obj.raw is not None:
            out.append(ObjectEntry(".".join(map(str, path)), obj.value, obj.role, path, obj.raw))
            continue
        for leaf_path, value in _leaves(path, obj.value):
            out.append(ObjectEntry(".".join(map(str, leaf_path)), value, obj.role, leaf_path))
    return out


def rank_plans(ckpt: Checkpoint, world_size: int) -> tuple[list[list[Item]], dict[str, Any], dict[str, Any], list[ObjectEntry]]:
    """Each rank's items, the per-tensor chunk lists (offsets, sizes), planner_data and the BYTE_IO leaves."""
    plans: list[list[Item]] = [[] for _ in range(world_size)]
    chunks: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    for entry in ckpt.tensors.values():
        path = dcp_path(entry.path, ckpt.containers)
        fqn = ".".join(map(str, path))
        planner[fqn] = path
        rest = entry.shape[1:]
        inner = math.prod(rest)
        listed: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for r in range(world_size):
            if is_sharded(entry, ckpt):
                start, end = fsdp2_rows(entry.shape[0], world_size, r)
                offsets, sizes = (start, *(0 for _ in rest)), (end - start, *rest)
                part = sub_tensor(entry, fqn, start * inner, sizes)
            else:
                offsets, sizes, part = (0,) * len(entry.shape), entry.shape, entry
            if (offsets, sizes) not in listed:
                listed.append((offsets, sizes))
            plans[r].append(Item(fqn, offsets, part.nbytes, tensor=part))
        chunks[fqn] = (entry, listed)
    objects = byte_items(ckpt)
    for obj in objects:
        planner[obj.name] = obj.path
        for r in range(world_size):
            plans[r].append(Item(obj.name, None, 1, obj=obj))
    return plans, chunks, planner, objects


def dedup(plans: list[list[Item]]) -> list[list[Item]]:
    """Keep each item in one plan: the one with the fewest planned bytes so far, ties to the lowest rank
    (dcp/_dedup_save_plans.py)."""
    holders: dict[Any, list[int]] = {}
    first: dict[Any, Item] = {}
    for r, plan in enumerate(plans):
        for item in plan:
            holders.setdefault(item.key, []).append(r)
            first.setdefault(item.key, item)
    sizes = [0] * len(plans)
    chosen: dict[Any, int] = {}
    for key, ranks in holders.items():
        r = min(ranks, key=lambda i: (sizes[i], i))
        chosen[key] = r
        sizes[r] += first[key].planned_bytes
    return [[item for item in plan if chosen[item.key] == r] for r, plan in enumerate(plans)]


def _object_bytes(obj: ObjectEntry) -> bytes:
    if obj.raw is not None:  # a DCP source: the archive as torch wrote it
        path, offset, length = obj.raw
        with open_regular(path) as f:
            f.seek(offset)
            data = f.read(length)
        archive = io.BytesIO(data)  # copied verbatim: its records' CRC32 checked first, as tensor data is (core/crc.py)
        for rec in zipio.read_records(archive, f"{path} ('{obj.name}' at {offset})").values():
            problem = zipio.crc_problem(archive, rec, f"{path} ('{obj.name}' at {offset})")
            if problem:
                raise DataError(problem)
        return data
    return torch_save.object_archive(obj.value)


def _per_rank_view(ckpt: Checkpoint, world: int, rule: str) -> tuple[Checkpoint, str | None]:
    """Per-rank values (dataloader positions, RNG states) re-keyed for the new world size by `rule`."""
    if ckpt.details.get("per_rank_applied"):  # a training state laid out for `world` ranks already
        return ckpt, None
    extras = [*ckpt.objects.values(), *(t for t in ckpt.tensors.values() if t.role == "other")]
    entries, note = apply_per_rank_rule(extras, world, rule)
    if not note:
        return ckpt, None
    objects = {e.name: e for e in entries if isinstance(e, ObjectEntry)}
    kept = {e.name: e for e in entries if isinstance(e, TensorEntry)}
    tensors = {n: t for n, t in ckpt.tensors.items() if t.role != "other"} | kept
    return dataclasses.replace(ckpt, tensors=tensors, objects=objects), note


class DCPWriter:
    name = "dcp"
    dest_is_dir = True

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        world_size = options.world_size or ckpt.world_size
        if not world_size:
            raise UsageError("writing dcp needs --world-size N (the number of FSDP2 ranks to lay it out for)")
        ckpt, per_rank_note = _per_rank_view(ckpt, world_size, options.per_rank_rule)
        notes = [per_rank_note] if per_rank_note else []
        unsafe = ckpt.unsafe_values()
        if unsafe:  # its raw bytes would be copied, and dcp.load would run them
            raise DataError(f"refusing to copy a pickled value the allow list rejects: {unsafe_value_problem(unsafe[0])}")
        opaque = [o.name for o in ckpt.objects.values() if isinstance(o.value, Opaque) and o.raw is None]
        if opaque:
            raise UsageError(f"cannot write non-tensor values that were not parsed: {', '.join(opaque[:3])} (try --trust-pickle)")
        plans, chunks, planner, objects = rank_plans(ckpt, world_size)
        kept = dedup(plans)
        files, storage = [], {}
        for r, items in enumerate(kept):
            name = f"__{r}_0.distcp"
            segments: list[Any] = []
            pos = 0
            # BYTE_IO items first, then tensors, as FileSystemWriter orders a rank's file.
            for item in [i for i in items if i.obj is not None] + [i for i in items if i.tensor is not None]:
                if item.obj is not None:
                    parts = [Literal(_object_bytes(item.obj))]
                else:
                    parts = torch_save.tensor_archive(item.tensor, f"{item.fqn}@{item.offsets}")  # type: ignore[arg-type]
                length = sum(p.size for p in parts)
                storage[item.key] = (name, pos, length)
                segments += parts
                pos += length
            files.append(OutputFile(name, segments))
        files.append(OutputFile(".metadata", [Literal(metadata_bytes(chunks, planner, storage, objects, dest))], commit_marker=True))
        sharded = sum(1 for entry, listed in chunks.values() if len(listed) > 1 or is_sharded(entry, ckpt))
        notes.append(
            f"layout: FSDP2 Shard(0) on {world_size} ranks; {sharded} tensors sharded by rows, "
            f"{len(chunks) - sharded} replicated, {len(ckpt.objects)} non-tensor values"
        )
        return WritePlan(self.name, dest, True, files, notes)


_META = "torch.distributed.checkpoint.metadata"


def _cls(name: str, module: str = _META) -> Global:
    return Global(module, name)


def _properties(entry: TensorEntry) -> Instance:
    """TensorProperties as its __getstate__ pickles it: (dtype, layout, requires_grad, memory format, pinned)."""
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(_cls("_MEM_FORMAT_ENCODING"), (0,))
    return Instance(_cls("TensorProperties"), (entry.dtype, layout, False, contiguous, False))


def metadata_bytes(
    chunks: dict[str, Any], planner: dict[str, Any], storage: dict[Any, tuple[str, int, int]], objects: list[ObjectEntry], dest: Path
) -> bytes:
    """`.metadata` as FileSystemWriter.finish pickles DCP's dataclasses (written without importing torch)."""
    sdm: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}

    def storage_info(key: Any) -> Instance:
        path, offset, length = storage[key]
        return Instance(
            _cls("_StorageInfo", "torch.distributed.checkpoint.filesystem"), {"relative_path": path, "offset": offset, "length": length}
        )

    for fqn, (entry, listed) in chunks.items():
        chunk_list = [Instance(_cls("ChunkStorageMetadata"), {"offsets": size(o), "sizes": size(s)}) for o, s in listed]
        sdm[fqn] = Instance(
            _cls("TensorStorageMetadata"), {"properties": _properties(entry), "size": size(entry.shape), "chunks": chunk_list}
        )
        for i, (offsets, _) in enumerate(listed):
            index = Instance(_cls("MetadataIndex"), {"fqn": fqn, "index": i, "offset": size(offsets)})
            storage_data[index] = storage_info((fqn, offsets))
    for obj in objects:
        sdm[obj.name] = Instance(_cls("BytesStorageMetadata"))
        storage_data[Instance(_cls("MetadataIndex"), {"fqn": obj.name, "index": None})] = storage_info((obj.name, None))
    body = repr((sorted(storage.items()), sorted(planner))).encode()
    save_id = str(uuid.UUID(bytes=hashlib.sha256(body).digest()[:16], version=4))  # reproducible, unlike uuid4()
    storage_meta = Instance(
        _cls("StorageMeta"),
        {"checkpoint_id": Reduce(Global("pathlib", "PosixPath"), (str(dest),)), "save_id": save_id, "load_id": None, "modules": []},
    )
    meta = {
        "state_dict_metadata": sdm,
        "planner_data": planner,
        "storage_data": storage_data,
        "storage_meta": storage_meta,
        "version": "1.0.0",
    }
    return pickler.dumps(Instance(_cls("Metadata"), meta))


WRITER = DCPWriter()
