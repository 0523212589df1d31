"""Writing a Distributed Checkpoint laid out as FSDP2 (`fully_shard`) saves it on N ranks, alone (Shard(0)) or with
tensor parallel on a dp x tp mesh (`--tp T`).

Without --tp every model weight and optimizer moment of rank >= 1 is cut along dim 0 with `torch.chunk`
semantics (ranks past the end keep an empty chunk, listed once). With --tp each sharded tensor keeps the split
its source chunks show (the dim FSDP shards, the dim tensor parallel shards: formats/dcp/mesh.py) and is cut as
FSDP2 + TP cut it on the new mesh. 0-d tensors, buffers and other replicated tensors are one whole chunk;
non-tensor values are BYTE_IO items (copied verbatim from a DCP source). Replicated items go to the rank file
chosen the way `dedup_save_plans` chooses. `.metadata` is built from DCP's own classes and written last.
Facts: docs/formats.md §1.5-1.9, §1.13.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core.boxes import sub_box
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import (
    Box,
    Checkpoint,
    LazyPieces,
    ObjectEntry,
    Opaque,
    PathKey,
    TensorEntry,
    unsafe_value_problem,
)
from ckpt_cli.core.paths import open_regular
from ckpt_cli.core.pickles import zipio
from ckpt_cli.core.training import apply_per_rank_rule
from ckpt_cli.core.write.plan import FileSizes, Literal, OutputFile, WritePlan
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import torch_save
from ckpt_cli.formats.dcp import plan as dcp_plan
from ckpt_cli.formats.dcp.mesh import Saved, SourceMesh, Split, parse_mesh, source_mesh
from ckpt_cli.formats.dcp.metadata_writer import metadata_parts
from ckpt_cli.formats.dcp.plan import Plan, TensorPlan
from ckpt_cli.formats.dcp.reader import DATA_FILE


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


@dataclass
class Layout:
    """The mesh a write lays tensors out on and each sharded tensor's split (dp, tp); others are written whole."""

    mesh: tuple[int, int]
    splits: dict[str, Split]
    notes: list[str]


def saved_chunks(entry: TensorEntry) -> Saved | None:
    """The boxes the source stored the tensor in (DCP chunks, DTensor shards), each with the rank whose DCP file holds
    it (`__{r}_{i}.distcp`; None for other files); None when its pieces are flat ranges."""
    out = set()
    for p in entry.pieces:
        if not isinstance(p.region, Box):
            return None
        m = DATA_FILE.search(p.data.path)
        out.add(((p.region.offsets, p.region.sizes), int(m.group(1)) if m else None))
    return frozenset(out)


def _source_mesh(ckpt: Checkpoint, sharded: list[TensorEntry]) -> SourceMesh | str:
    world = ckpt.world_size or 1
    tensors = {}
    same: dict[tuple[tuple[int, ...], Saved], tuple[tuple[int, ...], Saved]] = {}  # equal layouts as one object
    for entry in sharded:
        boxes = saved_chunks(entry)
        if boxes is None:
            return f"'{entry.name}' is stored as flat ranges, not as boxes of the tensor"
        key = (entry.shape, boxes)
        tensors[entry.name] = same.setdefault(key, key)  # thousands of tensors, a few layouts: 64 ranks x 8,000 chunk sets
    if world == 1 or not tensors:
        return "it is not sharded"
    return source_mesh(tensors, world)


