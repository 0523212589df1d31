"""Where a DTensor's local shard lies in the global tensor: pure arithmetic on sizes, mesh coordinates and
placements, as torch computes it (torch/distributed/tensor/_utils.py `_compute_local_shape_and_global_offset`,
placement_types.py `Shard.local_shard_size_and_offset` and `_StridedShard._split_tensor`).

Placements apply left to right over the mesh dimensions. `Shard(d)` on a mesh dimension of size n gives
coordinate c the c-th `torch.chunk` of what is left of tensor dim d (chunks of ceil(size / n); the last ones
short or empty). `_StridedShard(d, sf)` (FSDP2 over tensor parallel) first chunks what is left into sf parts,
chunks each of those into n and gives coordinate c the c-th chunk of every part, so its indices need not be
contiguous: the local shard is then several boxes. `Replicate` and `Partial` leave the dim whole. Facts:
docs/formats.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

Run = tuple[int, int]  # (first global index, count) of a stretch of consecutive indices
MAX_BOXES = 1 << 16  # boxes one local shard may split into (a real _StridedShard gives a handful)


@dataclass(frozen=True)
class Placement:
    kind: str  # "shard", "strided", "replicate" or "partial"
    dim: int = 0
    split_factor: int = 1
    reduce_op: str = ""

    @property
    def shards(self) -> bool:
        return self.kind in ("shard", "strided")

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim})"
        if self.kind == "strided":
            return f"_StridedShard({self.dim}, sf={self.split_factor})"
        return "Replicate()" if self.kind == "replicate" else f"Partial({self.reduce_op})"


def chunk(size: int, parts: int, index: int) -> Run:
    """The index-th of `parts` torch.chunk pieces of `size` elements, as (start, count)."""
    full = -(-size // parts)
    start = min(full * index, size)
    return start, min(start + full, size) - start


def _select(runs: list[Run], start: int, count: int) -> list[Run]:
    """Positions [start, start + count) of the index sequence that `runs` spell out."""
    out, pos = [], 0
    for first, length in runs:
        lo, hi = max(start, pos), min(start + count, pos + length)
        if lo < hi:
            out.append((first + lo - pos, hi - lo))
        pos += length
    return out


def _coalesce(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for first, length in runs:
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + length)
        elif length:
            out.append((first, length))
    return out


def index_runs(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Placement, ...]
) -> list[list[Run]]:
    """Per tensor dim, the global indices the rank at `coordinate` holds, in local order, as runs (call `problem` first)."""
    runs = [[(0, n)] if n else [] for n in shape]
    for mesh_dim, p in enumerate(placements):
        if not p.shards:
            continue
        size, parts, index = sum(n for _, n in runs[p.dim]), mesh_shape[mesh_dim], coordinate[mesh_dim]
        if p.kind == "shard":
            picked = [chunk(size, parts, index)]
        else:
            picked = []
            for j in range(p.split_factor):
                first, length = chunk(size, p.split_factor, j)
                start, count = chunk(length, parts, index)
                picked.append((first + start, count))
        runs[p.dim] = _coalesce([run for start, count in picked for run in _select(runs[p.dim], start, count)])
    return runs


def local_shape(runs: list[list[Run]]) -> tuple[int, ...]:
    return tuple(sum(n for _, n in dim) for dim in runs)


def boxes(runs: list[list[Run]]) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(global offsets, sizes, local offsets) of the boxes the local shard is made of, in local order."""
    local_starts = []
    for dim in runs:
        starts, pos = [], 0
        for _, n in dim:
            starts.append(pos)
            pos += n
        local_starts.append(starts)
    for picks in itertools.product(*(range(len(dim)) for dim in runs)):
        yield (
            tuple(runs[d][i][0] for d, i in enumerate(picks)),
            tuple(runs[d][i][1] for d, i in enumerate(picks)),
            tuple(local_starts[d][i] for d, i in enumerate(picks)),
        )


def problem(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Placement, ...], ranks: int
) -> str | None:
    """Why this placement cannot be laid out (None when it can); `ranks`: how many rank files there are."""
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        return f"{len(placements)} placements and coordinate {list(coordinate)} on a mesh of shape {list(mesh_shape)}"
    if any(n < 1 for n in mesh_shape) or math.prod(mesh_shape) > ranks:
        return f"a mesh of shape {list(mesh_shape)} for {ranks} rank files"
    if any(not 0 <= c < n for c, n in zip(coordinate, mesh_shape)):
        return f"mesh coordinate {list(coordinate)} outside the mesh of shape {list(mesh_shape)}"
    for p in placements:
        if p.kind == "partial":
            return f"placement {p}: each rank holds a partial {p.reduce_op or 'sum'}, not a shard (ckpt does not add shards up)"
        if p.shards and not 0 <= p.dim < len(shape):
            return f"placement {p} on a tensor of {len(shape)} dimensions"
        if p.kind == "strided" and not 1 <= p.split_factor <= ranks:
            return f"placement {p}: a split factor outside 1..{ranks}"
    if math.prod(len(dim) for dim in index_runs(shape, mesh_shape, coordinate, placements)) > MAX_BOXES:
        return f"placements {', '.join(map(str, placements))} split the local shard into more than {MAX_BOXES} boxes"
    return None


def shard_key(coordinate: tuple[int, ...], placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """The coordinate on the sharding mesh dims: ranks with the same key hold the same shard (replicas)."""
    return tuple(c for c, p in zip(coordinate, placements) if p.shards)


def all_shard_keys(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(n) for n, p in zip(mesh_shape, placements) if p.shards))
