"""DeepSpeed ZeRO files for a run that DeepSpeed did not save (FSDP2 + DCP, read as a TrainingState).

DCP records the weights, the Adam state and the param groups; the user's DeepSpeed config supplies
the rest (ZeRO stage, precision, gradient clipping, batch size). From both this module builds the
trees DeepSpeed itself saves, with the same keys, pickled classes and flat-buffer layout:
engine.py `_common_checkpoint_state` (model states), stage_1_and_2.py `state_dict`, stage3.py
`_rigid_state_dict` (optimizer states), as a source at world size 1 that the DeepSpeed writer then
cuts for the requested world size, exactly as it reshards a DeepSpeed checkpoint.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli import store
from ckpt_cli.core import dtypes, structured
from ckpt_cli.core.computed import Cast
from ckpt_cli.core.model import Checkpoint, ObjectEntry, Opaque, StoredArray, TensorEntry, concat_flat
from ckpt_cli.core.pickles.safe_pickle import TensorRef, TorchSize
from ckpt_cli.core.training import TrainingState, apply_per_rank_rule
from ckpt_cli.core.tree import unflatten
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.deepspeed.layout import Slot, flat_slots
from ckpt_cli.formats.deepspeed.rank_files import LossScaler, ZeroStage

# The DeepSpeed release whose layout this module reproduces (checked by loading in the test suite);
# load_checkpoint only requires a version string to be present.
DS_VERSION = "0.19.8"
GRADIENT_CLIPPING_DEFAULT = 1.0  # deepspeed/runtime/constants.py: applied when the config is silent


@dataclass
class Target:
    """What the DeepSpeed run that will load the checkpoint looks like."""

    stage: int
    precision: str  # "fp32" or "bf16"
    config: dict[str, Any]
    world: int
    notes: list[str] = field(default_factory=list)


def read_config(path: Path) -> dict[str, Any]:
    path = store.location(path)  # a local file or an object (s3://)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the DeepSpeed config ({exc.strerror})") from exc
    stripped = text.lstrip()
    if stripped.startswith("{"):
        config = structured.load_json(text, str(path), UsageError)
    else:
        config = structured.load_yaml(text, str(path), UsageError)
    if not isinstance(config, dict):
        raise UsageError(f"{path}: a DeepSpeed config is a JSON object")
    return config


def target(config_path: Path | None, zero_stage: int | None, world: int, saved: dict[str, Any] | None = None) -> Target:
    """The target run from --ds-config and --zero-stage (they must agree when both are given); without --ds-config,
    the config the source run `saved` (a DeepSpeed source's ds_config) when its stage is the one asked for."""
    config = read_config(config_path) if config_path else {}
    saved_stage = ((saved or {}).get("zero_optimization") or {}).get("stage")
    from_run = not config_path and saved is not None and zero_stage in (None, saved_stage)
    if from_run:
        config = dict(saved or {})
    where = config_path or "the ds_config the run saved (pass --ds-config to choose another)"
    auto = _auto_keys(config)
    if auto:
        raise UsageError(f"{where}: '{auto[0]}' is \"auto\" (a Hugging Face Trainer placeholder); give the value the run used")
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage") if config_path or from_run else None
    if zero_stage is not None and stage is not None and zero_stage != stage:
        raise UsageError(f"--zero-stage {zero_stage} disagrees with zero_optimization.stage {stage} in {config_path}")
    stage = zero_stage if zero_stage is not None else stage
    if stage not in (1, 2, 3):
        raise UsageError("writing deepspeed from another framework needs the ZeRO stage: --zero-stage 1|2|3 or --ds-config FILE")
    notes = []
    if (config.get("fp16") or {}).get("enabled"):
        raise UsageError(f"fp16 DeepSpeed targets (dynamic loss scaling) are not supported; use bf16 or fp32 ({where})")
    precision = "bf16" if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled") else "fp32"
    if precision == "bf16" and stage == 1 and (config.get("data_types") or {}).get("grad_accum_dtype") == "fp32":
        raise UsageError("the BF16_Optimizer (bf16, stage 1, grad_accum_dtype fp32) is not a supported target; use stage 1 or 2 without it")
    if zero.get("parameter_alignment") or zero.get("zero_hpz_partition_size", 1) > 1 or zero.get("mics_shard_size", -1) > 0:
        raise UsageError("parameter_alignment, hpZ and MiCS layouts are not supported as targets")
    if from_run:
        notes.append(f"DeepSpeed config: the one the run saved (ZeRO-{stage}, {precision}); pass --ds-config to choose another")
    elif not config_path:
        config = {"zero_optimization": {"stage": stage}}
        notes.append(
            f"no --ds-config: wrote ZeRO-{stage} fp32 with DeepSpeed's default gradient_clipping "
            f"{GRADIENT_CLIPPING_DEFAULT}; DeepSpeed restores clipping from the checkpoint, so pass the run's config"
        )
    return Target(stage, precision, config, world, notes)


def _auto_keys(config: Any, prefix: str = "") -> list[str]:
    if isinstance(config, dict):
        return [k for key, value in config.items() for k in _auto_keys(value, f"{prefix}{key}.")]
    return [prefix[:-1]] if config == "auto" else []


@dataclass
class TreeFile:
    """A built file's tree (a ZeroFile): its tensors are TensorEntries already, with no stored references."""

    tree: Any
    path: str = "the built DeepSpeed tree"

    def array(self, ref: TensorRef) -> StoredArray:
        raise TypeError("a built DeepSpeed tree holds TensorEntries, not stored tensor references")


class BuiltLayout:
    """Param groups as DeepSpeed flattens them (a ZeroLayout): the group's trainable params in order, no alignment pads."""

    alignment_padding = False
    experts = None  # a dense layout: no MoE

    def __init__(self, shapes: list[OrderedDict[str, tuple[int, ...]]]) -> None:
        self.shapes = shapes
        self.groups = [{"params": [g]} for g in range(len(shapes))]  # stage 3: one sub-group per group, re-cut later

    def offsets(self, g: int) -> list[Slot]:
        return flat_slots(list(self.shapes[g].items()))


@dataclass
class BuiltSource:
    """A ZeroSource built from a training state: stands where the DeepSpeed writer takes a read one (formats.deepspeed.Source)."""

    folder: Path
    stage: int
    world: int
    model: TreeFile
    models: dict[int, TreeFile]
    optims: dict[int, TreeFile]
    layout: BuiltLayout
    optim_prefix: str
    dtypes: bytes  # dtypes.dtype_digest of the tensors read
    copies: dict[str, TreeFile] = field(default_factory=dict)  # none: every file is built


def build(state: TrainingState, tgt: Target, tag: str, rule: str) -> Checkpoint:
    """A Checkpoint named like the DeepSpeed reader names one, whose `source` the DeepSpeed writer cuts."""
    empty = [i for i, g in enumerate(state.groups) if not any(p in state.moments for p in g["params"])]
    if empty and tgt.stage < 3:
        raise UsageError(
            f"param group {empty[0]} holds no parameter with optimizer state; DeepSpeed ZeRO-{tgt.stage} cannot hold an "
            "empty group (ZeRO-3 drops it)"
        )
    state.groups = [g for i, g in enumerate(state.groups) if i not in empty]  # stage3.py: only trainable groups
    trainable = state.trainable()
    # Frozen: in a param group without optimizer state, or neither trainable, a buffer nor a tied alias
    # (DCP does not record requires_grad; FSDP2 shards frozen params like the others).
    in_groups = [p for g in state.groups for p in g["params"]]
    frozen = [p for p in in_groups if p not in state.moments]
    frozen += [n for n in state.weights if n not in in_groups and n not in state.buffers and n not in state.tied]
    shapes = [OrderedDict((p, state.weights[p].shape) for p in g["params"] if p in state.moments) for g in state.groups]
    tensors: dict[str, TensorEntry] = {}
    for name, entry in state.weights.items():
        tensors[name] = TensorEntry(name, entry.dtype, entry.shape, "model", entry.pieces, derived=entry.derived)
    for fqn, keys in state.moments.items():
        for key, entry in keys.items():
            name, path = f"optimizer.state.{fqn}.{key}", ("optimizer", "state", fqn, key)
            tensors[name] = TensorEntry(name, entry.dtype, entry.shape, "optimizer", entry.pieces, path, derived=entry.derived)
    for p in trainable:
        if tensors[p].dtype != dtypes.FLOAT32 or any(e.dtype != dtypes.FLOAT32 for e in state.moments[p].values() if e.shape):
            raise UsageError(f"{p}: DeepSpeed keeps fp32 master weights and moments; the source holds {tensors[p].dtype.name}")
    training_dtype = dtypes.BY_NAME["bfloat16"] if tgt.precision == "bf16" else dtypes.FLOAT32
    saved: list[ObjectEntry | TensorEntry] = [*state.extra_objects, *state.extra_tensors]
    extras, note = apply_per_rank_rule(saved, tgt.world, rule)
    opaque = [o.name for o in extras if isinstance(o, ObjectEntry) and isinstance(o.value, Opaque)]
    if opaque:
        raise UsageError(f"cannot write non-tensor values that were not parsed: {', '.join(opaque[:3])} (try --trust-pickle)")
    model_tree = _model_states(state, tgt, shapes, frozen, extras, training_dtype)
    optim_tree = _optimizer_states(state, tgt, shapes)
    notes = list(state.notes) + tgt.notes
    if frozen:
        notes.append(
            f"written as frozen params (weights with no optimizer state): {', '.join(frozen[:3])}{' ...' if len(frozen) > 3 else ''}; "
            "a tied alias among them is better named with --name-map 'tied:'"
        )
    if note:
        notes.append(note)
    ckpt = Checkpoint("deepspeed", "", tensors, step=state.step, world_size=1, tag=tag, notes=notes)
    src = BuiltSource(
        Path(tag),
        tgt.stage,
        1,  # the flat order is the groups' own order (no round robin applied yet)
        TreeFile(model_tree),
        {0: TreeFile(model_tree)},
        {0: TreeFile(optim_tree)},
        BuiltLayout(shapes),
        "bf16_" if tgt.precision == "bf16" else "",  # engine._get_zero_ckpt_name: bf16 runs prefix the files
        dtypes.dtype_digest(tensors),
    )
    ckpt.source = src
    return ckpt


def _module_entry(entry: TensorEntry, name: str, dtype: Any, placeholder: bool) -> TensorEntry:
    """The module state dict's copy: in the training dtype; at stage 3 an empty placeholder for params."""
    if placeholder:
        return concat_flat(name, entry.dtype if not entry.dtype.is_float else dtype, 0, [])
    cast = dtype if entry.dtype.is_float else entry.dtype
    derived = Cast(entry, cast) if entry.derived is not None else None  # a computed weight (an Orbax array) read cast
    return TensorEntry(name, cast, entry.shape, "model", entry.pieces, derived=derived)


def _model_states(
    state: TrainingState,
    tgt: Target,
    shapes: list[OrderedDict[str, tuple[int, ...]]],
    frozen: list[str],
    extras: list[Any],
    training_dtype: Any,
) -> dict[str, Any]:
    buffers = [n for n in state.weights if n in state.buffers]
    module = OrderedDict(
        # DeepSpeed casts a bf16 run's parameters, not its buffers: buffers keep their dtype
        (n, _module_entry(e, n, e.dtype if n in buffers else training_dtype, tgt.stage == 3 and n not in buffers))
        for n, e in state.weights.items()
    )
    save_frozen = tgt.stage >= 2  # engine: only when gradients are partitioned
    frozen_shapes = OrderedDict((n, TorchSize(state.weights[n].shape)) for n in frozen)
    fragments = OrderedDict((n, _module_entry(state.weights[n], n, training_dtype, False)) for n in frozen)
    micro = tgt.config.get("train_micro_batch_size_per_gpu")
    batch = tgt.config.get("train_batch_size") or (micro * tgt.config.get("gradient_accumulation_steps", 1) * tgt.world if micro else 0)
    tree: dict[str, Any] = {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [OrderedDict((n, TorchSize(s)) for n, s in group.items()) for group in shapes],
        "frozen_param_shapes": frozen_shapes if save_frozen else None,
        "shared_params": dict(state.tied),
        "frozen_param_fragments": fragments if save_frozen else None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": state.step or 0,
        "global_samples": (state.step or 0) * batch,
        "dp_world_size": tgt.world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": tgt.config,
        "ds_version": DS_VERSION,
    }
    client = unflatten([(e.path, e.value if isinstance(e, ObjectEntry) else e) for e in extras], state.containers)
    if "lr_scheduler" in client:
        tree["lr_scheduler"] = client.pop("lr_scheduler")
    tree.update(client)  # engine.save_checkpoint: state.update(client_state)
    return tree


def _optimizer_states(state: TrainingState, tgt: Target, shapes: list[OrderedDict[str, tuple[int, ...]]]) -> dict[str, Any]:
    scaler = LossScaler.__new__(LossScaler)
    scaler.__dict__.update({"cur_scale": 1.0, "dynamic": False})
    base_state: dict[int, dict[str, Any]] = {}
    for g, group in enumerate(shapes):
        first = next(iter(group), None)
        if first is not None:
            base_state[g] = dict(state.moments[first])  # 0-d step kept; flat moments are cut by the writer
    hyper = [{**{k: v for k, v in grp.items() if k != "params"}, "params": [g]} for g, grp in enumerate(state.groups)]
    clip = tgt.config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    if tgt.stage == 3:
        osd: dict[str, Any] = {
            "zero_stage": ZeroStage(3),
            "loss_scaler": scaler,
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": tgt.world,
            "optimizer_state_dict": {"state": base_state, "param_groups": hyper},
            "fp32_flat_groups": [],
        }
    else:
        osd = {
            "loss_scaler": scaler,
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": clip,
            "base_optimizer_state": {"state": base_state, "param_groups": hyper},
            "single_partition_of_fp32_groups": [],
            "zero_stage": ZeroStage(tgt.stage),
            "group_paddings": [],
            "param_alignment_paddings": [[0] * len(group) for group in shapes],
            "partition_count": [],
            "ds_version": DS_VERSION,
            "param_slice_mappings": [],
        }
    return {"optimizer_state_dict": osd, "ds_config": tgt.config, "ds_version": DS_VERSION}