def layout_for(ckpt: Checkpoint, world: int, tp: int | None) -> Layout:
    """FSDP2 alone on `world` ranks (tp None), or FSDP2 + tensor parallel on a (world / tp) x tp mesh with each tensor
    split as its source chunks show; UsageError when --tp > 1 and the source does not say how tensors are split."""
    sharded = [e for e in ckpt.tensors.values() if is_sharded(e, ckpt)]
    found = _source_mesh(ckpt, sharded) if tp is not None or (ckpt.world_size or 1) > 1 else "it is not sharded"
    says = isinstance(found, SourceMesh) and found.tensor_parallel
    if tp is None or (tp == 1 and not says):
        notes = []
        if says:
            assert isinstance(found, SourceMesh)
            notes.append(
                f"the source is FSDP2 + tensor parallel on a {found.dp}x{found.tp} (dp, tp) mesh; written as FSDP2 alone "
                f"(Shard(0)) on {world} ranks: --tp T keeps tensor parallel on a {world}/T x T mesh"
            )
        return Layout((world, 1), {e.name: Split(0, None) for e in sharded}, notes)
    try:
        mesh = parse_mesh(world, tp)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not says:
        if isinstance(found, SourceMesh):
            found = (
                f"its chunks are FSDP's alone on {found.dp} ranks"
                if found.tp == 1
                else f"on its {found.dp}x{found.tp} mesh no tensor is split by tensor parallel"
            )
        where = f"{ckpt.path}: " if ckpt.path else ""
        raise UsageError(
            f"{where}--tp {tp} needs to know which tensors tensor parallel splits, and along which dim, and the source does not "
            f"say ({found}); leave out --tp (FSDP2 alone), or start from a checkpoint saved with tensor parallel"
        )
    assert isinstance(found, SourceMesh)
    kinds = {"strided": 0, "tp": 0, "fsdp": 0}
    for split in found.splits.values():
        kinds["strided" if split.tp_dim is not None and split.tp_dim == split.dp_dim else "tp" if split.tp_dim is not None else "fsdp"] += 1
    notes = [
        f"layout: FSDP2 + tensor parallel on a {mesh[0]}x{mesh[1]} (dp, tp) mesh (the source's: {found.dp}x{found.tp}); "
        f"{kinds['strided']} tensors split by tp and FSDP on the same dim (_StridedShard), {kinds['tp']} by tp and FSDP on "
        f"different dims, {kinds['fsdp']} by FSDP alone, {len(ckpt.tensors) - len(sharded)} replicated"
    ]
    if found.others:
        notes.append(f"the source's chunks fit a {' and a '.join(found.others)} mesh too; read as {found.dp}x{found.tp}")
    if found.dp == 1 and mesh[0] > 1:
        notes.append(
            "the source's dp size is 1, so its chunks do not record which tensors FSDP shards or along which dim: "
            "tensors it holds whole are written whole, the others sharded by FSDP on dim 0"
        )
    if found.ambiguous:
        notes.append(
            f"{len(found.ambiguous)} tensors' chunks fit more than one split (e.g. '{found.ambiguous[0]}'); each is written "
            "with the plainest (FSDP on dim 0 first)"
        )
    return Layout(mesh, found.splits, notes)


def rank_plans(ckpt: Checkpoint, layout: Layout) -> tuple[Plan, dict[str, Any]]:
    """Every item the ranks plan, once, with the ranks whose plans hold it, in plan order (formats/dcp/plan.py), and
    planner_data."""
    world = layout.mesh[0] * layout.mesh[1]
    everyone = range(world)
    tensors: list[TensorPlan] = []
    planner: dict[str, Any] = {}
    same: dict[Any, Any] = {}  # equal sizes as one object
    boxes: dict[tuple[tuple[int, ...], Split | None], list[dcp_plan.Box]] = {}
    for entry in ckpt.tensors.values():
        path = dcp_path(entry.path, ckpt.containers)
        fqn = ".".join(map(str, path))
        planner[fqn] = path
        split = layout.splits.get(entry.name)
        key = (entry.shape, split)
        if key not in boxes:  # thousands of tensors, a few shapes: each shape's boxes computed once, not per tensor
            whole: list[dcp_plan.Box] = [((0,) * len(entry.shape), None, everyone)]
            boxes[key] = whole if split is None else dcp_plan.boxes_with_holders(entry.shape, split, layout.mesh, same)
        tensors.append(TensorPlan(fqn, entry, boxes[key]))
    values = [dcp_plan.Item(obj.name, obj) for obj in byte_items(ckpt)]
    for item in values:
        planner[item.fqn] = item.obj.path
    members: list[tuple[str, int]] = [(t.fqn, i) for i, t in enumerate(tensors)] + [(v.fqn, -1 - k) for k, v in enumerate(values)]
    order = flat_order(ckpt)
    if order:  # as the source's state dict was flattened: dedup_save_plans meets the items in that order
        members.sort(key=lambda m: order.get(m[0], len(order)))
    plan = Plan(tensors, values, world)
    for _, which in members:
        count = len(tensors[which].boxes) if which >= 0 else 1
        plan.which.extend([which] * count)
        plan.box.extend(range(count))
    return plan, planner


