"""Where DeepSpeed ZeRO puts each parameter's elements: the partition math, written once.

Pure functions of sizes, shapes and names (no I/O, no torch), used by the reader (formats/deepspeed/reader.py),
the reshard writer (formats/deepspeed/writer.py) and the source built from another framework
(formats/deepspeed/template.py). Each rule names the DeepSpeed 0.19 code it reproduces:

- Stage 1/2 and BF16_Optimizer (stage_1_and_2.py, bf16_optimizer.py): a param group's params are
  flattened into one buffer (in round-robin order under round_robin_gradients, with per-param alignment
  pads under parameter_alignment), the buffer is padded to a multiple of 2*W and cut into W equal partitions.
- Stage 3 (partition_parameters.py, stage3.py): every parameter is partitioned on its own, ceil(n/W)
  elements per rank with zero padding at the end; each rank concatenates its partitions per sub-group.
  Frozen parameters are saved the same way, one fragment per rank.
- MoE, expert parallel (groups.py _create_expert_and_data_parallel, moe/utils.py
  split_params_into_different_moe_groups_for_optimizer, stage_1_and_2.py _configure_moe_settings): a param
  group of experts is flattened and partitioned as above, but over the expert-data-parallel group
  (W / ep_size ranks, partition_count[g]); each expert-parallel rank holds its own experts under local ids.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

Shape = tuple[int, ...]
Param = tuple[str, Shape]  # a parameter's name and shape
T = TypeVar("T")

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py, bf16_optimizer.py: flat buffers are aligned to 2*W elements


@dataclass(frozen=True)
class Slot:
    """A parameter's place in a flat buffer: elements [offset, offset + numel)."""

    name: str
    shape: Shape
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


class ZeroLayout(Protocol):
    """The param groups of a ZeRO checkpoint as flattened, whether read from DeepSpeed's files or built."""

    @property
    def shapes(self) -> Sequence[Mapping[str, Shape]]:
        """Stage 1/2: each param group's params in flat order; stage 3: each sub-group's."""
        ...

    @property
    def groups(self) -> Sequence[Mapping[str, Any]]:
        """The optimizer's param groups as saved (stage 3: their 'params' are sub-group indices)."""
        ...

    @property
    def alignment_padding(self) -> bool:
        """Whether any param is followed by a parameter_alignment pad."""
        ...

    @property
    def experts(self) -> ExpertLayout | None:
        """MoE (expert parallel): how the groups are spread over the ranks; None for a dense checkpoint."""
        ...

    def offsets(self, g: int) -> list[Slot]:
        """Group g's params in their stage 1/2 flat buffer."""
        ...


def ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def ceil_to(n: int, m: int) -> int:
    """The least multiple of m that is >= n."""
    return ceil_div(n, m) * m


def overlap(start: int, length: int, other_start: int, other_length: int) -> tuple[int, int] | None:
    """[lo, hi) shared by ranges [start, start+length) and [other_start, other_start+other_length); None if empty."""
    lo, hi = max(start, other_start), min(start + length, other_start + other_length)
    return (lo, hi) if lo < hi else None


# ---- stage 1/2 -----------------------------------------------------------------------------------


def flat_slots(params: Sequence[Param], paddings: Sequence[int] | None = None) -> list[Slot]:
    """Params packed in order, each followed by its alignment pad (param_alignment_paddings; none by default)."""
    out, offset = [], 0
    for i, (name, shape) in enumerate(params):
        out.append(Slot(name, tuple(shape), offset))
        offset += math.prod(shape) + (paddings[i] if paddings else 0)
    return out


def flat_numel(slots: Sequence[Slot]) -> int:
    """N: the data elements of a group's flat buffer, alignment pads between params included (none after the last)."""
    return slots[-1].end if slots else 0


def flat_buffer_numel(data_numel: int, world: int) -> int:
    """The flat buffer's length: N padded to a multiple of 2*W (align_dense_tensors)."""
    return ceil_to(data_numel, NCCL_START_ALIGNMENT_FACTOR * world)


def partition_size(data_numel: int, world: int) -> int:
    """P: each rank's equal share of the padded flat buffer (get_data_parallel_partitions)."""
    return flat_buffer_numel(data_numel, world) // world


def group_padding(data_numel: int, world: int, rank: int, bf16_optimizer: bool = False) -> int:
    """group_paddings[g] of `rank`: the padding elements in its partition (stage_1_and_2.py groups_padding);
    BF16_Optimizer records the buffer's whole padding on the last rank and 0 elsewhere."""
    size = partition_size(data_numel, world)
    if bf16_optimizer:
        return flat_buffer_numel(data_numel, world) - data_numel if rank == world - 1 else 0
    return min(max((rank + 1) * size - data_numel, 0), size)


