"""Moving a run between DeepSpeed and FSDP2: the training state in one framework-neutral form.

A `TrainingState` names everything by the model's parameter FQN: the weights, the optimizer state
of each parameter (`exp_avg`, `exp_avg_sq`, `step`), the param groups (hyper-parameters and the
FQNs they hold), the step, and the rest (LR scheduler, dataloader, RNG, client state) by its
top-level key. Readers' checkpoints come in through `from_checkpoint` (DeepSpeed, or DCP in either
key layout users meet); `to_dcp` lays it out the way FSDP2 + `get_state_dict` or torchtitan saves
it, and the DeepSpeed writer builds ZeRO files from it (formats/deepspeed_template.py).
Tensor data is never read: entries keep pointing at the source's stored bytes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ckpt_cli.core import roles
from ckpt_cli.core.model import Checkpoint, ObjectEntry, PathKey, TensorEntry
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError, UsageError

# The key layouts of a DCP training checkpoint: torch's get_state_dict nests the model under "model"
# and the optimizer under "optim"; torchtitan keeps model keys at the top level and the optimizer,
# flattened per parameter (state_dict.py `_flatten_optim_state_dict`), under "optimizer".
LAYOUTS = ("get_state_dict", "torchtitan")
# Module wrappers that put a segment into parameter names but are not part of the model:
# torch.compile, activation checkpointing, FSDP1. get_state_dict drops them the same way.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
PER_RANK_RULES = ("wrap", "first", "drop")
_RANK_KEY = re.compile(r"^((?:.*[_.-])?(?:dp_)?rank_?)(\d+)$")  # rank_3, dp_rank_3, rng_rank3
# Rank keys of other parallel dimensions or none at all: never re-keyed by the data-parallel world size.
_NOT_DP_RANK = re.compile(r"(?:^|[_.-])(?:tp|pp|mp|ep|sp|cp|expert|lora|low)_?rank_?$")
# Top-level keys of a torchtitan save that are not model weights.
_TITAN_STATE = {"optimizer", "lr_scheduler", "lr_schedulers", "dataloader", "train_state", "rng", "step"}
# DeepSpeed engine bookkeeping with no meaning outside DeepSpeed (recomputed when writing DeepSpeed).
_DS_ENGINE_ONLY = ("skipped_steps", "global_samples", "data_sampler", "random_ltd", "dp_world_size", "mp_world_size")


@dataclass(frozen=True)
class NameMap:
    """How parameter names change on the way: wrapper segments dropped, regex renames applied in order,
    and tied weights (alias -> owner) that the source does not record."""

    strip_segments: tuple[str, ...] = WRAPPER_SEGMENTS
    renames: tuple[tuple[str, str], ...] = ()
    tied: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_yaml(cls, path: Path) -> NameMap:
        """`strip_segments: [...]`, `rename: [{from: REGEX, to: REPL}, ...]`, `tied: {alias: owner}`."""
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise UsageError(f"{path}: cannot read the name map ({exc.strerror})") from exc
        except yaml.YAMLError as exc:
            raise UsageError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
        if not isinstance(data, dict) or set(data) - {"strip_segments", "rename", "tied"}:
            raise UsageError(f"{path}: a name map holds strip_segments, rename and tied only")
        renames = []
        for item in data.get("rename") or []:
            if not isinstance(item, dict) or set(item) != {"from", "to"}:
                raise UsageError(f"{path}: each rename is {{from: REGEX, to: REPLACEMENT}}")
            renames.append((str(item["from"]), str(item["to"])))
        segments = data.get("strip_segments", WRAPPER_SEGMENTS) or ()
        if isinstance(segments, str) or not all(isinstance(x, str) for x in segments):
            raise UsageError(f"{path}: strip_segments is a list of names")
        tied = data.get("tied") or {}
        if not isinstance(tied, dict):
            raise UsageError(f"{path}: tied maps alias names to owner names")
        return cls(
            tuple(segments),
            tuple(renames),
            tuple((str(a), str(o)) for a, o in tied.items()),
        ).checked(str(path))

    def with_renames(self, pairs: list[str]) -> NameMap:
        """Add `--rename REGEX=REPLACEMENT` options."""
        extra = []
        for pair in pairs:
            pattern, sep, repl = pair.partition("=")
            if not sep or not pattern:
                raise UsageError(f"--rename takes REGEX=REPLACEMENT, got '{pair}'")
            extra.append((pattern, repl))
        return dataclasses.replace(self, renames=self.renames + tuple(extra)).checked("--rename")

    def checked(self, where: str) -> NameMap:
        for pattern, _ in self.renames:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UsageError(f"{where}: bad regular expression '{pattern}' ({exc})") from exc
        return self

    def apply(self, name: str) -> str:
        parts = [p for p in name.split(".") if p not in self.strip_segments]
        out = ".".join(parts)
        for pattern, repl in self.renames:
            try:
                out = re.sub(pattern, repl, out)
            except re.error as exc:
                raise UsageError(f"rename /{pattern}/ -> '{repl}': {exc}") from exc
        return out

    def describe(self) -> str:
        rules = [f"drop segments {', '.join(self.strip_segments)}" if self.strip_segments else "keep every segment"]
        rules += [f"rename /{p}/ -> '{r}'" for p, r in self.renames]
        rules += [f"tie {a} -> {o}" for a, o in self.tied]
        return "; ".join(rules)


@dataclass
class TrainingState:
    """A run's state by parameter FQN, independent of how a framework lays it out."""

    weights: dict[str, TensorEntry]  # model state dict: params, frozen params, buffers, tied aliases
    moments: dict[str, dict[str, TensorEntry]]  # FQN -> optimizer state (exp_avg, exp_avg_sq, step)
    groups: list[dict[str, Any]]  # hyper-parameters and "params": [FQN]
    step: int | None
    extra_objects: list[ObjectEntry] = field(default_factory=list)  # by their top-level key
    extra_tensors: list[TensorEntry] = field(default_factory=list)  # (an RNG state saved as a tensor)
    buffers: set[str] = field(default_factory=set)  # weights that are not parameters (replicated by FSDP2)
    tied: dict[str, str] = field(default_factory=dict)  # alias -> owner
    world_size: int = 1
    notes: list[str] = field(default_factory=list)
    containers: dict[PathKey, str] = field(default_factory=dict)  # which extras' paths were lists or tuples

    def trainable(self) -> list[str]:
        return [p for g in self.groups for p in g["params"] if p in self.moments]


