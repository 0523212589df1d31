"""DeepSpeed MoE at a new expert-parallel size: the param groups DeepSpeed builds for it.

A reshard that changes an MoE layer's ep_size moves experts between expert-parallel ranks: each rank then holds
num_experts / ep_size of them under local ids, and the MoE param groups are rebuilt as moe/utils.py
`split_params_into_different_moe_groups_for_optimizer` builds them for the new model: per client param group (in order),
one group per expert group name `ep_size_N` holding that name's experts in module order, cut past `max_group_size`
elements. The expert files are named by global expert id and do not change. The source's groups are first rebuilt by
the same rule at the old sizes and must come out exactly as saved; a layout the rule does not give is refused, never
guessed. Rules: docs/formats.md §2.12.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_cli.errors import UsageError
from ckpt_cli.formats.deepspeed import layout as zl
from ckpt_cli.formats.deepspeed.layout import EXPERT_PARAM, ExpertLayout, Shape, Slot, ZeroLayout

MAX_GROUP_SIZE = 178_956_971  # split_params_into_different_moe_groups_for_optimizer's default max_group_size
SPLIT_KEYS = ("params", "name", "moe")  # what the split sets; every other key is the client group's


@dataclass(frozen=True)
class Regrouped:
    """A ZeroLayout for the writer: the dense groups as saved, then the MoE groups at the new expert-parallel sizes.
    `templates[g]`: the saved group whose per-group values (the optimizer step) new group g takes."""

    shapes: list[OrderedDict[str, Shape]]
    groups: list[Mapping[str, Any]]
    experts: ExpertLayout
    templates: list[int]
    alignment_padding = False

    def offsets(self, g: int) -> list[Slot]:
        return zl.flat_slots(list(self.shapes[g].items()))


def module_ep_sizes(layout: ZeroLayout) -> dict[str, int]:
    """Each MoE module's expert-parallel size, from the name (ep_size_N) of the groups holding its experts."""
    assert layout.experts is not None
    out: dict[str, int] = {}
    for g, shapes in enumerate(layout.shapes):
        for name in shapes:
            if (module := zl.expert_module(name)) is not None:
                out[module] = layout.experts.ep_sizes[g]
    return out


def choose_ep_sizes(
    current: Mapping[str, int], num_experts: Mapping[str, int], world: int, asked: Sequence[tuple[str, int]] | None
) -> dict[str, int]:
    """The new ep_size of every MoE module: as asked (--ep-size: (module, size), module "" for every other layer), else
    kept where it divides the new world size, else the largest size that divides the world size and the module's experts."""
    wanted = dict(asked or ())
    unknown = sorted(m for m in wanted if m and m not in current)
    if unknown:
        raise UsageError(f"--ep-size {unknown[0]}=...: no MoE layer of that name; the MoE layers are {', '.join(current)}")
    out = {}
    for module, ep in current.items():
        n = num_experts[module]
        size = wanted.get(module, wanted.get(""))
        if size is None:
            size = ep if world % ep == 0 else max(e for e in range(1, world + 1) if world % e == 0 and n % e == 0)
        elif world % size or n % size:
            raise UsageError(
                f"--ep-size {size} for {module}: DeepSpeed needs an expert-parallel size that divides the world size ({world}) "
                f"and the layer's experts ({n})"
            )
        out[module] = size
    return out


def _client_key(group: Mapping[str, Any]) -> str:
    """A client param group's identity in the MoE groups split from it: its hyper-parameters (the split renames it)."""
    return repr(sorted((str(k), repr(v)) for k, v in group.items() if k not in SPLIT_KEYS))


def _cut(params: Sequence[tuple[str, Shape]], max_group_size: int) -> list[OrderedDict[str, Shape]]:
    """One name's params of one client group cut as the split cuts them (a group closes before the param past the max)."""
    out: list[OrderedDict[str, Shape]] = []
    current: OrderedDict[str, Shape] = OrderedDict()
    size = 0
    for name, shape in params:
        numel = math.prod(shape)
        if size + numel > max_group_size:
            out.append(current)
            current, size = OrderedDict(), 0
        current[name] = shape
        size += numel
    if current:
        out.append(current)
    return out


@dataclass
class _Client:
    """One client param group's experts: per MoE module, one expert's params (the part after the expert id, shape)."""

    template: int  # its first MoE group in the saved order
    experts: dict[str, list[tuple[str, Shape]]]