def saved_partition_numel(size: int, padding: int, bf16_optimizer: bool) -> int:
    """The saved fp32 partition's length: stage 1/2 strip the padding (_get_groups_without_padding);
    BF16_Optimizer saves the partition whole. The moments are saved whole in both."""
    return size if bf16_optimizer else size - padding


def partition_size_of_saved(saved_numel: int, padding: int, bf16_optimizer: bool) -> int:
    """P from a saved fp32 partition and its group padding (the inverse of saved_partition_numel)."""
    return saved_numel if bf16_optimizer else saved_numel + padding


def round_robin_order(count: int, world: int) -> list[int]:
    """Original indices in round-robin flat order: i % W == 0 first, then 1, ... (_round_robin_reorder)."""
    return [i for j in range(min(world, count)) for i in range(j, count, world)]


def round_robin(items: Sequence[T], world: int) -> list[T]:
    """Items in the flat order round_robin_gradients gives them at world size W."""
    return [items[i] for i in round_robin_order(len(items), world)]


def undo_round_robin(flat_items: Sequence[T], world: int) -> list[T]:
    """The original order of items saved in round-robin flat order at world size W."""
    position = round_robin_order(len(flat_items), world)  # flat position k holds original item position[k]
    out: list[Any] = [None] * len(flat_items)
    for k, original in enumerate(position):
        out[original] = flat_items[k]
    return out


def fragment(slot: Slot, start: int, size: int) -> tuple[int, int] | None:
    """(numel, start) of a param's fragment in the partition [start, start+size), the start counted from the
    partition's beginning (tensor_fragment.py get_hp_fragment_mapping); None when the param is not in it."""
    shared = overlap(slot.offset, slot.numel, start, size)
    return (shared[1] - shared[0], shared[0] - start) if shared else None


def slots_within(slots: Sequence[Slot], ends: Sequence[int], start: int, size: int) -> list[Slot]:
    """The slots with elements in [start, start+size), in order; `ends` holds each slot's end. Found by bisection:
    a rank of 1,024 meets a few dozen of a group's 20,000 params, and every rank asked of them all (a minute)."""
    out = []
    for slot in slots[bisect.bisect_right(ends, start) :]:
        if slot.offset >= start + size:
            break
        if slot.end > max(start, slot.offset):  # not an empty param
            out.append(slot)
    return out


def slice_mappings(slots: Sequence[Slot], start: int, size: int) -> list[tuple[str, int, int]]:
    """param_slice_mappings of one group on the rank whose partition is [start, start+size): (name, numel, start)
    of every param with elements there, in slot order. (Under round_robin_gradients without alignment pads
    DeepSpeed itself maps params by their original-order offsets, not their place in the round-robin flat
    buffer (mixed_precision_linkage.py); from the slots given, this gives the place they really have.)"""
    return [(slot.name, *address) for slot in slots if (address := fragment(slot, start, size))]


# ---- stage 3 -------------------------------------------------------------------------------------


def stage3_partition_size(numel: int, world: int) -> int:
    """Every rank's share of one parameter: ceil(n/W) (partition_parameters.py _partition_param)."""
    return ceil_div(numel, world)


def stage3_rank_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of a parameter's elements in `rank`'s partition; the partition's remaining
    stage3_partition_size - (end - start) elements are zero padding."""
    size = stage3_partition_size(numel, world)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def stage3_rank_count(numel: int, world: int) -> int:
    """How many ranks hold some of a parameter's elements (the rest hold padding only)."""
    return ceil_div(numel, stage3_partition_size(numel, world)) if numel else 0