def detect_layout(ckpt: Checkpoint) -> str:
    """'deepspeed', 'get_state_dict', 'torchtitan' or 'flat' (a state dict with no optimizer)."""
    if ckpt.format == "deepspeed":
        return "deepspeed"
    return roles.key_layout([e.path for e in [*ckpt.tensors.values(), *ckpt.objects.values()]])


def from_checkpoint(ckpt: Checkpoint, names: NameMap, need_optimizer: bool = True) -> TrainingState:
    layout = detect_layout(ckpt)
    tops = {str(e.path[0]) for e in [*ckpt.tensors.values(), *ckpt.objects.values()] if e.path}
    optim_key = roles.optimizer_key(tops) or "optimizer"  # {"model": ..., "optimizer": ...} is common too
    if layout == "deepspeed":
        state = _from_deepspeed(ckpt)
    elif layout == "get_state_dict":
        state = _from_nested(ckpt, "model", optim_key)
    elif layout == "torchtitan":
        state = _from_nested(ckpt, None, "optimizer")
    elif not need_optimizer:
        state = TrainingState({n: t for n, t in ckpt.tensors.items() if t.role == "model"}, {}, [], ckpt.step)
    else:
        raise UsageError(
            f"{ckpt.path}: no optimizer state under 'optim' (get_state_dict) or 'optimizer' (torchtitan): "
            "there is no training state to carry"
        )
    state.containers = dict(ckpt.containers)
    if not state.moments and need_optimizer:
        raise UsageError(f"{ckpt.path}: the optimizer holds no per-parameter state (saved before the first step?)")
    if all(fqn.isdigit() for fqn in state.moments) or any(not isinstance(p, str) for g in state.groups for p in g["params"]):
        raise UsageError(
            f"{ckpt.path}: the optimizer state is keyed by parameter index (optimizer.state_dict()), not by name; "
            "save it with torch.distributed.checkpoint.state_dict.get_state_dict to carry it across frameworks"
        )
    state.world_size = ckpt.world_size or 1
    state.notes.append(f"source key layout: {layout}")
    return _renamed(state, names)


