"""What the ranks of a DCP write plan, what `dedup_save_plans` keeps, and where each kept item lands: as numbers.

A 64-rank MoE checkpoint resharded to 8 ranks writes 656,000 chunks. One slotted object per chunk (its key, sizes,
file, offset, length) took ~110 MB to the end of the write; here a tensor's chunks are its boxes (one list shared by
the tensors of its shape and split) and, once placed, three numbers a chunk (which box, which rank, the offset in
that rank's file), and a rank's file is two numbers an item (which tensor, which box: formats/dcp/writer.py
RankFile). `Chunk` is the view of one placed chunk that `.metadata`'s pickler is given, made when it is pickled.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import ObjectEntry, TensorEntry
from ckpt_cli.formats import torch_save
from ckpt_cli.formats.dcp.mesh import Split, chunk_of

Holders = Sequence[int]  # the ranks whose plans hold an item, ascending (a range where they are evenly spaced)
Box = tuple[tuple[int, ...], "tuple[int, ...] | None", Holders]  # offsets, sizes (None: the whole tensor, not split), holders


@dataclass(slots=True)
class Item:
    """A non-tensor value (a BYTE_IO item) of every rank's plan: its archive is made once it is placed."""

    fqn: str
    obj: ObjectEntry
    archive: bytes = b""
    file: str = ""  # where it is stored (once placed): the rank's file, byte offset and length
    pos: int = 0
    length: int = 0
    offsets = None

    @property
    def key(self) -> tuple[str, None]:
        return self.fqn, None


@dataclass(slots=True)
class TensorPlan:
    """A tensor's chunks: its boxes, and once placed, each kept chunk's box, rank and offset in `.metadata`'s order
    (the kept plans rank by rank). Iterated, its placed chunks as `Chunk`s: `.metadata` lists them."""

    fqn: str
    entry: TensorEntry
    boxes: list[Box]
    placed: array = field(default_factory=lambda: array("q"))

    def __len__(self) -> int:
        return len(self.placed) // 3

    def __iter__(self) -> Iterator[Chunk]:
        placed = self.placed
        for k in range(0, len(placed), 3):
            yield Chunk(self, placed[k], placed[k + 1], placed[k + 2])

    def shape_of(self, box: int) -> tuple[int, ...]:
        sizes = self.boxes[box][1]
        return self.entry.shape if sizes is None else sizes


class Chunk:
    """One placed chunk of a tensor, as `.metadata` lists it (made as it is pickled)."""

    __slots__ = ("tensor", "box", "rank", "pos")

    def __init__(self, tensor: TensorPlan, box: int, rank: int, pos: int) -> None:
        self.tensor, self.box, self.rank, self.pos = tensor, box, rank, pos

    @property
    def fqn(self) -> str:
        return self.tensor.fqn

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.tensor.boxes[self.box][0]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape_of(self.box)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.fqn, self.offsets

    @property
    def file(self) -> str:
        return file_name(self.rank)

    @property
    def length(self) -> int:
        return archive_length(self.tensor.entry.dtype, self.shape)


@functools.lru_cache(maxsize=1 << 16)
def file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


@functools.lru_cache(maxsize=1 << 12)  # a few distinct (dtype, shape) a write
def archive_length(dtype: DType, shape: tuple[int, ...]) -> int:
    return torch_save.tensor_archive_size(dtype, shape)


@dataclass
class Plan:
    """Every item the ranks plan, once, in plan order (each rank plans its flattened state dict in order): tensor
    `which[i]`'s box `box[i]`, or for which[i] < 0 the value values[-1 - which[i]]. An item several ranks plan (a
    replicated tensor, the empty chunk of every rank past a small tensor's end, a non-tensor value) is one entry with
    its holders."""

    tensors: list[TensorPlan]
    values: list[Item]
    world: int
    which: array = field(default_factory=lambda: array("q"))
    box: array = field(default_factory=lambda: array("q"))

    def __len__(self) -> int:
        return len(self.which)

    def holders(self, i: int) -> Holders:
        t = self.which[i]
        return self.tensors[t].boxes[self.box[i]][2] if t >= 0 else range(self.world)

    def weight(self, i: int) -> int:
        """What torch counts for an item (WriteItem.tensor_storage_size): the whole tensor's bytes for each of its
        chunks, empty ones included; 1 for a non-tensor value."""
        t = self.which[i]
        return (self.tensors[t].entry.nbytes if t >= 0 else 0) or 1

    def key(self, i: int) -> tuple[str, tuple[int, ...] | None]:
        t = self.which[i]
        if t < 0:
            return self.values[-1 - t].key
        return self.tensors[t].fqn, self.tensors[t].boxes[self.box[i]][0]


def dedup(plan: Plan) -> list[array]:
    """Each rank's plan after dedup_save_plans (dcp/_dedup_save_plans.py), as positions in `plan`: every item kept by
    one of its holders, the one with the fewest planned bytes so far, items taken in the order the ranks' plans list
    them (rank 0's plan, then what rank 1 adds, ...); each plan keeps its own order."""
    met = sorted(range(len(plan)), key=lambda i: plan.holders(i)[0])  # stable: plan order within a first holder
    sizes = [0] * plan.world
    kept: list[list[int]] = [[] for _ in range(plan.world)]
    for i in met:
        holders = plan.holders(i)
        # Among equals, the first the set of holder ranks yields, as torch's min() over that set meets them (not
        # always the lowest: {6, 7, 8} iterates 8, 6, 7); the set is filled in rank order, as torch fills it.
        r = holders[0] if len(holders) == 1 else min(set(holders), key=sizes.__getitem__)
        sizes[r] += plan.weight(i)
        kept[r].append(i)
    del met
    return [array("q", sorted(positions)) for positions in kept]


def boxes_with_holders(shape: tuple[int, ...], split: Split, mesh: tuple[int, int], same: dict[Any, Any]) -> list[Box]:
    """Each distinct box the ranks of `mesh` save of a tensor laid out by `split`, with the ranks saving it, in rank
    order of first holder (a replicated or empty box: several ranks)."""
    held: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for r in range(mesh[0] * mesh[1]):
        held.setdefault(chunk_of(shape, split, mesh, r), []).append(r)
    return [(same.setdefault(o, o), same.setdefault(z, z), compact(ranks)) for (o, z), ranks in held.items()]


def compact(ranks: list[int]) -> Holders:
    """Ascending ranks as a range when evenly spaced (one rank, a run, every tp-th), else as a tuple."""
    if len(ranks) == 1:
        return range(ranks[0], ranks[0] + 1)
    step = ranks[1] - ranks[0]
    spaced = range(ranks[0], ranks[-1] + 1, step)
    return spaced if len(spaced) == len(ranks) and all(a == b for a, b in zip(spaced, ranks)) else tuple(ranks)
