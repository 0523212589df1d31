"""Moving a run between frameworks: which format reads the training state, and comparing runs by name.

Each training format (DeepSpeed, DCP) reads its checkpoints into a framework-neutral
`TrainingState` (core/training.py) and writes one as its own files; this module picks the reader,
applies the name map and refuses states that cannot travel by name.
"""

from __future__ import annotations

import dataclasses

from ckpt_cli.core.model import Checkpoint
from ckpt_cli.core.training import NameMap, TrainingFormat, TrainingState, renamed
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats import registry
from ckpt_cli.formats.dcp import training as dcp_training
from ckpt_cli.formats.runs import read as run_read


def training_format(ckpt: Checkpoint) -> TrainingFormat:
    """The format's own reader of training state; plain state dicts (torch files) are keyed like DCP saves."""
    known = registry.FORMATS.get(ckpt.format)
    return known.training if known is not None and known.training is not None else dcp_training.TRAINING


def from_checkpoint(ckpt: Checkpoint, names: NameMap, need_optimizer: bool = True) -> TrainingState:
    reader = training_format(ckpt)
    layout = reader.layout_of(ckpt)
    state = reader.read_state(ckpt, need_optimizer)
    state.containers = dict(ckpt.containers)
    state.layout = layout
    if not state.moments and need_optimizer:
        raise UsageError(f"{ckpt.path}: the optimizer holds no per-parameter state (saved before the first step?)")
    by_index = bool(state.moments) and all(fqn.isdigit() for fqn in state.moments)
    if by_index or any(not isinstance(p, str) for g in state.groups for p in g["params"]):
        raise UsageError(
            f"{ckpt.path}: the optimizer state is keyed by parameter index (optimizer.state_dict()), not by name; "
            "save it with torch.distributed.checkpoint.state_dict.get_state_dict to carry it across frameworks"
        )
    state.world_size = ckpt.world_size or 1
    state.notes.append(f"source key layout: {layout}")
    return renamed(state, names)


def by_parameter(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint's weights and optimizer state under neutral names (FQN, optimizer.state.FQN.KEY), so that two
    checkpoints of one run in different frameworks compare tensor by tensor. An optimizer state keyed by parameter
    index keeps its indices (optimizer.state.I.KEY), which a conversion refuses."""
    holder = ckpt
    if run_read.is_run(ckpt) and len(ckpt.source.parts) == 1:  # a Trainer/accelerate folder holding one DeepSpeed checkpoint
        holder = ckpt.source.parts[0][1]
    try:
        state = from_checkpoint(holder, NameMap(), need_optimizer=False)
    except UsageError:
        state = training_format(holder).read_state(holder, need_optimizer=False)
    tensors = {n: dataclasses.replace(e, name=n, path=(n,)) for n, e in state.weights.items()}
    for fqn, keys in state.moments.items():
        for key, entry in keys.items():
            path = ("optimizer", "state", fqn, key)
            tensors[path_name(path)] = dataclasses.replace(entry, name=path_name(path), path=path)
    return dataclasses.replace(ckpt, tensors=tensors)


def comparable(a: Checkpoint, b: Checkpoint) -> tuple[Checkpoint, Checkpoint, str | None]:
    """The two checkpoints under names that match tensor by tensor, and how they were matched (None: by their own
    names), as diff and verify --against pair them. When their key layouts differ (one run saved by two frameworks),
    by parameter name (by_parameter). A flat state dict (no optimizer) is named by FQN already: the other side is
    renamed to meet it, and a side whose training state cannot be read by name keeps its own names."""
    layouts = training_format(a).layout_of(a), training_format(b).layout_of(b)  # deepspeed, get_state_dict, torchtitan, flat
    if layouts[0] == layouts[1]:
        return a, b, None
    sides = []
    for ckpt, layout in zip((a, b), layouts):
        if layout == "flat":
            sides.append(ckpt)
            continue
        try:
            sides.append(by_parameter(ckpt))
        except CkptError:
            sides.append(ckpt)
    if "flat" in layouts and _shared(a, b) > _shared(sides[0], sides[1]):
        return a, b, None  # the flat side kept the other's own names (`merge` of a DCP save: model.x): by name
    return sides[0], sides[1], f"by parameter name ({' vs '.join(sorted(set(layouts)))} key layouts)"


def _shared(a: Checkpoint, b: Checkpoint) -> int:
    return sum(name in b.tensors for name in a.tensors)