def _renamed(state: TrainingState, names: NameMap) -> TrainingState:
    rename = names.apply
    weights: dict[str, TensorEntry] = {}
    for fqn, entry in state.weights.items():
        new = rename(fqn)
        if new in weights:
            raise UsageError(f"two weights are both named '{new}' after renaming; adjust --rename/--name-map")
        weights[new] = entry
    changed = [(a, rename(a)) for a in state.weights if rename(a) != a]
    example = f" (e.g. {changed[0][0]} -> {changed[0][1]})" if changed else ""
    state.notes.append(f"names: {names.describe()}: {len(changed)} renamed{example}")
    state.weights = weights
    state.moments = {rename(k): v for k, v in state.moments.items()}
    state.groups = [{**g, "params": [rename(p) for p in g["params"]]} for g in state.groups]
    state.buffers = {rename(b) for b in state.buffers}
    state.tied = {rename(a): rename(o) for a, o in state.tied.items()} | dict(names.tied)
    for alias, owner in state.tied.items():
        if alias not in state.weights or owner not in state.weights:
            raise UsageError(f"tied weight {alias} -> {owner}: {'alias' if alias not in state.weights else 'owner'} not in the checkpoint")
    for fqn in [*state.moments, *(p for g in state.groups for p in g["params"])]:
        if fqn not in state.weights:
            raise DataError(
                f"the optimizer names '{fqn}', which is not among the model weights "
                "(saved with get_state_dict(..., ignore_frozen_params=True)? or renamed differently)"
            )
    return state


def _split_extras(ckpt: Checkpoint, skip: set[str], weights: dict[str, TensorEntry]) -> tuple[list[ObjectEntry], list[TensorEntry]]:
    """Everything that is neither model weight nor optimizer state, kept by its top-level key."""
    taken = {id(e) for e in weights.values()}
    objects = [o for o in ckpt.objects.values() if str(o.path[0]) not in skip]
    tensors = [t for t in ckpt.tensors.values() if str(t.path[0]) not in skip and id(t) not in taken]
    return objects, tensors


def _from_deepspeed(ckpt: Checkpoint) -> TrainingState:
    weights = {n: t for n, t in ckpt.tensors.items() if t.role == "model"}
    moments: dict[str, dict[str, TensorEntry]] = {}
    for entry in ckpt.tensors.values():
        if entry.role == "optimizer" and entry.path[:2] == ("optimizer", "state"):
            moments.setdefault(str(entry.path[2]), {})[str(entry.path[3])] = entry
    groups_obj = ckpt.objects.get("optimizer.param_groups")
    groups = [dict(g) for g in groups_obj.value] if groups_obj else []
    model_tree = ckpt.source.model.tree if ckpt.source is not None else {}
    dropped = [k for k in _DS_ENGINE_ONLY if model_tree.get(k) is not None]
    objects = [
        o
        for o in ckpt.objects.values()
        if o.name != "optimizer.param_groups" and str(o.path[0]) not in _DS_ENGINE_ONLY and str(o.path[0]) != "global_steps"
    ]
    client_tensors = [t for t in ckpt.tensors.values() if t.role == "other" and t.path[0] != "module"]
    state = TrainingState(
        weights,
        moments,
        groups,
        ckpt.step,
        objects,
        client_tensors,
        buffers=set(model_tree.get("buffer_names") or []),
        tied=dict(model_tree.get("shared_params") or {}),
    )
    if dropped:
        state.notes.append(f"left out DeepSpeed engine bookkeeping: {', '.join(dropped)}")
    state.notes.append("left out the module's training-dtype copies of the weights (module.*); the fp32 master weights are carried")
    return state


