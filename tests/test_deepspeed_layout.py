"""The ZeRO partition math (formats/deepspeed/layout.py) on concrete numbers, without DeepSpeed.

The numbers are those of the test model's two param groups (tests/producers/net.py) as DeepSpeed 0.19.8
saved them at world sizes 2 and 3 (read from its files: group_paddings, single_partition_of_fp32_groups,
param_slice_mappings, fp32_flat_groups, frozen_param_fragments, round-robin param_shapes), plus edge
cases worked by hand from stage_1_and_2.py, bf16_optimizer.py, stage3.py and partition_parameters.py."""

from __future__ import annotations

import pytest

from ckpt_cli.formats.deepspeed import layout as zl

# The test model's param groups: weights (decayed) and biases, numels 444, 348, 348 and 29, 29, 29, 12.
WEIGHTS = [("embed.weight", (37, 12)), ("block.0.weight", (29, 12)), ("block.2.weight", (12, 29))]
BIASES = [("block.0.bias", (29,)), ("block.1.weight", (29,)), ("block.1.bias", (29,)), ("block.2.bias", (12,))]


def names(items):
    return [name for name, _ in items]


def test_ceil_helpers_and_overlap():
    assert [zl.ceil_div(n, 3) for n in (0, 1, 3, 4)] == [0, 1, 1, 2]
    assert [zl.ceil_to(n, 6) for n in (0, 1, 6, 99)] == [0, 6, 6, 102]
    assert zl.overlap(0, 444, 380, 380) == (380, 444)
    assert zl.overlap(0, 10, 10, 5) is None and zl.overlap(5, 0, 0, 10) is None


# ---- stage 1/2 ----


def test_flat_slots_pack_params_with_alignment_pads():
    slots = zl.flat_slots(WEIGHTS)
    assert [(s.name, s.offset, s.numel) for s in slots] == [
        ("embed.weight", 0, 444),
        ("block.0.weight", 444, 348),
        ("block.2.weight", 792, 348),
    ]
    assert zl.flat_numel(slots) == 1140 and zl.flat_numel([]) == 0
    # parameter_alignment with fp16 (16 // gcd(16, 2) = 8): numels 5, 3, 7 padded to 8 each but the last
    padded = zl.flat_slots([("a", (5,)), ("b", (3,)), ("c", (7,))], [3, 5, 0])
    assert [s.offset for s in padded] == [0, 8, 16] and zl.flat_numel(padded) == 23


@pytest.mark.parametrize(
    "data,world,flat,size",
    [(1140, 2, 1140, 570), (99, 2, 100, 50), (1140, 3, 1140, 380), (99, 3, 102, 34), (99, 1, 100, 100), (1, 4, 8, 2)],
)
def test_partition_size_aligns_the_flat_buffer_to_2w(data, world, flat, size):
    assert zl.flat_buffer_numel(data, world) == flat and zl.partition_size(data, world) == size


def test_group_paddings_stage12_and_bf16_optimizer():
    # As saved: W=2 biases [0, 1], W=3 biases [0, 0, 3]; the weights group (1140) divides evenly.
    assert [zl.group_padding(99, 2, r) for r in range(2)] == [0, 1]
    assert [zl.group_padding(99, 3, r) for r in range(3)] == [0, 0, 3]
    assert [zl.group_padding(1140, 3, r) for r in range(3)] == [0, 0, 0]
    assert [zl.group_padding(99, 3, r, bf16_optimizer=True) for r in range(3)] == [0, 0, 3]
    # More ranks than data: stage 1/2 count each rank's own padding (a whole partition past the data);
    # BF16_Optimizer puts the buffer's whole padding on the last rank.
    assert [zl.group_padding(1, 4, r) for r in range(4)] == [1, 2, 2, 2]
    assert [zl.group_padding(1, 4, r, bf16_optimizer=True) for r in range(4)] == [0, 0, 0, 7]


def test_saved_partition_strips_padding_except_bf16_optimizer():
    # W=2 biases, rank 1: stage 1/2 save 49 fp32 elements, BF16_Optimizer 50; both save 50 moment elements.
    assert zl.saved_partition_numel(50, 1, bf16_optimizer=False) == 49
    assert zl.saved_partition_numel(50, 1, bf16_optimizer=True) == 50
    assert zl.partition_size_of_saved(49, 1, bf16_optimizer=False) == 50
    assert zl.partition_size_of_saved(50, 1, bf16_optimizer=True) == 50


def test_round_robin_order():
    assert zl.round_robin_order(4, 2) == [0, 2, 1, 3]
    assert zl.round_robin_order(4, 3) == [0, 3, 1, 2]
    assert zl.round_robin_order(3, 2) == [0, 2, 1]
    assert zl.round_robin_order(2, 4) == [0, 1] and zl.round_robin_order(0, 2) == []
    # param_shapes as DeepSpeed saved them under round_robin_gradients
    assert names(zl.round_robin(BIASES, 2)) == ["block.0.bias", "block.1.bias", "block.1.weight", "block.2.bias"]
    assert names(zl.round_robin(BIASES, 3)) == ["block.0.bias", "block.2.bias", "block.1.weight", "block.1.bias"]
    assert names(zl.round_robin(WEIGHTS, 2)) == ["embed.weight", "block.2.weight", "block.0.weight"]


