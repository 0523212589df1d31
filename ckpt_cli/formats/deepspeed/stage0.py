"""DeepSpeed MoE without ZeRO (stage 0, fp32): the torch optimizer's state of each expert-parallel rank, by index.

engine.py `_save_moe_checkpoint` at stage 0 writes, beside the expert files and the model states (the module without
experts; `optimizer`: rank 0's state, which an MoE load ignores), one `expp_rank_{e}_mp_rank_00_optim_states.pt` per
expert-parallel rank e of the largest expert group: `{'optimizer': optimizer.state_dict()}`, its `state` keyed by parameter
index in param-group order, without parameter names; `load_checkpoint` gives each rank the file of its expert-parallel rank.
No file depends on the data-parallel size. The names are recovered by dealing the module's parameters, in order, into the
param groups so that each group receives them in order with the shapes of their saved moments (`deal_in_order`); a deal that
is not unique leaves the optimizer state unread, with a note, never guessed. Rules: docs/formats.md §2.12.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core.model import TensorEntry
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.deepspeed import layout as zl
from ckpt_cli.formats.deepspeed.moe import EXPP_OPTIM, load_expert_files
from ckpt_cli.formats.deepspeed.partitions import ZeroFile

Shape = tuple[int, ...]


class _GiveUp(Exception):
    pass


def deal_in_order(
    params: Sequence[tuple[str, Shape]], groups: Sequence[Sequence[Shape | None]], budget: int = 200_000
) -> list[list[str]] | None:
    """The one way to deal `params` (in order; each into one group, or into none while there are more params than places:
    frozen ones) so that every group receives its params in order with the listed shapes (None: any shape, a param that
    holds no state yet). None when there is no such deal, more than one, or the search passes `budget` steps."""
    sizes = [len(g) for g in groups]
    spare = len(params) - sum(sizes)
    if spare < 0:
        return None
    memo: dict[tuple[int, tuple[int, ...]], int] = {}
    steps = [0]

    def options(i: int, at: tuple[int, ...]) -> list[int]:
        shape = params[i][1]
        out = [j for j, g in enumerate(groups) if at[j] < sizes[j] and ((slot := g[at[j]]) is None or tuple(slot) == shape)]
        return out + [-1] if i - sum(at) < spare else out

    def advance(at: tuple[int, ...], j: int) -> tuple[int, ...]:
        return at if j < 0 else (*at[:j], at[j] + 1, *at[j + 1 :])

    def count(i: int, at: tuple[int, ...], depth: int) -> int:
        """Deals from param i with the groups filled up to `at`, capped at 2 (forced moves walked without recursion)."""
        while True:
            steps[0] += 1
            if steps[0] > budget or depth > 400:
                raise _GiveUp
            if i == len(params):
                return 1
            choices = options(i, at)
            if len(choices) != 1:
                break
            i, at = i + 1, advance(at, choices[0])
        if (i, at) not in memo:
            total = 0
            for j in choices:
                total += count(i + 1, advance(at, j), depth + 1)
                if total > 1:
                    break
            memo[i, at] = min(total, 2)
        return memo[i, at]

    start = (0,) * len(groups)
    try:
        if count(0, start, 0) != 1:
            return None
        dealt: list[list[str]] = [[] for _ in groups]
        i, at = 0, start
        while i < len(params):
            choices = options(i, at)
            j = choices[0] if len(choices) == 1 else next(j for j in choices if count(i + 1, advance(at, j), 0) == 1)
            if j >= 0:
                dealt[j].append(params[i][0])
            i, at = i + 1, advance(at, j)
        return dealt
    except _GiveUp:
        return None


@dataclass
class Stage0Source:
    """What the DeepSpeed writer needs of a read stage-0 MoE checkpoint (deepspeed/writer.py hands it to `plan`)."""

    folder: Path
    world: int
    files: Stage0Files
    dtypes: bytes  # dtypes.dtype_digest of the tensors read

    @property
    def model(self) -> Any:
        """The model-states file (engine keys, buffer names, client state), as a ZeRO source's."""
        return self.files.model