def _from_nested(ckpt: Checkpoint, model_key: str | None, optim_key: str) -> TrainingState:
    weights: dict[str, TensorEntry] = {}
    moments: dict[str, dict[str, TensorEntry]] = {}
    for entry in ckpt.tensors.values():
        top = str(entry.path[0])
        if top == optim_key:
            fqn, key = _state_key(entry.path[1:], ckpt.path)
            moments.setdefault(fqn, {})[key] = entry
        elif model_key is not None and top == model_key:
            weights[path_name(entry.path[1:])] = entry
        elif model_key is None and entry.role == "model" and top not in _TITAN_STATE:
            weights[entry.name] = entry
    groups = _param_groups([o for o in ckpt.objects.values() if str(o.path[0]) == optim_key], ckpt.path) if moments else []
    skip = {optim_key, *([model_key] if model_key else [])}
    objects, tensors = _split_extras(ckpt, skip, weights)
    step = None
    step_paths = (("step",), ("train_state", "step"))
    for obj in objects:
        if obj.path in step_paths and isinstance(obj.value, int) and not isinstance(obj.value, bool):
            step = obj.value
    for entry in tensors:
        if entry.path in step_paths and not entry.shape and not entry.dtype.is_float:  # torchtitan: a 0-d int tensor
            step = _read_scalar(entry)
    objects = [o for o in objects if o.path not in step_paths]
    tensors = [t for t in tensors if t.path not in step_paths or step is None]
    buffers = {n for n, e in weights.items() if ckpt.format == "dcp" and len(e.pieces) == 1 and (ckpt.world_size or 1) > 1}
    return TrainingState(weights, moments, groups, step, objects, tensors, buffers=buffers & _not_in_groups(weights, groups))


def find_ties(state: TrainingState) -> dict[str, str]:
    """Weights outside every param group whose bytes equal a trainable parameter's: tied aliases, which DCP does
    not record (an FSDP2 save holds the tied tensor under both names). Candidates of the same shape and dtype are
    compared on their first elements, and in full only when those agree, so unrelated weights cost a few KB."""
    import torch

    from ckpt_cli.core.executor import SourceFiles, element_windows, read_elements

    held = {p for g in state.groups for p in g["params"]}
    owners: dict[tuple[Any, ...], list[str]] = {}
    for p in state.trainable():
        owners.setdefault((state.weights[p].shape, state.weights[p].dtype), []).append(p)

    def same(a: TensorEntry, b: TensorEntry, sources: SourceFiles) -> bool:
        head = min(a.numel, 1024)
        if not torch.equal(read_elements(a, 0, head, sources).view(torch.uint8), read_elements(b, 0, head, sources).view(torch.uint8)):
            return False
        return all(
            torch.equal(read_elements(a, start, n, sources).view(torch.uint8), read_elements(b, start, n, sources).view(torch.uint8))
            for start, n in element_windows(a)
        )

    ties: dict[str, str] = {}
    sources = SourceFiles()
    try:
        for name, entry in state.weights.items():
            if name in held or name in state.tied or name in state.buffers or not entry.numel:
                continue
            owner = next((o for o in owners.get((entry.shape, entry.dtype), []) if same(entry, state.weights[o], sources)), None)
            if owner is not None:
                ties[name] = owner
    finally:
        sources.close()
    return ties


def _read_scalar(entry: TensorEntry) -> int:
    """The value of a 0-d integer tensor (a few bytes read from the source)."""
    from ckpt_cli.core.executor import SourceFiles, read_elements

    sources = SourceFiles()
    try:
        return int(read_elements(entry, 0, 1, sources)[0])
    finally:
        sources.close()