def _clients(layout: ZeroLayout, num_local: Mapping[str, int]) -> dict[str, _Client]:
    """The client groups behind the saved MoE groups, each module's per-expert params checked to be alike for every
    local expert (DeepSpeed's Experts deep-copies one expert module)."""
    clients: dict[str, _Client] = {}
    seen: dict[tuple[str, str, int], list[tuple[str, Shape]]] = {}
    for g, group in enumerate(layout.groups):
        if not group.get("moe"):
            continue
        clients.setdefault(_client_key(group), _Client(g, {}))
        for name, shape in layout.shapes[g].items():
            m = EXPERT_PARAM.match(name)
            if not m:
                raise UsageError(f"param group {g} ({group.get('name')}) holds {name}, not an expert parameter")
            module, local, rest = m.group(1), int(m.group(2)), m.group(3)
            seen.setdefault((_client_key(group), module, local), []).append((rest, tuple(shape)))
    for (key, module, local), params in seen.items():
        first = seen.get((key, module, 0))
        if first != params or local >= num_local[module]:
            raise UsageError(
                f"the experts of {module} differ in the optimizer's param groups; changing ep_size is not supported for this checkpoint"
            )
        clients[key].experts.setdefault(module, params)
    return clients


def _moe_groups(
    client: _Client, eps: Mapping[str, int], num_experts: Mapping[str, int], layers: Sequence[str], max_group_size: int
) -> dict[str, list[OrderedDict[str, Shape]]]:
    """A client group's MoE groups at expert-parallel sizes `eps`, by name: rank 0's experts (local ids) in module order."""
    out = {}
    for ep in sorted({eps[m] for m in client.experts}):
        params = [
            (f"{module}.deepspeed_moe.experts.deepspeed_experts.{local}{rest}", shape)
            for module in layers
            if module in client.experts and eps[module] == ep
            for local in range(num_experts[module] // ep)
            for rest, shape in client.experts[module]
        ]
        out[f"ep_size_{ep}"] = _cut(params, max_group_size)
    return out


def _as_lists(groups: Mapping[tuple[str, str], list[OrderedDict[str, Shape]]]) -> dict[tuple[str, str], list[list[tuple[str, Shape]]]]:
    return {key: [list(cut.items()) for cut in cuts] for key, cuts in groups.items()}


def regroup(layout: ZeroLayout, new_eps: Mapping[str, int], max_group_size: int = MAX_GROUP_SIZE) -> Regrouped:
    """The param groups of `layout` (a saved ZeRO-1/2 MoE checkpoint) with every MoE module at its new expert-parallel size."""
    experts = layout.experts
    assert experts is not None
    old_eps = module_ep_sizes(layout)

    num_experts = {m: experts.num_local[m] * old_eps[m] for m in old_eps}
    clients = _clients(layout, experts.num_local)
    saved: dict[tuple[str, str], list[OrderedDict[str, Shape]]] = {}
    for g, group in enumerate(layout.groups):
        if group.get("moe"):
            saved.setdefault((_client_key(group), str(group.get("name"))), []).append(OrderedDict(layout.shapes[g]))
    rebuilt = {
        (key, name): cuts
        for key, c in clients.items()
        for name, cuts in _moe_groups(c, old_eps, num_experts, experts.layers, max_group_size).items()
    }
    if _as_lists(rebuilt) != _as_lists(saved):
        raise UsageError(
            "the saved MoE param groups are not those split_params_into_different_moe_groups_for_optimizer builds from param groups "
            "listing each module's experts in order; changing ep_size is not supported for this checkpoint (keep it with --ep-size)"
        )
    shapes: list[OrderedDict[str, Shape]] = []
    groups: list[Mapping[str, Any]] = []
    templates, ep_sizes = [], []
    for g, group in enumerate(layout.groups):
        if not group.get("moe"):
            shapes.append(OrderedDict(layout.shapes[g]))
            groups.append(group)
            templates.append(g)
            ep_sizes.append(1)
    for client in clients.values():
        for name, cuts in _moe_groups(client, new_eps, num_experts, experts.layers, max_group_size).items():
            for cut in cuts:
                shapes.append(cut)
                groups.append({**layout.groups[client.template], "name": name})
                templates.append(client.template)
                ep_sizes.append(int(name.removeprefix("ep_size_")))
    num_local = {m: num_experts[m] // new_eps[m] for m in num_experts}
    return Regrouped(shapes, groups, ExpertLayout(tuple(ep_sizes), num_local, experts.data_before_expert, experts.layers), templates)
