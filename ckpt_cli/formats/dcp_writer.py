"""Writing a Distributed Checkpoint laid out as FSDP2 (`fully_shard`) saves it on N ranks, alone (Shard(0)) or with
tensor parallel on a dp x tp mesh (`--tp T`).

Without --tp every model weight and optimizer moment of rank >= 1 is cut along dim 0 with `torch.chunk`
semantics (ranks past the end keep an empty chunk, listed once). With --tp each sharded tensor keeps the split
its source chunks show (the dim FSDP shards, the dim tensor parallel shards: formats/dcp_mesh.py) and is cut as
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core import zipio
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import (
    Box,
    Checkpoint,
    FlatRange,
    LazyPieces,
    ObjectEntry,
    Opaque,
    PathKey,
    Piece,
    Run,
    TensorEntry,
    box_runs,
    unsafe_value_problem,
)
from ckpt_cli.core.paths import open_regular
from ckpt_cli.core.plan import FileSizes, Literal, OutputFile, WritePlan
from ckpt_cli.core.training import apply_per_rank_rule
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import torch_save
from ckpt_cli.formats.dcp import DATA_FILE
from ckpt_cli.formats.dcp_mesh import Saved, SourceMesh, Split, chunk_of, parse_mesh, source_mesh
from ckpt_cli.formats.dcp_metadata_writer import metadata_parts


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


@dataclass(slots=True)  # one per (tensor, rank) of a wide write: hundreds of thousands
class Item:
    """One write item of one rank's plan, as DCP's planner would make it: a chunk of `entry` (its data is cut from the
    source when the rank's file is written) or a non-tensor value `obj`."""

    fqn: str
    offsets: tuple[int, ...] | None  # None for BYTE_IO
    planned_bytes: int  # what dedup_save_plans counts: tensor bytes, or 1 for a non-tensor
    entry: TensorEntry | None = None  # the whole tensor the chunk is cut from
    sizes: tuple[int, ...] | None = None  # the chunk's sizes; None: all of `entry`, not split
    obj: ObjectEntry | None = None
    archive: bytes = b""  # a non-tensor value's archive, made once when the item is placed
    file: str = ""  # where the item is stored (once placed): the rank's file, byte offset and length
    pos: int = 0
    length: int = 0

    @property
    def key(self) -> tuple[str, tuple[int, ...] | None]:
        return self.fqn, self.offsets

    @property
    def name(self) -> str:
        """The chunk's tensor name (the flat key, or the entry's own when it is written whole)."""
        assert self.entry is not None
        return self.entry.name if self.sizes is None else self.fqn

    @property
    def shape(self) -> tuple[int, ...]:
        assert self.entry is not None
        return self.entry.shape if self.sizes is None else self.sizes

    def archive_size(self) -> int:
        assert self.entry is not None
        return torch_save.tensor_archive_size(self.entry.dtype, self.shape)

    def chunk(self) -> TensorEntry:
        """The chunk as a tensor of its own, its pieces pointing into the source."""
        assert self.entry is not None and self.offsets is not None
        return self.entry if self.sizes is None else sub_box(self.entry, self.name, self.offsets, self.sizes)


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


def sub_box(
    entry: TensorEntry, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], source: list[Run] | None = None
) -> TensorEntry:
    """The box `offsets` + `sizes` of `entry` as a tensor of its own: one flat piece per contiguous run of the box
    that one source piece holds (whole rows of a row range are one run; a column range is one run per row).
    `source`: entry.runs(), when the caller cuts several boxes from one tensor."""
    if offsets == (0,) * len(entry.shape) and sizes == entry.shape:
        return dataclasses.replace(entry, name=name)
    box = tuple(box_runs(offsets, sizes, entry.shape))
    if source is None and box and entry.made_by_range():  # only the source pieces the box's extent meets are made
        first, last = box[0][0], box[-1][0] + box[-1][1]
        source = entry.runs_in(first, last - first)
    source = entry.runs() if source is None else source
    pieces, i = [], 0
    for gstart, length, lstart in box:
        end = gstart + length
        while i < len(source) and source[i][0] + source[i][1] <= gstart:
            i += 1
        j = i
        while j < len(source) and source[j][0] < end:
            g, n, piece, local = source[j]
            lo, hi = max(g, gstart), min(g + n, end)
            if lo < hi:
                pieces.append(Piece(FlatRange(lstart + lo - gstart, hi - lo), piece.data, local + lo - g))
            j += 1
    return TensorEntry(name, entry.dtype, sizes, entry.role, pieces, entry.path)


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


Holders = Sequence[int]  # the ranks whose plans hold an item, ascending (a range where they are evenly spaced)


Planned = list[tuple[Item, Holders]]