def _not_in_groups(weights: dict[str, TensorEntry], groups: list[dict[str, Any]]) -> set[str]:
    held = {p for g in groups for p in g["params"]}
    return {n for n in weights if n not in held}


def _state_key(path: PathKey, where: str) -> tuple[str, str]:
    """(FQN, state key) of an optimizer tensor: ('state', fqn, key) nested, or ('state.fqn.key',) flattened."""
    joined = path_name(path)
    if not joined.startswith("state."):
        raise DataError(f"{where}: optimizer tensor '{joined}' is not under 'state'")
    fqn, _, key = joined[len("state.") :].rpartition(".")
    return fqn, key


def _param_groups(objects: list[ObjectEntry], where: str) -> list[dict[str, Any]]:
    """Param groups from DCP leaves: ('param_groups', i, key) as get_state_dict saves them, or
    ('param_groups.FQN.key',) per parameter as flatten_optimizer_state_dict (torchtitan) does."""
    indexed: dict[int, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for obj in objects:
        rest = obj.path[1:]
        if len(rest) >= 3 and rest[0] == "param_groups" and isinstance(rest[1], int):
            indexed.setdefault(rest[1], {})[str(rest[2])] = obj.value
        elif rest == ("param_groups",) and isinstance(obj.value, list):
            for i, group in enumerate(obj.value):
                indexed[i] = dict(group)
        elif rest and path_name(rest).startswith("param_groups."):
            fqn, _, key = path_name(rest)[len("param_groups.") :].rpartition(".")
            per_param.setdefault(fqn, {})[key] = obj.value
    if indexed:
        return [indexed[i] for i in sorted(indexed)]
    groups: list[dict[str, Any]] = []
    for fqn, hyper in per_param.items():  # same hyper-parameters, same group (in order of first appearance)
        match = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper), None)
        if match is None:
            groups.append({**hyper, "params": [fqn]})
        else:
            match["params"].append(fqn)
    if not groups:
        raise DataError(f"{where}: the optimizer state has no param_groups")
    return groups


