"""The chunks FSDP2 + tensor parallel save on a 2-D (dp, tp) device mesh, as pure arithmetic on sizes.

A tensor's layout on the mesh is a `Split`: the dim FSDP shards over dp (`fully_shard`, Shard(0) unless a
`shard_placement_fn` says otherwise) and the dim tensor parallel shards over tp (ColwiseParallel: dim 0 of a
Linear weight, RowwiseParallel: dim 1, an expert-parallel style: dim 0 of a 3-D expert weight), either None.
When both shard the same dim, FSDP shards the tp-local rows and the DTensor says `_StridedShard(d, sf=tp)`
over dp then `Shard(d)` over tp (`strided`). DCP records each rank's
chunk as a box (`compute_local_shape_and_global_offset`): its first global index and local size per dim,
with the offset of an empty dim at the dim's size. Rank r sits at mesh coordinate (r // tp, r % tp)
(`init_device_mesh` row-major). Facts: docs/formats.md §1.13.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of one box


@dataclass(frozen=True)
class Split:
    """Which dim FSDP shards over dp and which tensor parallel shards over tp (None: not sharded on that mesh dim)."""

    dp_dim: int | None
    tp_dim: int | None

    def placements(self, tp: int) -> str:
        """The DTensor placements FSDP2 gives a parameter with this split, as torch prints them."""
        if self.tp_dim is None:
            return "(Replicate(),)" if self.dp_dim is None else f"(Shard(dim={self.dp_dim}),)"
        tp_p = f"Shard(dim={self.tp_dim})"
        if self.dp_dim is None:
            return f"(Replicate(), {tp_p})"
        if self.dp_dim == self.tp_dim and tp > 1:
            return f"(_StridedShard(dim={self.dp_dim}, sf={tp}), {tp_p})"
        return f"(Shard(dim={self.dp_dim}), {tp_p})"


def torch_chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of the index-th of `parts` torch.chunk pieces of `size` (ceil(size / parts) each, the last short or empty)."""
    per = -(-size // parts)
    start = min(per * index, size)
    return start, min(start + per, size) - start


def strided(n: int, dp: int, tp: int, i: int, t: int) -> tuple[int, int]:
    """(first index, count) of dp coordinate i, tp coordinate t under (_StridedShard(d, sf=tp), Shard(d)), as torch
    computes it: n split into tp parts, each part chunked over dp, coordinate i takes its chunk of every part (in
    part order), then Shard(d) gives coordinate t the t-th torch.chunk of that list. When every dp chunk of a part
    is full or the layout is even this is FSDP's chunk i of tp chunk t; for dp >= 3 with uneven rows it can differ
    (7 rows on 3 x 2: torch gives (2, 0) row 6, FSDP holds it on (2, 1))."""
    runs = []  # the indices coordinate i takes, as (first, count) runs in part order: not a list of every index (a
    for j in range(tp):  # 1-d tensor of 21M elements held 800 MB of ints for it)
        part, length = torch_chunk(n, tp, j)
        start, count = torch_chunk(length, dp, i)
        runs.append((part + start, count))
    start, count = torch_chunk(sum(c for _, c in runs), tp, t)
    if not count:
        return n, 0
    for first, length in runs:
        if start < length:
            return first + start, count
        start -= length
    raise AssertionError("torch_chunk's start lies within the indices")


def chunk_of(shape: tuple[int, ...], split: Split, mesh: tuple[int, int], rank: int) -> Chunk:
    """The box rank `rank` of a (dp, tp) mesh saves of a tensor laid out by `split`."""
    dp, tp = mesh
    i, t = divmod(rank, tp)
    offsets, sizes = [0] * len(shape), list(shape)
    for d, n in enumerate(shape):
        if split.tp_dim == d and split.dp_dim == d:
            start, count = strided(n, dp, tp, i, t)
        elif split.tp_dim == d:
            start, count = torch_chunk(n, tp, t)
        elif split.dp_dim == d:
            start, count = torch_chunk(n, dp, i)
        else:
            continue
        offsets[d], sizes[d] = (start, count) if count else (n, 0)  # an empty shard sits at the dim's end
    return tuple(offsets), tuple(sizes)


def chunks(shape: tuple[int, ...], split: Split, mesh: tuple[int, int]) -> list[Chunk]:
    """Every rank's box, rank by rank (replicas repeat)."""
    return [chunk_of(shape, split, mesh, r) for r in range(mesh[0] * mesh[1])]


def candidates(ndim: int) -> list[Split]:
    """Every split of a tensor of `ndim` dims that shards it, the plainest first: FSDP dim 0 alone, FSDP dim 0 with
    tensor parallel on each dim, then FSDP on another dim (a shard_placement_fn), then tensor parallel alone."""
    dims: list[int | None] = [None, *range(ndim)]
    ordered = [Split(0, tp) for tp in dims] if ndim else []
    ordered += [Split(dp, tp) for dp in range(1, ndim) for tp in dims]
    ordered += [Split(None, tp) for tp in range(ndim)]
    return ordered


Saved = frozenset[tuple[Chunk, int | None]]  # each chunk saved, with the rank whose file holds it (None: not known)


BoxFits = dict[tuple[tuple[int, ...], frozenset[Chunk]], list[tuple[Split, list[Chunk]]]]


def fits(shape: tuple[int, ...], saved: Saved, mesh: tuple[int, int], by_boxes: BoxFits | None = None) -> list[Split]:
    """The splits whose boxes on `mesh` are exactly the chunks saved (empty ones included), each held by the rank
    whose file stores it (a replicated chunk is stored by one of its holders), plainest first. The ranks tell
    (Shard(0), Shard(1)) from (Shard(1), Shard(0)), whose boxes are the same. `by_boxes`: the splits whose boxes
    match, by (shape, boxes) on this mesh, kept across calls: tensors of one shape store their replicated and empty
    chunks on different ranks (dedup balances bytes), so the boxes repeat where the ranks do not."""
    boxes = frozenset(c for c, _ in saved)
    by_boxes = {} if by_boxes is None else by_boxes
    if (shape, boxes) not in by_boxes:
        laid = ((split, chunks(shape, split, mesh)) for split in candidates(len(shape)))
        by_boxes[shape, boxes] = [(split, per_rank) for split, per_rank in laid if frozenset(per_rank) == boxes]
    return [
        split for split, per_rank in by_boxes[shape, boxes] if all(r is None or (r < len(per_rank) and per_rank[r] == c) for c, r in saved)
    ]


@dataclass(frozen=True)
class SourceMesh:
    """The (dp, tp) mesh a checkpoint's chunks show, and each sharded tensor's split on it."""

    dp: int
    tp: int
    splits: dict[str, Split]
    ambiguous: tuple[str, ...] = ()  # tensors whose chunks fit several splits that lay out differently on some mesh
    others: tuple[str, ...] = ()  # other meshes (DPxTP) on which every tensor's chunks fit too

    @property
    def tensor_parallel(self) -> bool:
        """Whether any tensor is split by tensor parallel (a source without one says nothing about the plan)."""
        return self.tp > 1 and any(s.tp_dim is not None for s in self.splits.values())


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def source_mesh(tensors: dict[str, tuple[tuple[int, ...], Saved]], world: int) -> SourceMesh | str:
    """The (dp, tp) mesh of `world` ranks on which every tensor's saved chunks fit a split, or why none does.
    `tensors`: name -> (shape, chunks saved) of the sharded tensors; the same (shape, chunks) is solved once.
    Meshes with dp or tp 1 can fit the same chunks (1 x 4 tensor parallel with rowwise weights is 4 x 1 FSDP with
    Shard(1) for them): the mesh needing the fewest tensors FSDP shards off dim 0 (a shard_placement_fn; dp > 1)
    wins, then the smallest tp, so FSDP alone on dim 0 stays FSDP alone; the other meshes that fit are named."""
    if not tensors:
        return "no tensor is sharded"
    misfits, fitting = [], []
    for tp in divisors(world):
        mesh = (world // tp, tp)
        solved: dict[tuple[tuple[int, ...], Saved], list[Split]] = {}
        by_boxes: BoxFits = {}
        splits: dict[str, Split] = {}
        ambiguous = []
        for name, key in tensors.items():
            if key not in solved:
                solved[key] = fits(key[0], key[1], mesh, by_boxes)
            found = solved[key]
            if not found:
                misfits.append(f"{mesh[0]}x{tp}: '{name}' {_shown(key[1])}")
                break
            splits[name] = found[0]
            sharded_by_dp = [s for s in found if s.dp_dim is not None] or found
            if len(set(sharded_by_dp)) > 1:
                ambiguous.append(name)
        else:
            off_dim0 = sum(1 for s in splits.values() if s.dp_dim != 0) if mesh[0] > 1 else 0
            fitting.append((off_dim0, tp, SourceMesh(mesh[0], tp, splits, tuple(ambiguous))))
    if not fitting:
        return f"no dp x tp mesh of {world} ranks gives every tensor's chunks as saved ({'; '.join(misfits[:4])})"
    fitting.sort(key=lambda f: f[:2])
    chosen = fitting[0][2]
    return dataclasses.replace(chosen, others=tuple(f"{m.dp}x{m.tp}" for _, _, m in fitting[1:]))


def _shown(saved: Saved) -> str:
    listed = sorted(c for c, _ in saved)
    text = ", ".join(f"{list(o)}+{list(s)}" for o, s in listed[:4])
    return f"chunks {text}{', ...' if len(listed) > 4 else ''}"


def parse_mesh(world: int, tp: int) -> tuple[int, int]:
    """(dp, tp) for --world-size world --tp tp; ValueError when tp does not divide world."""
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} does not divide --world-size {world}")
    return world // tp, tp