def flat_order(ckpt: Checkpoint) -> dict[str, int]:
    """The order a DCP source's state dict was flattened in (its planner_data), by flat key; empty for other sources."""
    planner = getattr(getattr(ckpt.source, "metadata", None), "planner_data", None)
    return {str(fqn): i for i, fqn in enumerate(planner)} if isinstance(planner, dict) else {}


def object_bytes(obj: ObjectEntry) -> bytes:
    if obj.raw is not None:  # a DCP source: the archive as torch wrote it
        path, offset, length = obj.raw
        with open_regular(path) as f:
            f.seek(offset)
            data = f.read(length)
        archive = io.BytesIO(data)  # copied verbatim: its records' CRC32 checked first, as tensor data is (core/write/crc.py)
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
    extras: list[ObjectEntry | TensorEntry] = [*ckpt.objects.values(), *(t for t in ckpt.tensors.values() if t.role == "other")]
    entries, note = apply_per_rank_rule(extras, world, rule)
    if not note:
        return ckpt, None
    objects = {e.name: e for e in entries if isinstance(e, ObjectEntry)}
    kept = {e.name: e for e in entries if isinstance(e, TensorEntry)}
    tensors = {n: t for n, t in ckpt.tensors.items() if t.role != "other"} | kept
    return dataclasses.replace(ckpt, tensors=tensors, objects=objects), note


