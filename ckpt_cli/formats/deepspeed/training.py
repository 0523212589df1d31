"""DeepSpeed ZeRO checkpoints as a training run: read into a TrainingState, and built from one.

Reading takes what the DeepSpeed reader already exposes (fp32 master weights and Adam moments by
parameter name, param groups, `shared_params` ties, buffer names, client state) and leaves out the
engine's bookkeeping. Writing builds the files DeepSpeed would have saved for the run
(formats/deepspeed/template.py) from the user's DeepSpeed config, which the DeepSpeed writer then
cuts for the requested world size.
"""

from __future__ import annotations

from contextlib import closing
from typing import Any

from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.paths import step_number
from ckpt_cli.core.training import StateOptions, TrainingState
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.deepspeed import template as deepspeed_template
from ckpt_cli.formats.deepspeed.layout import expert_module

# DeepSpeed engine bookkeeping with no meaning outside DeepSpeed (recomputed when writing DeepSpeed).
_DS_ENGINE_ONLY = ("skipped_steps", "global_samples", "data_sampler", "random_ltd", "dp_world_size", "mp_world_size")


class DeepSpeedTraining:
    """The TrainingFormat of DeepSpeed ZeRO."""

    def layout_of(self, ckpt: Checkpoint) -> str:
        return "deepspeed"

    def read_state(self, ckpt: Checkpoint, need_optimizer: bool) -> TrainingState:
        return _from_deepspeed(ckpt)

    def changes_layout(self, ckpt: Checkpoint, options: StateOptions) -> bool:
        """A new ZeRO stage or a run config rebuilds the files; a plain reshard only re-cuts them."""
        return options.ds_config is not None or options.zero_stage not in (None, ckpt.details.get("zero_stage"))

    def write_state(self, state: TrainingState, options: StateOptions) -> Checkpoint:
        if options.layout is not None:
            raise UsageError("--layout applies to dcp targets")
        expert = next((n for n in state.weights if expert_module(n)), None)
        if expert is not None:  # the MoE layout (expert files, expert-parallel groups): docs/formats.md §2.12
            raise UsageError(
                f"{expert}: building DeepSpeed MoE files is not supported (only a reshard of a DeepSpeed MoE checkpoint to a new "
                "--world-size writes them; a new ZeRO stage or --ds-config for an MoE run is not)"
            )
        target = deepspeed_template.target(options.ds_config, options.zero_stage, options.world_size, state.run_config)
        if state.layout != "deepspeed":  # DeepSpeed records its ties (shared_params); DCP saves the tensor twice
            found = find_ties(state)
            if found:
                state.tied.update(found)
                state.notes.append("tied weights (equal bytes): " + ", ".join(f"{a} -> {o}" for a, o in found.items()))
        step = step_number(state.step, "the source's training state") or 0
        return deepspeed_template.build(state, target, f"global_step{step}", options.per_rank)  # DeepSpeed's tag folder name


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
        run_config=model_tree.get("ds_config") if isinstance(model_tree.get("ds_config"), dict) else None,
    )
    if dropped:
        state.notes.append(f"left out DeepSpeed engine bookkeeping: {', '.join(dropped)}")
    state.notes.append("left out the module's training-dtype copies of the weights (module.*); the fp32 master weights are carried")
    return state


def find_ties(state: TrainingState) -> dict[str, str]:
    """Weights outside every param group whose bytes equal a trainable parameter's: tied aliases, which DCP does
    not record (an FSDP2 save holds the tied tensor under both names). Candidates of the same shape and dtype are
    compared on their first elements, and in full only when those agree, so unrelated weights cost a few KB."""
    from ckpt_cli.core.reading import SourceFiles, equal_values

    held = {p for g in state.groups for p in g["params"]}
    owners: dict[tuple[Any, ...], list[str]] = {}
    for p in state.trainable():
        owners.setdefault((state.weights[p].shape, state.weights[p].dtype), []).append(p)

    ties: dict[str, str] = {}
    with closing(SourceFiles()) as sources:
        for name, entry in state.weights.items():
            if name in held or name in state.tied or name in state.buffers or not entry.numel:
                continue
            owner = next((o for o in owners.get((entry.shape, entry.dtype), []) if equal_values(entry, state.weights[o], sources)), None)
            if owner is not None:
                ties[name] = owner
    return ties


TRAINING = DeepSpeedTraining()
