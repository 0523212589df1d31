"""FSDP1's flat-parameter optimizer state in per-rank files (verl's `optimizer.state_dict()` under FSDP1 with
use_orig_params=False), read per parameter and laid out again at another world size.

FSDP1 flattens each wrapped unit's parameters into one FlatParameter (torch/distributed/fsdp/_flat_param.py
`FlatParamHandle`): the unit's parameters in module order, each flattened, no padding between them (alignment
padding only comes with use_orig_params=True), the whole padded at the end to a multiple of the world size; rank r
holds `torch.chunk`'s r-th piece, padded to the first's length (`_get_shard`). The optimizer sees only the
FlatParameters, in `model.parameters()` order: the root unit's first (what no nested unit took: embeddings, final
norm, head), then each nested unit. Its state is 1-D tensors of each rank's piece; no file says which parameters a
FlatParameter holds. ckpt finds out from the model file: the units verl's auto-wrap policy makes (one per numbered
block such as `model.layers.N`, the root holding the rest), or one unit of everything, and takes a grouping only
when every FlatParameter's length is exactly what it gives at this world size. Facts: docs/formats.md §8.2.

Each parameter's moments are then named as FSDP2 (and use_orig_params=True) name them, `optimizer.state.<i>.<key>`
with i the parameter's index in `model.parameters()`, and the param groups list those indices.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core.model import Box, FlatRange, ObjectEntry, Piece, TensorEntry, lazy_flat, sub_tensor
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError
from ckpt_cli.formats.torch_save import stored_array

_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # a numbered block: model.layers.3.mlp.up_proj.weight -> model.layers.3


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatLayout:
    """Which parameters (by index in `model.parameters()`) each FlatParameter holds, in order, and each unit's state keys."""

    units: tuple[tuple[int, ...], ...]
    keys: tuple[tuple[str, ...], ...]

    def numel(self, params: list[Param], unit: int) -> int:
        return sum(params[i].numel for i in self.units[unit])

    def owners(self) -> dict[int, int]:
        """Parameter index -> the FlatParameter holding it."""
        return {i: k for k, unit in enumerate(self.units) for i in unit}


def shard_length(total: int, world: int) -> int:
    """Elements of each rank's padded piece of a FlatParameter of `total` elements."""
    return -(-total // world)


def candidate_units(params: list[Param]) -> list[list[list[int]]]:
    """The groupings verl's wrap policies give: the root unit (what no numbered block holds) and one unit per block,
    in module order; and everything in one unit (no auto wrap)."""
    blocks: dict[str, list[int]] = {}
    root: list[int] = []
    for i, p in enumerate(params):
        m = _BLOCK.match(p.name)
        if m:
            blocks.setdefault(m.group(1), []).append(i)
        else:
            root.append(i)
    by_block = ([root] if root else []) + list(blocks.values())
    everything = [list(range(len(params)))]
    return [by_block, everything] if by_block != everything else [everything]


def find_units(params: list[Param], lengths: list[int], world: int) -> list[list[int]] | None:
    """The grouping whose FlatParameters have exactly these per-rank lengths at `world` ranks (None: none does)."""
    for units in candidate_units(params):
        if len(units) == len(lengths) and all(
            shard_length(sum(params[i].numel for i in unit), world) == n for unit, n in zip(units, lengths)
        ):
            return units
    return None


@dataclass
class FlatState:
    """What read_flat found: the per-parameter tensors, the param groups by parameter index, and the layout."""

    tensors: dict[str, TensorEntry]
    groups: ObjectEntry
    layout: FlatLayout


def read_flat(trees: list[tuple[str, Any, dict[str, Any]]], params: list[Param], world: int) -> FlatState | str:
    """trees: (file, optimizer state dict, zip records) per rank. The per-parameter state, or why it cannot be read."""
    first = trees[0][1]
    state, groups = first.get("state"), first.get("param_groups")
    if (
        not isinstance(state, dict)
        or not isinstance(groups, list)
        or not all(type(k) is int for k in state)
        or sorted(state) != list(range(len(state)))
    ):
        return "an optimizer state that is not {state: {0..K-1: ...}, param_groups: [...]}"
    lengths, keys = [], []
    for k in range(len(state)):
        unit = state[k]
        if not isinstance(unit, dict) or not all(isinstance(v, TensorRef) for v in unit.values()):
            return f"optimizer state {k} is not a dict of tensors"
        flat = [v for v in unit.values() if len(v.shape) == 1]
        if not flat or len({v.shape for v in flat}) != 1 or any(len(v.shape) > 1 for v in unit.values()):
            return f"optimizer state {k} holds no flat 1-D tensors of one length"
        lengths.append(flat[0].shape[0])
        keys.append(tuple(unit))
    found = find_units(params, lengths, world)
    if found is None:
        return (
            f"{len(lengths)} FlatParameters of {', '.join(map(str, lengths))} elements per rank match no grouping of the "
            f"model's {len(params)} parameters (one unit per numbered block plus the root, or one unit)"
        )
    layout = FlatLayout(tuple(tuple(u) for u in found), tuple(keys))
    tensors: dict[str, TensorEntry] = {}
    for k, unit in enumerate(layout.units):
        for key in layout.keys[k]:
            tensors.update(_per_param(trees, params, k, unit, key, lengths[k]))
    owner = layout.owners()
    regrouped = []
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) or not all(type(i) is int for i in g["params"]):
            return "param_groups that are not dicts with a list of indices under 'params'"
        held = set(g["params"])
        regrouped.append({**g, "params": [i for i in range(len(params)) if owner[i] in held]})
    path = ("optimizer", "param_groups")
    return FlatState(tensors, ObjectEntry(path_name(path), regrouped, "optimizer", path), layout)


