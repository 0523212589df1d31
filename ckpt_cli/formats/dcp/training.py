"""DCP training checkpoints: the key layouts FSDP2 runs save, read into and written from a TrainingState.

Two layouts are met in practice. torch's `get_state_dict` nests the model under `model` and the
optimizer under `optim` (`state`/`param_groups` nested); torchtitan keeps the model keys at the top
level and the optimizer, flattened per parameter (`_flatten_optim_state_dict` in
torch/distributed/checkpoint/state_dict.py), under `optimizer`, with the step in `train_state`.
Plain state dicts of other formats (a torch.save of get_state_dict's output) are read the same way.
See docs/formats.md §1.3 and §1.9.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckpt_cli.core import roles
from ckpt_cli.core.model import Checkpoint, ObjectEntry, PathKey, TensorEntry
from ckpt_cli.core.training import StateOptions, TrainingState, apply_per_rank_rule, scalar
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError, UsageError

LAYOUTS = ("get_state_dict", "torchtitan")
# Top-level keys of a torchtitan save that are not model weights.
_TITAN_STATE = {"optimizer", "lr_scheduler", "lr_schedulers", "dataloader", "train_state", "rng", "step"}


class DCPTraining:
    """The TrainingFormat of DCP (and of any state dict keyed like one)."""

    def layout_of(self, ckpt: Checkpoint) -> str:
        """'get_state_dict', 'torchtitan' or 'flat' (a state dict with no optimizer), from key paths alone."""
        return roles.key_layout([e.path for e in ckpt.entries()])

    def read_state(self, ckpt: Checkpoint, need_optimizer: bool) -> TrainingState:
        layout = self.layout_of(ckpt)
        tops = {str(e.path[0]) for e in ckpt.entries() if e.path}
        if layout == "get_state_dict":  # {"model": ..., "optimizer": ...} is common too
            return _from_nested(ckpt, "model", roles.optimizer_key(tops) or "optimizer")
        if layout == "torchtitan":
            return _from_nested(ckpt, None, "optimizer")
        if need_optimizer:
            raise UsageError(
                f"{ckpt.path}: no optimizer state under 'optim' (get_state_dict) or 'optimizer' (torchtitan): "
                "there is no training state to carry"
            )
        return TrainingState({n: t for n, t in ckpt.tensors.items() if t.role == "model"}, {}, [], ckpt.step)

    def changes_layout(self, ckpt: Checkpoint, options: StateOptions) -> bool:
        return options.layout is not None and self.layout_of(ckpt) != options.layout

    def write_state(self, state: TrainingState, options: StateOptions) -> Checkpoint:
        if options.zero_stage is not None or options.ds_config is not None:
            raise UsageError("--zero-stage and --ds-config apply to deepspeed targets")
        return to_dcp(state, options.layout or "get_state_dict", options.world_size, options.per_rank)


def _split_extras(ckpt: Checkpoint, skip: set[str], weights: dict[str, TensorEntry]) -> tuple[list[ObjectEntry], list[TensorEntry]]:
    """Everything that is neither model weight nor optimizer state, kept by its top-level key."""
    taken = {id(e) for e in weights.values()}
    objects = [o for o in ckpt.objects.values() if str(o.path[0]) not in skip]
    tensors = [t for t in ckpt.tensors.values() if str(t.path[0]) not in skip and id(t) not in taken]
    return objects, tensors


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
            step = int(scalar(entry))
    objects = [o for o in objects if o.path not in step_paths]
    tensors = [t for t in tensors if t.path not in step_paths or step is None]
    buffers = {n for n, e in weights.items() if ckpt.format == "dcp" and len(e.pieces) == 1 and (ckpt.world_size or 1) > 1}
    return TrainingState(weights, moments, groups, step, objects, tensors, buffers=buffers & _not_in_groups(weights, groups))


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
    saved: list[ObjectEntry | TensorEntry] = [*state.extra_objects, *state.extra_tensors]
    extras, note = apply_per_rank_rule(saved, world, rule)
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
        details={"replicated": replicated, "per_rank_applied": True},
        notes=notes,
    )


TRAINING = DCPTraining()