@dataclass
class Stage0Files:
    """A stage-0 MoE tag folder as read: the model states, the expert files by (layer, global expert), the optimizer
    file of each expert-parallel rank, and the optimizer's param names when they could be told (else None)."""

    model: Any  # each a RankFile (deepspeed.py): a ZeroFile with its path
    experts: dict[tuple[int, int], Any]
    expp: dict[int, Any]
    layout: zl.ExpertLayout  # the groups of expert-parallel rank 0's file
    shapes: list[OrderedDict[str, Shape]] | None  # each param group's params (local names) in order; None: not told
    paths: list[Path] = field(default_factory=list)

    @property
    def ep(self) -> int:
        return len(self.expp)

    @property
    def groups(self) -> list[Mapping[str, Any]]:
        return self.expp[0].tree["optimizer"]["param_groups"]


def optimizer_of(f: ZeroFile, path: Path) -> Mapping[str, Any]:
    opt = f.tree.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        raise UsageError(
            f"{path}: not a torch optimizer's state_dict (a bf16/fp16 optimizer wrapper at stage 0?); ckpt reads DeepSpeed MoE "
            "without ZeRO in fp32"
        )
    return opt


def read_files(folder: Path, model: Any, load: Callable[[Path], Any]) -> Stage0Files:
    tree = model.tree
    expp_paths = {int(m.group(1)): p for p in folder.iterdir() if (m := EXPP_OPTIM.match(p.name))}
    first = load(expp_paths[min(expp_paths)])
    groups = optimizer_of(first, expp_paths[min(expp_paths)])["param_groups"]
    names = {str(g.get("name")) for g in groups if g.get("moe")}
    sizes = [int(m.group(1)) for n in names if (m := zl.EXPERT_GROUP.match(n))]
    if len(sizes) != 1 or len(names) != 1:
        raise UsageError(
            f"{expp_paths[min(expp_paths)]}: MoE param groups {sorted(names)}; ckpt reads DeepSpeed MoE without ZeRO when every "
            "MoE layer has the same expert-parallel size (one ep_size_N group name)"
        )
    ep = sizes[0]
    for e in range(max(ep, max(expp_paths) + 1)):
        if e not in expp_paths:
            raise DataError(f"{folder}: expp_rank_{e}_mp_rank_00_optim_states.pt is missing (expert-parallel size {ep})")
        if e >= ep:
            raise DataError(f"{expp_paths[e]}: an optimizer file of expert-parallel rank {e} at expert-parallel size {ep}")
    expp = {e: first if p == first.path else load(p) for e, p in sorted(expp_paths.items())}
    for e, f in expp.items():
        optimizer_of(f, expp_paths[e])
    num_experts = [int(n) for n in tree["num_experts"]]
    experts = load_expert_files(folder, num_experts, load)
    modules: dict[int, str] = {}
    for (layer, _), f in experts.items():
        for key in f.tree:
            module = zl.expert_module(str(key))
            if module is None or modules.setdefault(layer, module) != module:
                raise DataError(f"{f.path}: holds {key}, not an expert of MoE layer {layer}")
    if any(n % ep for n in num_experts):
        raise DataError(f"{folder}: MoE layers of {num_experts} experts at expert-parallel size {ep}")
    layers = tuple(modules[layer] for layer in sorted(modules))
    num_local = {modules[layer]: n // ep for layer, n in enumerate(num_experts)}
    config = tree.get("ds_config") or {}
    ep_sizes = tuple(ep if g.get("moe") else 1 for g in groups)
    layout = zl.ExpertLayout(ep_sizes, num_local, bool(config.get("use_data_before_expert_parallelism")), layers)
    paths = [f.path for f in experts.values()] + [p for _, p in sorted(expp_paths.items())]
    out = Stage0Files(model, experts, expp, layout, None, paths)
    out.shapes = _named_groups(out, num_experts)
    return out


def problems(files: Stage0Files) -> list[str]:
    """Where an expert-parallel rank's optimizer file disagrees with rank 0's on its param groups (names, hyper-parameters
    aside, and how many params each holds): torch's load_state_dict refuses such a file at load."""
    out = []

    def shape_of(f: Any) -> list[tuple[str, int]]:
        return [(str(g.get("name")), len(g.get("params", []))) for g in f.tree["optimizer"]["param_groups"]]

    first = shape_of(files.expp[0])
    for f in files.expp.values():
        if shape_of(f) != first:
            out.append(f"{f.path}: its param groups {shape_of(f)} are not those of expert-parallel rank 0 ({first})")
        indices = {i for g in f.tree["optimizer"]["param_groups"] for i in g.get("params", [])}
        stray = sorted(set(f.tree["optimizer"]["state"]) - indices, key=str)
        if stray:
            out.append(f"{f.path}: optimizer state for parameter {stray[0]}, which no param group holds")
    return out


def _state_shapes(opt: Mapping[str, Any], group: Mapping[str, Any]) -> list[Shape | None]:
    """The shape of each param of a group as its saved moments tell (None: no state, or no moment)."""
    out: list[Shape | None] = []
    for index in group.get("params", []):
        state = opt["state"].get(index) or {}
        moment = next((v for k, v in state.items() if isinstance(v, TensorRef) and v.shape and k != "step"), None)
        out.append(tuple(moment.shape) if moment is not None else None)
    return out


def _named_groups(files: Stage0Files, num_experts: list[int]) -> list[OrderedDict[str, Shape]] | None:
    """Each param group of expert-parallel rank 0's file as names and shapes, when the deal is unique: the module's
    parameters (model states, less buffers) into the dense groups, and rank 0's local experts (one expert file's params,
    per MoE layer in order) into the MoE groups."""
    tree = files.model.tree
    buffers = set(tree.get("buffer_names") or [])
    dense = [(str(k), tuple(v.shape)) for k, v in (tree.get("module") or {}).items() if isinstance(v, TensorRef) and k not in buffers]
    local = []
    for layer in range(len(files.layout.layers)):
        first = files.experts[layer, 0].tree
        for expert in range(num_experts[layer] // files.ep):
            for key, ref in first.items():
                if isinstance(ref, TensorRef):
                    local.append((re.sub(r"(\.deepspeed_experts\.)0(\.)", rf"\g<1>{expert}\2", str(key), count=1), tuple(ref.shape)))
    opt = files.expp[0].tree["optimizer"]
    groups = opt["param_groups"]
    dense_at = [g for g, group in enumerate(groups) if not group.get("moe")]
    moe_at = [g for g, group in enumerate(groups) if group.get("moe")]
    dealt_dense = deal_in_order(dense, [_state_shapes(opt, groups[g]) for g in dense_at])
    dealt_moe = deal_in_order(local, [_state_shapes(opt, groups[g]) for g in moe_at])
    if dealt_dense is None or dealt_moe is None or len(local) != sum(len(groups[g].get("params", [])) for g in moe_at):
        return None
    shape_of = dict(dense) | dict(local)
    out: list[OrderedDict[str, Shape]] = [OrderedDict() for _ in groups]
    for at, dealt in ((dense_at, dealt_dense), (moe_at, dealt_moe)):
        for g, names in zip(at, dealt):
            out[g] = OrderedDict((n, shape_of[n]) for n in names)
    return out


def tensors(files: Stage0Files) -> dict[str, TensorEntry]:
    """The weights (model states' module, the expert files' experts under global names) and, when the names were told,
    each param's optimizer state `optimizer.state.<name>.<key>` (dense params from rank 0's file, experts from their own)."""
    out: dict[str, TensorEntry] = {}
    trees = [(files.model, files.model.tree.get("module") or {}), *((f, f.tree) for f in files.experts.values())]
    for f, tree in trees:
        for key, ref in tree.items():
            if isinstance(ref, TensorRef):
                out[str(key)] = TensorEntry(str(key), ref.dtype, ref.shape, "model", f.whole(ref))
    if files.shapes is None:
        return out
    for e, f in files.expp.items():
        opt = f.tree["optimizer"]
        for g, group in enumerate(opt["param_groups"]):
            if not group.get("moe") and e:
                continue  # dense params: the same on every rank (gradients all-reduced), read from rank 0's file
            for index, local in zip(group.get("params", []), files.shapes[g]):
                name = files.layout.name(local, e)
                for key, ref in (opt["state"].get(index) or {}).items():
                    if isinstance(ref, TensorRef):
                        path = ("optimizer", "state", name, str(key))
                        out[path_name(path)] = TensorEntry(path_name(path), ref.dtype, ref.shape, "optimizer", f.whole(ref), path)
    return out


def param_groups(files: Stage0Files) -> list[dict[str, Any]]:
    """The param groups with parameter names (every expert-parallel rank's experts in an MoE group); indices when not told."""
    out = []
    for g, group in enumerate(files.groups):
        if files.shapes is None:
            params: list[Any] = list(group.get("params", []))
        else:
            ranks = range(files.ep) if group.get("moe") else range(1)
            params = [files.layout.name(n, e) for e in ranks for n in files.shapes[g]]
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return out