class RankFile:
    """Makes a rank file's segments when the executor writes it (a wide write holds one rank's at a time): its values'
    archives, then each tensor chunk's archive, in order, at the offsets `.metadata` records (each archive's size
    depends on its dtype and shape alone: tensor_archive_size; the executor checks the file's total)."""

    __slots__ = ("tensors", "values", "codes")

    def __init__(self, tensors: list[TensorPlan], values: list[dcp_plan.Item], codes: array) -> None:
        self.tensors, self.values, self.codes = tensors, values, codes  # codes: (tensor, box) per chunk, in order

    def __call__(self) -> list[Any]:
        return [*(Literal(v.archive) for v in self.values), *self._chunks(0, len(self.codes) // 2)]

    def batches(self, size: int = 1000) -> Iterator[list[Any]]:
        """The segments `size` items at a time, each item's archive whole in one batch (written in order)."""
        if self.values:
            yield [Literal(v.archive) for v in self.values]
        for start in range(0, len(self.codes) // 2, size):
            yield self._chunks(start, min(start + size, len(self.codes) // 2))

    def _chunks(self, start: int, end: int) -> list[Any]:
        segments: list[Any] = []
        for k in range(start, end):
            tensor = self.tensors[self.codes[2 * k]]
            offsets, sizes, _ = tensor.boxes[self.codes[2 * k + 1]]
            chunk = tensor.entry if sizes is None else sub_box(tensor.entry, tensor.fqn, offsets, sizes)
            segments += torch_save.tensor_archive(chunk, f"{tensor.fqn}@{offsets}")
        return segments

    def tensor_names(self) -> list[str]:
        named = []
        for k in range(0, len(self.codes), 2):
            tensor = self.tensors[self.codes[k]]
            named.append(tensor.entry.name if tensor.boxes[self.codes[k + 1]][1] is None else tensor.fqn)
        return named


def place(plan: Plan, kept: list[array], reads: tuple[str, ...]) -> list[OutputFile]:
    """Each rank's file laid out, values first and then tensor chunks (as FileSystemWriter orders a rank's file), each
    chunk's place recorded on its tensor in `.metadata`'s order (the kept plans rank by rank)."""
    files = []
    for r, positions in enumerate(kept):
        name = dcp_plan.file_name(r)
        values = [plan.values[-1 - plan.which[i]] for i in positions if plan.which[i] < 0]
        pos = 0
        for item in values:
            item.archive = object_bytes(item.obj)
            item.file, item.pos, item.length = name, pos, len(item.archive)
            pos += item.length
        codes = array("q")
        data = largest = 0
        for i in positions:
            t = plan.which[i]
            if t < 0:
                continue
            tensor, b = plan.tensors[t], plan.box[i]
            shape = tensor.shape_of(b)
            tensor.placed.extend((b, r, pos))
            codes.extend((t, b))
            pos += dcp_plan.archive_length(tensor.entry.dtype, shape)
            nbytes = math.prod(shape) * tensor.entry.dtype.itemsize
            data, largest = data + nbytes, max(largest, nbytes)
        files.append(OutputFile(name, build=RankFile(plan.tensors, values, codes), sizes=FileSizes(pos, data, largest), reads=reads))
    return files


def _metadata_stream(plan: Plan, planner: dict[str, Any], dest: Path, order: list[str]) -> Iterator[bytes | memoryview]:
    for tensor in plan.tensors:  # written after every data file: the pieces the sources made are read no more
        if isinstance(tensor.entry.pieces, LazyPieces):
            tensor.entry.pieces.release()
    chunks = {tensor.fqn: (tensor.entry, tensor) for tensor in plan.tensors}
    return metadata_parts(chunks, planner, plan.values, dest, order, chunk_class=dcp_plan.Chunk)


class DCPWriter:
    name = "dcp"
    dest_is_dir = True

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        world_size = options.world_size  # set by ops/convert.layout_for from the registry row
        assert world_size, "a dcp write is planned with its world size"
        ckpt, per_rank_note = _per_rank_view(ckpt, world_size, options.per_rank_rule)
        notes = [per_rank_note] if per_rank_note else []
        unsafe = ckpt.unsafe_values()
        if unsafe:  # its raw bytes would be copied, and dcp.load would run them
            raise DataError(f"refusing to copy a pickled value the allow list rejects: {unsafe_value_problem(unsafe[0])}")
        opaque = [o.name for o in ckpt.objects.values() if isinstance(o.value, Opaque) and o.raw is None]
        if opaque:
            raise UsageError(f"cannot write non-tensor values that were not parsed: {', '.join(opaque[:3])} (try --trust-pickle)")
        layout = layout_for(ckpt, world_size, options.tp)
        plan, planner = rank_plans(ckpt, layout)
        kept = dcp_plan.dedup(plan)
        order = list(dict.fromkeys(plan.key(i)[0] for positions in kept for i in positions))
        reads = tuple({a.path: None for entry in ckpt.tensors.values() for a in entry.stored_arrays()})
        files = place(plan, kept, reads)
        del kept
        plan.which, plan.box = array("q"), array("q")  # placed: the tensors hold their chunks' places
        # Made when written (by rank 0 alone under torchrun): pickling 200,000 chunks' records takes seconds
        files.append(OutputFile(".metadata", stream=functools.partial(_metadata_stream, plan, planner, dest, order), commit_marker=True))
        notes += layout.notes
        if layout.mesh[1] == 1 and not any(n.startswith("layout:") for n in layout.notes):
            sharded = sum(1 for tensor in plan.tensors if len(tensor) > 1 or is_sharded(tensor.entry, ckpt))
            notes.append(
                f"layout: FSDP2 Shard(0) on {world_size} ranks; {sharded} tensors sharded by rows, "
                f"{len(plan.tensors) - sharded} replicated, {len(ckpt.objects)} non-tensor values"
            )
        return WritePlan(self.name, dest, True, files, notes, 1 if _small_chunks(files) else None)


SMALL_CHUNK = 1 << 18  # bytes: chunks this small on average make a rank file Python work per chunk, not copying


def _small_chunks(files: list[OutputFile]) -> bool:
    """Whether the rank files' chunks are small on average: one writing thread is then faster than two (under the
    GIL a second only adds its objects; the 2,000-parameter stack, 2 -> 1,024 ranks: 13.3 s on one, 16.5 s on two)."""
    chunks = sum(len(f.build.codes) // 2 for f in files if isinstance(f.build, RankFile))
    return chunks > 0 and sum(f.sizes.data for f in files if f.sizes) < SMALL_CHUNK * chunks


WRITER = DCPWriter()