@pytest.mark.parametrize("count", [0, 1, 2, 5, 7])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_undo_round_robin_inverts_it(count, world):
    items = list(range(count))
    assert zl.undo_round_robin(zl.round_robin(items, world), world) == items


def test_round_robin_reflow_to_another_world_size():
    """The reshard writer's new flat order: the W=2 save's order undone, then applied for W=3 (as W=3 saved it)."""
    saved_at_2 = zl.round_robin(BIASES, 2)
    assert names(zl.round_robin(zl.undo_round_robin(saved_at_2, 2), 3)) == names(zl.round_robin(BIASES, 3))


def test_slice_mappings_as_deepspeed_saves_them():
    weights, biases = zl.flat_slots(WEIGHTS), zl.flat_slots(BIASES)
    # W=3, weights group (P=380)
    assert zl.slice_mappings(weights, 0, 380) == [("embed.weight", 380, 0)]
    assert zl.slice_mappings(weights, 380, 380) == [("embed.weight", 64, 0), ("block.0.weight", 316, 64)]
    assert zl.slice_mappings(weights, 760, 380) == [("block.0.weight", 32, 0), ("block.2.weight", 348, 32)]
    # W=2, biases group (P=50): rank 1 holds the tail and one padding element
    assert zl.slice_mappings(biases, 0, 50) == [("block.0.bias", 29, 0), ("block.1.weight", 21, 29)]
    assert zl.slice_mappings(biases, 50, 50) == [("block.1.weight", 8, 0), ("block.1.bias", 29, 8), ("block.2.bias", 12, 37)]
    assert zl.fragment(zl.Slot("empty", (0,), 10), 0, 50) is None  # zero-element params get no mapping


@pytest.mark.parametrize("paddings", [None, [0, 5, 0, 3, 0, 0, 1]])
@pytest.mark.parametrize("world", [1, 2, 3, 64, 1024])
def test_slots_within_finds_by_bisection_what_a_scan_of_every_slot_finds(paddings, world):
    slots = zl.flat_slots([*BIASES, ("empty", (0,)), *WEIGHTS], paddings and [*paddings, 0])  # pads between, an empty param
    ends = [slot.end for slot in slots]
    size = zl.partition_size(zl.flat_numel(slots), world)
    for rank in range(world):
        scanned = [slot for slot in slots if zl.fragment(slot, rank * size, size)]
        assert zl.slots_within(slots, ends, rank * size, size) == scanned
        assert zl.slice_mappings(zl.slots_within(slots, ends, rank * size, size), rank * size, size) == zl.slice_mappings(
            slots, rank * size, size
        )


# ---- stage 3 ----


@pytest.mark.parametrize(
    "numel,world,size", [(444, 3, 148), (348, 3, 116), (29, 2, 15), (12, 3, 4), (84, 2, 42), (7, 2, 4), (7, 3, 3), (0, 2, 0)]
)
def test_stage3_partition_size_is_ceil_n_over_w(numel, world, size):
    assert zl.stage3_partition_size(numel, world) == size