def rank_plans(ckpt: Checkpoint, layout: Layout) -> tuple[Planned, dict[str, TensorEntry], dict[str, Any], list[ObjectEntry]]:
    """Every item the ranks plan, once, with the ranks whose plans hold it, in plan order (each rank plans its
    flattened state dict in order); the tensors by flat key, planner_data and the BYTE_IO leaves. An item several
    ranks plan (a replicated tensor, the empty chunk of every rank past a small tensor's end, a non-tensor value) is
    one object with its holders, not one list slot per rank: at 1,024 ranks most chunks of small tensors are that
    empty one, and 1,024 plans of 8,000 slots took 120 MB."""
    world = layout.mesh[0] * layout.mesh[1]
    everyone = range(world)
    planned: Planned = []
    entries: dict[str, TensorEntry] = {}
    planner: dict[str, Any] = {}
    same: dict[Any, Any] = {}  # equal sizes and byte counts as one object
    boxes: dict[tuple[tuple[int, ...], Split], list[tuple[tuple[int, ...], tuple[int, ...], Holders]]] = {}
    for entry in ckpt.tensors.values():
        path = dcp_path(entry.path, ckpt.containers)
        fqn = ".".join(map(str, path))
        planner[fqn] = path
        entries[fqn] = entry
        split = layout.splits.get(entry.name)
        if split is None:
            planned.append((Item(fqn, (0,) * len(entry.shape), entry.nbytes, entry), everyone))
            continue
        key = (entry.shape, split)
        if key not in boxes:  # thousands of tensors, a few shapes: each shape's boxes computed once, not per tensor
            boxes[key] = _boxes_with_holders(entry.shape, split, layout.mesh, same)
        for offsets, sizes, holders in boxes[key]:
            nbytes = math.prod(sizes) * entry.dtype.itemsize
            planned.append((Item(fqn, offsets, same.setdefault(nbytes, nbytes), entry, sizes), holders))
    objects = byte_items(ckpt)
    for obj in objects:
        planner[obj.name] = obj.path
        planned.append((Item(obj.name, None, 1, obj=obj), everyone))
    order = flat_order(ckpt)
    if order:  # as the source's state dict was flattened: dedup_save_plans meets the items in that order
        planned.sort(key=lambda p: order.get(p[0].fqn, len(order)))
    return planned, entries, planner, objects


def _boxes_with_holders(
    shape: tuple[int, ...], split: Split, mesh: tuple[int, int], same: dict[Any, Any]
) -> list[tuple[tuple[int, ...], tuple[int, ...], Holders]]:
    """Each distinct box the ranks of `mesh` save of a tensor laid out by `split`, with the ranks saving it, in rank
    order of first holder (a replicated or empty box: several ranks)."""
    held: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for r in range(mesh[0] * mesh[1]):
        held.setdefault(chunk_of(shape, split, mesh, r), []).append(r)
    return [(same.setdefault(o, o), same.setdefault(z, z), _compact(ranks)) for (o, z), ranks in held.items()]


def _compact(ranks: list[int]) -> Holders:
    """Ascending ranks as a range when evenly spaced (one rank, a run, every tp-th), else as a tuple."""
    if len(ranks) == 1:
        return range(ranks[0], ranks[0] + 1)
    step = ranks[1] - ranks[0]
    spaced = range(ranks[0], ranks[-1] + 1, step)
    return spaced if len(spaced) == len(ranks) and all(a == b for a, b in zip(spaced, ranks)) else tuple(ranks)


def flat_order(ckpt: Checkpoint) -> dict[str, int]:
    """The order a DCP source's state dict was flattened in (its planner_data), by flat key; empty for other sources."""
    planner = getattr(getattr(ckpt.source, "metadata", None), "planner_data", None)
    return {str(fqn): i for i, fqn in enumerate(planner)} if isinstance(planner, dict) else {}


def chunk_lists(entries: dict[str, TensorEntry], kept: list[list[Item]]) -> dict[str, tuple[TensorEntry, list[Item]]]:
    """Each tensor's chunks in the order DCP's global plan lists them: the kept plans, rank by rank."""
    listed: dict[str, list[Item]] = {fqn: [] for fqn in entries}
    for items in kept:
        for item in items:
            if item.entry is not None:
                listed[item.fqn].append(item)
    return {fqn: (entry, listed[fqn]) for fqn, entry in entries.items()}