def by_parameter(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint's weights and optimizer state under neutral names (FQN, optimizer.state.FQN.KEY), so that two
    checkpoints of one run in different frameworks compare tensor by tensor."""
    state = from_checkpoint(ckpt, NameMap(), need_optimizer=False)
    tensors = {n: dataclasses.replace(e, name=n, path=(n,)) for n, e in state.weights.items()}
    for fqn, keys in state.moments.items():
        for key, entry in keys.items():
            path = ("optimizer", "state", fqn, key)
            tensors[path_name(path)] = dataclasses.replace(entry, name=path_name(path), path=path)
    return dataclasses.replace(ckpt, tensors=tensors)


# ---- writing DCP -------------------------------------------------------------------------------


Entry = TypeVar("Entry", ObjectEntry, TensorEntry)


def per_rank_entries(entries: list[Entry]) -> dict[tuple[PathKey, int], dict[int, Entry]]:
    """Values saved once per data-parallel rank, recognised by a `rank_R` / `dp_rank_R` / `..._rank_R` key
    whose ranks run 0, 1, ... without a gap: (path template, position) -> rank -> entry. `lora_rank_16`,
    `tp_rank_1` and the like are not data-parallel ranks."""
    found: dict[tuple[PathKey, int], dict[int, Entry]] = {}
    for entry in entries:
        for i, part in enumerate(entry.path):
            m = _RANK_KEY.match(str(part))
            if m and not _NOT_DP_RANK.search(m.group(1)):
                width = len(m.group(2)) if m.group(2).startswith("0") and len(m.group(2)) > 1 else 0
                slot = "{:0" + str(width) + "d}" if width else "{}"  # keeps zero padding: rank_01 -> rank_02
                template = (*entry.path[:i], m.group(1) + slot, *entry.path[i + 1 :])
                found.setdefault((template, i), {})[int(m.group(2))] = entry
                break
    return {key: ranks for key, ranks in found.items() if sorted(ranks) == list(range(len(ranks)))}


def _rekeyed(entry: Entry, path: PathKey) -> Entry:
    return dataclasses.replace(entry, name=path_name(path), path=path)  # a DCP value's saved bytes hold no key


def apply_per_rank_rule(entries: list[Entry], world: int, rule: str) -> tuple[list[Entry], str | None]:
    """Re-key per-rank values (objects or tensors, e.g. RNG states) for `world` ranks: 'wrap' (new rank r
    takes old rank r mod W), 'first' (every rank takes rank 0's) or 'drop'. Returns the new list and the
    rule as printed (None when nothing changes)."""
    groups = {key: ranks for key, ranks in per_rank_entries(entries).items() if not (rule == "wrap" and len(ranks) == world)}
    if not groups:
        return entries, None  # nothing per rank, or (wrap at the same world size) every rank keeps its own
    ids = {id(e) for ranks in groups.values() for e in ranks.values()}
    out = [e for e in entries if id(e) not in ids]
    for (template, pos), ranks in groups.items():
        if rule == "drop":
            continue
        for r in range(world):
            src = ranks[r % len(ranks) if rule == "wrap" else 0]
            if src is ranks.get(r):
                out.append(src)  # this rank keeps its own value (as saved)
                continue
            out.append(_rekeyed(src, (*template[:pos], str(template[pos]).format(r), *template[pos + 1 :])))
    olds = sorted({len(ranks) for ranks in groups.values()})
    old = "/".join(map(str, olds))
    names = sorted({re.sub(r"\{[^}]*\}", "{}", path_name(t)) for t, _ in groups})
    how = {
        "wrap": f"new rank r takes old rank r mod {old}",
        "first": "every new rank takes old rank 0's",
        "drop": "left out",
    }[rule]
    return out, f"per-rank state {', '.join(names)} ({old} ranks -> {world}): rule '{rule}': {how}"


def to_dcp(state: TrainingState, layout: str, world: int, rule: str) -> Checkpoint:
    """The Checkpoint the DCP writer lays out as FSDP2 on `world` ranks saves it, keyed like `layout`."""
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    containers: dict[PathKey, str] = {}

    def put_tensor(path: PathKey, entry: TensorEntry, role: str) -> None:
        name = path_name(path)
        tensors[name] = dataclasses.replace(entry, name=name, path=path, role=role)

    def put_object(path: PathKey, value: Any, role: str = "other") -> None:
        objects[path_name(path)] = ObjectEntry(path_name(path), value, role, path)

    titan = layout == "torchtitan"
    for fqn, entry in state.weights.items():
        put_tensor((fqn,) if titan else ("model", fqn), entry, "model")
    for fqn, keys in state.moments.items():
        for key, entry in keys.items():
            put_tensor(("optimizer", f"state.{fqn}.{key}") if titan else ("optim", "state", fqn, key), entry, "optimizer")
    if titan:
        for group in state.groups:
            for fqn in group["params"]:
                for key, value in group.items():
                    if key != "params":
                        put_object(("optimizer", f"param_groups.{fqn}.{key}"), value, "optimizer")
    else:
        put_object(("optim", "param_groups"), [dict(g) for g in state.groups], "optimizer")
        containers[("optim", "param_groups")] = "list"
    if state.step is not None:
        put_object(("train_state", "step") if titan else ("step",), state.step)
    extras, note = apply_per_rank_rule([*state.extra_objects, *state.extra_tensors], world, rule)
    for extra in extras:
        if isinstance(extra, ObjectEntry):
            objects[extra.name] = extra
        else:
            tensors[extra.name] = extra
    replicated = {path_name((fqn,) if titan else ("model", fqn)) for fqn in state.buffers}
    notes = list(state.notes)
    if note:
        notes.append(note)
    return Checkpoint(
        "training-state",
        "",
        tensors,
        objects,
        containers=containers,
        step=state.step,
        world_size=state.world_size,
        details={"replicated": replicated},
        notes=notes,
    )