def stage3_rank_parts(numels: Any, starts: Any, world: int, rank: int) -> tuple[Any, Any, Any, Any]:
    """stage3_rank_range of every param of a sub-group at once (numpy arrays of their sizes and their partitions' starts
    in a rank's flat): (start in the flat, param index, first element, count) of each param `rank` holds elements of."""
    import numpy as np

    size = -(-numels // world)
    lo = np.minimum(rank * size, numels)
    count = np.minimum(lo + size, numels) - lo
    held = np.flatnonzero(count > 0)
    return starts[held], held, lo[held], count[held]


def stage3_slots(params: Sequence[Param], world: int) -> list[Slot]:
    """A sub-group's params in each rank's flat partition: every param takes ceil(n/W) elements."""
    out, offset = [], 0
    for name, shape in params:
        out.append(Slot(name, tuple(shape), offset))
        offset += stage3_partition_size(math.prod(shape), world)
    return out


def stage3_flat_numel(params: Sequence[Param], world: int) -> int:
    """The length of each rank's flat partition of a sub-group: the sum of its params' ceil(n/W)."""
    return sum(stage3_partition_size(math.prod(shape), world) for _, shape in params)


def stage3_sub_groups(params: Sequence[Param], world: int, sub_group_size: int | None) -> list[list[Param]]:
    """stage3.py _create_fp16_sub_groups: a sub-group closes once its params' partition elements reach sub_group_size."""
    if sub_group_size is None or sub_group_size >= stage3_flat_numel(params, world):
        return [list(params)]
    subs, current, total = [], [], 0
    for i, (name, shape) in enumerate(params):
        current.append((name, shape))
        total += stage3_partition_size(math.prod(shape), world)
        if total >= sub_group_size or i == len(params) - 1:
            subs.append(current)
            current, total = [], 0
    return subs


def stage3_group_sub_groups(
    groups: Sequence[Sequence[Param]], world: int, sub_group_size: int | None
) -> tuple[list[list[Param]], list[list[int]]]:
    """Every param group's sub-groups, numbered across groups: (sub-groups, each group's sub-group indices)."""
    subs: list[list[Param]] = []
    group_subs: list[list[int]] = []
    for params in groups:
        mine = stage3_sub_groups(params, world, sub_group_size)
        group_subs.append(list(range(len(subs), len(subs) + len(mine))))
        subs += mine
    return subs, group_subs


# ---- expert parallelism (DeepSpeed MoE, ZeRO-1/2) ----------------------------------------------------

EXPERT_GROUP = re.compile(r"^ep_size_(\d+)$")  # an MoE param group's name (MoE.expert_group_name)
EXPERT_PARAM = re.compile(r"^(.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)(\..+)$")  # module, local id, rest


def expert_data_parallel_size(world: int, ep_size: int) -> int:
    """D: the ranks that share one expert-parallel rank's experts (groups.py: world must divide by ep_size)."""
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"world size {world} is not a multiple of the expert-parallel size {ep_size}")
    return world // ep_size


def expert_position(rank: int, world: int, ep_size: int, data_before_expert: bool) -> tuple[int, int]:
    """(expert-parallel rank, expert-data-parallel rank) of a global rank. Default (E + D): the expert-data-parallel
    groups are strided, ranks e, e+E, e+2E...; use_data_before_expert_parallelism (D + E): they are contiguous."""
    d = expert_data_parallel_size(world, ep_size)
    return (rank // d, rank % d) if data_before_expert else (rank % ep_size, rank // ep_size)


def expert_holders(ep_rank: int, world: int, ep_size: int, data_before_expert: bool) -> list[int]:
    """The global ranks holding partitions 0..D-1 of expert-parallel rank ep_rank's experts (its expert-data-parallel group,
    in rank order, as stage_1_and_2.py get_ep_ranks lists it)."""
    d = expert_data_parallel_size(world, ep_size)
    return [ep_rank * d + i for i in range(d)] if data_before_expert else [ep_rank + i * ep_size for i in range(d)]


def expert_module(name: str) -> str | None:
    """The MoE module of an expert parameter's name; None for any other parameter."""
    m = EXPERT_PARAM.match(name)
    return m.group(1) if m else None


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """A local expert parameter's name with its global expert id, ep_rank * num_local + local id (engine.py
    _save_moe_checkpoint); any other name unchanged."""
    m = EXPERT_PARAM.match(name)
    if not m:
        return name
    return f"{m.group(1)}.deepspeed_moe.experts.deepspeed_experts.{ep_rank * num_local + int(m.group(2))}{m.group(3)}"


@dataclass(frozen=True)
class ExpertLayout:
    """How a ZeRO-1/2 MoE checkpoint spreads its param groups (in the order of rank 0's file, which param_shapes
    records): each group's expert-parallel size (1 for a dense group: one replica over all W ranks), the experts
    per expert-parallel rank of each MoE module, and the rank topology."""

    ep_sizes: tuple[int, ...]
    num_local: Mapping[str, int]
    data_before_expert: bool
    layers: tuple[str, ...]  # the MoE modules in layer order (the expert files' layer ids)

    def partition_count(self, g: int, world: int) -> int:
        return expert_data_parallel_size(world, self.ep_sizes[g])

    def holders(self, g: int, world: int, ep_rank: int) -> list[int]:
        return expert_holders(ep_rank, world, self.ep_sizes[g], self.data_before_expert)

    def position(self, g: int, world: int, rank: int) -> tuple[int, int]:
        return expert_position(rank, world, self.ep_sizes[g], self.data_before_expert)

    def name(self, local_name: str, ep_rank: int) -> str:
        module = expert_module(local_name)
        return local_name if module is None else global_expert_name(local_name, ep_rank, self.num_local[module])