def dedup(planned: Planned, world: int) -> list[list[Item]]:
    """Each rank's plan after dedup_save_plans (dcp/_dedup_save_plans.py): every item kept by one of its holders, the
    one with the fewest planned bytes so far, items taken in the order the ranks' plans list them (rank 0's plan,
    then what rank 1 adds, ...); each plan keeps its own order."""
    met = sorted(range(len(planned)), key=lambda i: planned[i][1][0])  # stable: plan order within a first holder
    sizes = [0] * world
    kept: list[list[int]] = [[] for _ in range(world)]  # positions in `planned`: each plan keeps its own order
    for i in met:
        item, holders = planned[i]
        # Among equals, the first the set of holder ranks yields, as torch's min() over that set meets them (not
        # always the lowest: {6, 7, 8} iterates 8, 6, 7); the set is filled in rank order, as torch fills it.
        r = holders[0] if len(holders) == 1 else min(set(holders), key=sizes.__getitem__)
        # What torch counts (WriteItem.tensor_storage_size): the whole tensor's bytes for each of its chunks, empty
        # ones included; 1 for a non-tensor value.
        sizes[r] += (item.entry.nbytes if item.entry is not None else 0) or 1
        kept[r].append(i)
    del met
    return [[planned[i][0] for i in sorted(positions)] for positions in kept]


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


class RankFile:
    """Makes a rank file's segments when the executor writes it (a wide write holds one rank's at a time): each item's
    archive in order, at the offsets .metadata records (each archive's size depends on its dtype and shape alone:
    tensor_archive_size; the executor checks the file's total)."""

    __slots__ = ("items",)

    def __init__(self, items: list[Item]) -> None:
        self.items = items

    def __call__(self) -> list[Any]:
        return self._segments(self.items)

    def batches(self, size: int = 1000) -> Iterator[list[Any]]:
        """The segments `size` items at a time, each item's archive whole in one batch (written in order)."""
        for start in range(0, len(self.items), size):
            yield self._segments(self.items[start : start + size])

    def _segments(self, items: list[Item]) -> list[Any]:
        segments: list[Any] = []
        for item in items:
            if item.obj is not None:
                parts = [Literal(item.archive)]
            else:
                parts = torch_save.tensor_archive(item.chunk(), f"{item.fqn}@{item.offsets}")
            segments += parts
        return segments

    def tensor_names(self) -> list[str]:
        return [item.name for item in self.items if item.entry is not None]


def _metadata_stream(
    chunks: dict[str, tuple[TensorEntry, list[Item]]], planner: dict[str, Any], values: list[Item], dest: Path, order: list[str]
) -> Iterator[bytes | memoryview]:
    for entry, _ in chunks.values():  # written after every data file: the pieces the sources made are read no more
        if isinstance(entry.pieces, LazyPieces):
            entry.pieces.release()
    return metadata_parts(chunks, planner, values, dest, order, chunk_class=Item)


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
        layout = layout_for(ckpt, world_size, options.tp)
        planned, entries, planner, objects = rank_plans(ckpt, layout)
        kept = dedup(planned, layout.mesh[0] * layout.mesh[1])
        del planned
        chunks = chunk_lists(entries, kept)
        order = list(dict.fromkeys(item.fqn for items in kept for item in items))
        files = []
        lengths: dict[int, int] = {}
        reads = tuple({a.path: None for entry in ckpt.tensors.values() for a in entry.stored_arrays()})
        for r, items in enumerate(kept):
            name = f"__{r}_0.distcp"
            # BYTE_IO items first, then tensors, as FileSystemWriter orders a rank's file.
            items[:] = [i for i in items if i.obj is not None] + [i for i in items if i.entry is not None]
            pos = 0
            for item in items:
                if item.obj is not None:
                    item.archive = _object_bytes(item.obj)
                    item.length = len(item.archive)
                else:
                    length = item.archive_size()
                    item.length = lengths.setdefault(length, length)  # a few distinct sizes, one int object each
                item.file, item.pos = name, pos
                pos += item.length
            data = [i.planned_bytes for i in items if i.entry is not None]
            files.append(OutputFile(name, build=RankFile(items), sizes=FileSizes(pos, sum(data), max(data, default=0)), reads=reads))
        placed = {item.fqn: item for items in kept for item in items if item.obj is not None}
        values = [placed[obj.name] for obj in objects]
        # Made when written (by rank 0 alone under torchrun): pickling 200,000 chunks' records takes seconds
        made = functools.partial(_metadata_stream, chunks, planner, values, dest, order)
        files.append(OutputFile(".metadata", stream=made, commit_marker=True))
        notes += layout.notes
        if layout.mesh[1] == 1 and not any(n.startswith("layout:") for n in layout.notes):
            sharded = sum(1 for entry, listed in chunks.values() if len(listed) > 1 or is_sharded(entry, ckpt))
            notes.append(
                f"layout: FSDP2 Shard(0) on {world_size} ranks; {sharded} tensors sharded by rows, "
                f"{len(chunks) - sharded} replicated, {len(ckpt.objects)} non-tensor values"
            )
        return WritePlan(self.name, dest, True, files, notes)


WRITER = DCPWriter()