def test_stage3_rank_ranges_pad_the_last_ranks():
    # frozen.bias (7 elements) at W=2: rank 1 holds elements 4..6 and one padding element
    assert [zl.stage3_rank_range(7, 2, r) for r in range(2)] == [(0, 4), (4, 7)]
    assert [zl.stage3_rank_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]
    # 2 elements on 4 ranks: ranks 2 and 3 hold padding only
    assert [zl.stage3_rank_range(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_stage3_slots_and_flat_numel():
    # fp32_flat_groups as saved: W=2 [570, 51], W=3 [380, 34]
    assert [s.offset for s in zl.stage3_slots(BIASES, 2)] == [0, 15, 30, 45]
    assert [zl.stage3_flat_numel(g, 2) for g in (WEIGHTS, BIASES)] == [570, 51]
    assert [zl.stage3_flat_numel(g, 3) for g in (WEIGHTS, BIASES)] == [380, 34]


def test_stage3_sub_groups_close_when_the_partition_elements_reach_the_size():
    # W=2 partitions of the weights: 222, 174, 174 -> running 222, 396: the sub-group closes at 396 >= 300
    assert [names(s) for s in zl.stage3_sub_groups(WEIGHTS, 2, 300)] == [["embed.weight", "block.0.weight"], ["block.2.weight"]]
    assert [names(s) for s in zl.stage3_sub_groups(WEIGHTS, 2, 222)] == [["embed.weight"], ["block.0.weight", "block.2.weight"]]
    assert [names(s) for s in zl.stage3_sub_groups(WEIGHTS, 2, 174)] == [["embed.weight"], ["block.0.weight"], ["block.2.weight"]]
    assert [names(s) for s in zl.stage3_sub_groups(WEIGHTS, 3, 300)] == [names(WEIGHTS)]  # 148, 264, 380: the last closes it
    assert zl.stage3_sub_groups(WEIGHTS, 2, 570) == [WEIGHTS]  # size >= the group's partition elements: one sub-group
    assert zl.stage3_sub_groups(WEIGHTS, 2, None) == [WEIGHTS]
    assert zl.stage3_sub_groups(WEIGHTS, 2, 10**9) == [WEIGHTS]  # DeepSpeed's default sub_group_size


def test_stage3_sub_groups_are_numbered_across_param_groups():
    subs, group_subs = zl.stage3_group_sub_groups([WEIGHTS, BIASES], 2, 300)
    assert [names(s) for s in subs] == [["embed.weight", "block.0.weight"], ["block.2.weight"], names(BIASES)]
    assert group_subs == [[0, 1], [2]]


def test_flat_pieces_of_sorted_partitions_look_only_where_the_param_lies():
    """flat_pieces with the partitions' starts (bisected) gives what the scan of every partition gives."""
    import random

    from ckpt_cli.formats.deepspeed.partitions import flat_pieces

    rng = random.Random(1)
    for _ in range(3000):
        size, world = rng.randrange(1, 20), rng.randrange(1, 9)
        parts = [(d * size, size if d < world - 1 else rng.randrange(size + 1), f"rank{d}", rng.randrange(3)) for d in range(world)]
        start, numel = rng.randrange(size * world + 3), rng.randrange(size * world)
        assert flat_pieces(start, numel, parts, [p[0] for p in parts]) == flat_pieces(start, numel, parts)


# ---- a new expert-parallel size (formats/deepspeed/regroup.py) -------------------------------------------------------

EXPERTS_OF = "m.deepspeed_moe.experts.deepspeed_experts"


def _moe_layout(expert_order: list[int]):
    """A saved ZeRO-1/2 MoE layout: a dense group, then module m's local experts (4 experts at ep_size 2) in one MoE group."""
    from collections import OrderedDict

    from ckpt_cli.formats.deepspeed.layout import ExpertLayout
    from ckpt_cli.formats.deepspeed.regroup import Regrouped

    moe = OrderedDict((f"{EXPERTS_OF}.{e}.0.{p}", s) for e in expert_order for p, s in (("weight", (4, 4)), ("bias", (4,))))
    groups = [{"name": "decay", "lr": 0.1, "params": [0]}, {"name": "ep_size_2", "lr": 0.1, "moe": True, "params": [1]}]
    return Regrouped([OrderedDict(w=(3, 3)), moe], groups, ExpertLayout((1, 2), {"m": 2}, False, ("m",)), [0, 1])


def test_regroup_builds_the_groups_deepspeed_splits_and_cuts():
    """ep_size 2 -> 1: all four experts on every rank under local ids 0..3, cut past max_group_size as
    split_params_into_different_moe_groups_for_optimizer cuts (a group closes before the param that would pass it)."""
    from ckpt_cli.formats.deepspeed.regroup import regroup

    out = regroup(_moe_layout([0, 1]), {"m": 1}, max_group_size=40)  # an expert is 20 elements
    assert [list(s) for s in out.shapes[1:]] == [
        [f"{EXPERTS_OF}.{e}.0.{p}" for e in (0, 1) for p in ("weight", "bias")],
        [f"{EXPERTS_OF}.{e}.0.{p}" for e in (2, 3) for p in ("weight", "bias")],
    ]
    assert [g["name"] for g in out.groups] == ["decay", "ep_size_1", "ep_size_1"] and out.templates == [0, 1, 1]
    assert out.experts.ep_sizes == (1, 1, 1) and out.experts.num_local == {"m": 4}
    assert [slot.offset for slot in out.offsets(1)] == [0, 16, 20, 36]


def test_regroup_refuses_groups_the_rule_does_not_give():
    """Expert params listed out of module order: DeepSpeed's split of the new model would differ, so nothing is guessed."""
    from ckpt_cli.errors import UsageError
    from ckpt_cli.formats.deepspeed.regroup import regroup

    with pytest.raises(UsageError, match="changing ep_size is not supported for this checkpoint"):
        regroup(_moe_layout([1, 0]), {"m": 1})


@pytest.mark.parametrize(
    "ep,experts,world,asked,want",
    [(2, 4, 4, None, 2), (2, 4, 3, None, 1), (2, 4, 1, None, 1), (4, 8, 6, None, 2), (2, 4, 4, (("", 4),), 4), (2, 4, 8, (("m", 1),), 1)],
)
def test_choose_ep_sizes(ep, experts, world, asked, want):
    from ckpt_cli.formats.deepspeed.regroup import choose_ep_sizes

    assert choose_ep_sizes({"m": ep}, {"m": experts}, world, asked) == {"m": want}