def _per_param(
    trees: list[tuple[str, Any, dict[str, Any]]], params: list[Param], k: int, unit: tuple[int, ...], key: str, length: int
) -> dict[str, TensorEntry]:
    """One state key of FlatParameter k, cut into its parameters (a 0-d value, Adam's step, is each one's)."""
    path0, tree0, records0 = trees[0]
    ref0 = tree0["state"][k][key]
    out = {}
    if not ref0.shape:
        array = stored_array(ref0, records0, path0, f"state.{k}.{key}")
        for i in unit:
            path = ("optimizer", "state", i, key)
            out[path_name(path)] = TensorEntry(path_name(path), ref0.dtype, (), "optimizer", [Piece(Box((), ()), array)], path)
        return out
    pieces = []
    for r, (where, tree, records) in enumerate(trees):
        ref = tree["state"][k][key]
        if not isinstance(ref, TensorRef) or ref.shape != ref0.shape or ref.dtype != ref0.dtype:
            if not isinstance(ref, TensorRef):
                raise DataError(f"{where}: optimizer state {k} '{key}' is not a plain tensor; rank 0 has one")
            raise DataError(
                f"{where}: optimizer state {k} '{key}' is {ref.dtype}{list(ref.shape)}; rank 0 has {ref0.dtype}{list(ref0.shape)}"
            )
        pieces.append(Piece(FlatRange(r * length, length), stored_array(ref, records, where, f"state.{k}.{key}")))
    whole = TensorEntry(f"state.{k}.{key}", ref0.dtype, (length * len(trees),), "optimizer", pieces)
    offset = 0
    for i in unit:
        path = ("optimizer", "state", i, key)
        out[path_name(path)] = sub_tensor(whole, path_name(path), offset, params[i].shape)
        out[path_name(path)].path = path
        offset += params[i].numel
    return out


def flat_state(
    layout: FlatLayout, params: list[Param], tensors: dict[str, TensorEntry], world: int, rank: int
) -> dict[int, dict[str, TensorEntry]]:
    """Rank `rank`'s piece of every FlatParameter's state at `world` ranks, from the per-parameter tensors."""
    out: dict[int, dict[str, TensorEntry]] = {}
    for k, unit in enumerate(layout.units):
        total = layout.numel(params, k)
        length = shard_length(total, world)
        lo = rank * length
        out[k] = {}
        for key in layout.keys[k]:
            first = tensors[path_name(("optimizer", "state", unit[0], key))]
            if not first.shape:
                out[k][key] = first
                continue
            parts, offset = [], 0
            for i in unit:
                entry = tensors[path_name(("optimizer", "state", i, key))]
                a, b = max(offset, lo), min(offset + entry.numel, lo + length)
                if a < b:
                    parts.append((a - lo, entry, a - offset, b - a))
                offset += entry.numel
            out[k][key] = lazy_flat(f"state.{k}.{key}", first.dtype, length, parts, "optimizer")
    return out


def flat_groups(layout: FlatLayout, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups by FlatParameter, as FSDP1's optimizer holds them."""
    owner = layout.owners()
    return [{**g, "params": sorted({owner[i] for i in g["params"]})} for g in groups]
