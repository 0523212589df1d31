"""DeepSpeed MoE (expert parallel, `deepspeed.moe.layer.MoE`) under ZeRO-1/2: what its tag folder adds to a dense one
(without ZeRO: deepspeed/stage0.py).

engine.py `_save_moe_checkpoint` writes one `layer_L_expert_E_mp_rank_00_model_states.pt` per MoE layer L (in
named_modules order) and global expert E, holding that expert's module weights (training dtype) under global names;
the model-states file without any expert weight, with `num_experts` (one count per MoE layer); and the ZeRO optimizer
files as for a dense run, where each MoE param group (named `ep_size_X`, 'moe': True) is partitioned over its
expert-data-parallel group and holds the rank's own experts under local ids. Rules: docs/formats.md §2.12, the
partition math in deepspeed/layout.py (ExpertLayout).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core.model import Box, Piece, TensorEntry
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.deepspeed import layout as zl
from ckpt_cli.formats.deepspeed.partitions import Stage12Partitions, ZeroFile

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OLD_EXPERT_FILE = re.compile(r"^expert_\d+_mp_rank_\d+_model_states\.pt$")  # layer id -1: DeepSpeed before 0.6
EXPP_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Model-states keys the MoE engine adds (engine.py _save_moe_checkpoint).
ENGINE_KEYS = {"num_experts", "ds_autoep_layers"}


def is_moe(folder: Path, model: Mapping[str, Any]) -> bool:
    if isinstance(model.get("num_experts"), (list, int)) or model.get("ds_autoep_layers"):
        return True
    return any(pattern.match(p.name) for p in folder.iterdir() for pattern in (EXPERT_FILE, OLD_EXPERT_FILE, EXPP_OPTIM))


@dataclass
class MoEFiles:
    """The expert-parallel layout of a read tag folder, and its expert files by (layer, global expert)."""

    layout: zl.ExpertLayout
    order: dict[int, list[int]]  # order[r][g]: where rank r's file keeps rank 0's group g
    num_experts: list[int]
    expert_groups: list[int]  # the MoE param groups (rank 0's order)
    modules: dict[int, str]  # MoE layer -> its module
    experts: dict[tuple[int, int], ZeroFile] = field(default_factory=dict)
    paths: list[Path] = field(default_factory=list)  # the expert files, then any expp_rank file
    copies: dict[str, ZeroFile] = field(default_factory=dict)  # what a reshard writes again: the expert files by name

    def tensors(self, read: Mapping[str, TensorEntry]) -> dict[str, TensorEntry]:
        """Each expert's module weights as saved (training dtype) as `module.<global name>`; an expert weight no param group
        holds (a frozen expert) is the weight itself."""
        out = {}
        for (_, _), f in sorted(self.experts.items()):
            for key, ref in f.tree.items():
                if not isinstance(ref, TensorRef):
                    continue
                pieces = [Piece(Box((0,) * len(ref.shape), ref.shape), f.array(ref))]
                name = f"module.{key}"
                out[name] = TensorEntry(name, ref.dtype, ref.shape, "other", pieces, ("module", key))
                if key not in read:
                    out[key] = TensorEntry(key, ref.dtype, ref.shape, "model", pieces)
        return out

    def details(self, world: int) -> dict[str, Any]:
        return expert_details(self.layout, self.num_experts, world)


def expert_details(layout: zl.ExpertLayout, num_experts: list[int], world: int) -> dict[str, Any]:
    """Per MoE layer (`module:value`, one value when all agree): experts, expert-parallel and expert-data-parallel size."""
    modules = [layout.layers[layer] if layer < len(layout.layers) else f"layer_{layer}" for layer in range(len(num_experts))]
    ep = [n // layout.num_local[m] if m in layout.num_local else 1 for m, n in zip(modules, num_experts)]

    def per_layer(values: list[int]) -> int | str:
        return values[0] if len(set(values)) == 1 else " ".join(f"{m}:{v}" for m, v in zip(modules, values))

    return {
        "moe_layers": len(num_experts),
        "num_experts": " ".join(f"{m}:{n}" for m, n in zip(modules, num_experts)),
        "expert_parallel_size": per_layer(ep),
        "expert_data_parallel_size": per_layer([world // e for e in ep]),
        "expert_topology": "D+E (use_data_before_expert_parallelism)" if layout.data_before_expert else "E+D",
    }


def refuse_unsupported(folder: Path, model: Mapping[str, Any]) -> None:
    names = sorted(p.name for p in folder.iterdir())
    if model.get("ds_autoep_layers"):
        raise UsageError(
            f"{folder}: DeepSpeed AutoEP checkpoint (ds_autoep_layers) is not supported by ckpt; native deepspeed.moe.layer.MoE only"
        )
    old = next((n for n in names if OLD_EXPERT_FILE.match(n)), None)
    if old or not isinstance(model.get("num_experts"), list):
        where = folder / (old or "mp_rank_00_model_states.pt")
        raise UsageError(f"{where}: DeepSpeed MoE checkpoint of the old layout (no layer ids) is not supported by ckpt")
    mp = {m.group(3) for n in names if (m := EXPERT_FILE.match(n))}
    if len(mp) > 1:
        raise UsageError(f"{folder}: expert files of several tensor-parallel ranks; ckpt handles data and expert parallelism only")


def group_keys(groups: list[Mapping[str, Any]]) -> list[tuple[str, int]]:
    """Each param group's identity across ranks: its hyper-parameters and name, and how many groups before it share them.
    Ranks may list their MoE groups in different orders (split_params_into_different_moe_groups_for_optimizer iterates a set
    of group names, ordered by each process's string hashing); groups with the same key keep their relative order."""
    seen: Counter[str] = Counter()
    out = []
    for group in groups:
        key = repr(sorted((str(k), repr(v)) for k, v in group.items() if k != "params"))
        out.append((key, seen[key]))
        seen[key] += 1
    return out


def load_expert_files(folder: Path, num_experts: list[int], load: Callable[[Path], Any]) -> dict[tuple[int, int], Any]:
    """Every expert file (each loaded through `load`: a RankFile, with its path) by (MoE layer, global expert), in order;
    DataError naming the first one missing."""
    found = {(int(m.group(1)), int(m.group(2))): p for p in folder.iterdir() if (m := EXPERT_FILE.match(p.name))}
    missing = [(layer, e) for layer, n in enumerate(num_experts) for e in range(n) if (layer, e) not in found]
    if missing:
        layer, e = missing[0]
        raise DataError(
            f"{folder}: expert file layer_{layer}_expert_{e}_mp_rank_00_model_states.pt is missing ({len(missing)} of "
            f"{sum(num_experts)} missing); DeepSpeed's load_checkpoint opens every one"
        )
    return {key: load(p) for key, p in sorted(found.items())}


def read_experts(
    folder: Path,
    model: ZeroFile,
    optims: Mapping[int, ZeroFile],
    world: int,
    stage: int | None,
    load: Callable[[Path], ZeroFile],
) -> MoEFiles:
    """The expert layout from the optimizer files' param groups and the expert files (each loaded through `load`)."""
    tree = model.tree
    if stage == 3:
        raise UsageError(f"{folder}: DeepSpeed MoE at ZeRO stage 3 is not supported by ckpt (DeepSpeed refuses native MoE at stage 3)")
    osds = {r: o.tree["optimizer_state_dict"] for r, o in optims.items()}
    groups = {r: osd["base_optimizer_state"].get("param_groups", []) for r, osd in osds.items()}
    reference = group_keys(groups[0])
    order = {}
    for r in sorted(groups):
        position = {k: i for i, k in enumerate(group_keys(groups[r]))}
        if sorted(position) != sorted(reference):
            raise DataError(f"{folder}: the optimizer files of ranks 0 and {r} hold different param groups")
        order[r] = [position[k] for k in reference]
    ep_sizes, expert_groups = [], []
    for g, group in enumerate(groups[0]):
        m = zl.EXPERT_GROUP.match(str(group.get("name"))) if group.get("moe") else None
        ep_sizes.append(int(m.group(1)) if m else 1)
        if group.get("moe"):
            if not m:
                raise DataError(f"{folder}: MoE param group {g} is named {group.get('name')!r}, not ep_size_N")
            expert_groups.append(g)
        for r in sorted(osds):
            count = osds[r]["partition_count"]
            count = count[order[r][g]] if isinstance(count, list) else count
            if world % ep_sizes[g] or count != world // ep_sizes[g]:
                raise DataError(
                    f"{folder}: param group {group.get('name')!r} of rank {r} is partitioned {count} ways, but {world} ranks at "
                    f"expert-parallel size {ep_sizes[g]} make {world // ep_sizes[g]}"
                )
    num_experts = [int(n) for n in tree["num_experts"]]
    experts = load_expert_files(folder, num_experts, load)
    module_group = {module: g for g, shapes in enumerate(tree.get("param_shapes") or []) for n in shapes if (module := zl.expert_module(n))}
    num_local: dict[str, int] = {}
    modules: dict[int, str] = {}
    for (layer, _), f in experts.items():
        for key in f.tree:
            module = zl.expert_module(str(key))
            if module is None:
                continue
            if modules.setdefault(layer, module) != module:
                raise DataError(f"{folder}: the expert files of MoE layer {layer} hold experts of {modules[layer]} and {module}")
            ep = ep_sizes[module_group[module]] if module in module_group else 1
            if layer >= len(num_experts) or num_experts[layer] % ep:
                raise DataError(
                    f"{folder}: MoE layer {layer} ({module}) has {num_experts[layer : layer + 1]} experts at expert-parallel size {ep}"
                )
            num_local[module] = num_experts[layer] // ep
    config = tree.get("ds_config") or {}
    layers = tuple(modules[layer] for layer in sorted(modules))
    layout = zl.ExpertLayout(tuple(ep_sizes), num_local, bool(config.get("use_data_before_expert_parallelism")), layers)
    expp = sorted(p for p in folder.iterdir() if EXPP_OPTIM.match(p.name))
    paths = [f.path for f in experts.values()]
    return MoEFiles(layout, order, num_experts, expert_groups, modules, experts, paths + expp, {f.path.name: f for f in experts.values()})


def partition_problems(layout: Stage12Partitions) -> list[str]:
    """Where a rank's saved partition of a group disagrees with its place in the expert layout: the group padding, the saved
    length and the slice mappings each rank's file records must be those of its expert-data-parallel rank under the topology
    ds_config names (a process that built its expert groups earlier keeps them). Slice mappings are not compared under
    round_robin_gradients, where DeepSpeed records original-order offsets (docs/formats.md §2.6 step 8)."""
    assert layout.experts is not None
    problems: list[str] = []
    bf16_optimizer = layout.stage is None
    round_robin = layout.details()["round_robin_gradients"]
    for g in range(len(layout.shapes)):
        slots = layout.offsets(g)
        data = zl.flat_numel(slots)
        for holders, _ in layout.replicas(g):
            size = zl.partition_size(data, len(holders))
            for d, r in enumerate(holders):
                osd, k = layout.osd[r], layout.index(r, g)
                pad = zl.group_padding(data, len(holders), d, bf16_optimizer)
                saved = osd["single_partition_of_fp32_groups"][k].shape[0]
                mappings = None if round_robin else osd.get("param_slice_mappings")
                recorded = (
                    [(str(n), a.__dict__.get("numel"), a.__dict__.get("start")) for n, a in mappings[k].items()] if mappings else None
                )
                if (
                    osd["group_paddings"][k] != pad
                    or saved != zl.saved_partition_numel(size, pad, bf16_optimizer)
                    or (recorded is not None and recorded != zl.slice_mappings(slots, d * size, size))
                ):
                    where = getattr(layout.optims[r], "path", f"rank {r}")
                    topology = "D+E" if layout.experts.data_before_expert else "E+D"
                    problems.append(
                        f"{where}: its partition of param group {g} is not partition {d} of {len(holders)} that the expert layout "
                        f"gives rank {r} (topology {topology} from ds_config)"
                    )
    return problems
