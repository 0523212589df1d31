"""Telling model weights from optimizer state and the rest, and describing the training state.

Formats that know their layout (DeepSpeed) set roles themselves; for plain state dicts the top-level
key decides, as the conventions of PyTorch, Lightning, Accelerate and torchtitan have it.
"""

from __future__ import annotations

import re
from typing import Any

from ckpt_cli.core.model import Checkpoint, PathKey

OPTIMIZER_KEYS = {"optimizer", "optim", "optimizer_state_dict", "optimizer_states", "optimizers", "opt"}
MODEL_KEYS = {"model", "module", "state_dict", "model_state_dict", "model_state", "weights", "params", "ema"}
SCHEDULER_KEYS = {"lr_scheduler", "scheduler", "lr_schedulers", "lr_scheduler_state_dict", "scheduler_state_dict"}
RNG_KEYS = {"rng", "rng_state", "rng_states", "random", "torch_rng_state", "cuda_rng_state", "numpy_rng_state", "python_rng_state"}
DATALOADER_KEYS = {"dataloader", "data_loader", "dataloaders", "sampler", "data_state", "train_dataloader"}
STEP_KEYS = ("global_step", "step", "iteration", "global_steps", "steps")
# Lightning's own entries beside `state_dict` (and beside `model` in its sharded FSDP checkpoints).
LIGHTNING_KEYS = {"callbacks", "loops", "hyper_parameters", "hparams_name", "datamodule_hyper_parameters", "epoch"}
NON_MODEL = OPTIMIZER_KEYS | SCHEDULER_KEYS | RNG_KEYS | DATALOADER_KEYS | LIGHTNING_KEYS | {"client_state", "extra_state"}
NUMBERED_OPTIMIZER = re.compile(r"optimizer_\d+")  # Lightning's sharded checkpoints: optimizer_0, optimizer_1, ...


def optimizer_key(tops: set[str]) -> str | None:
    """The top-level key a training checkpoint keeps its optimizer under: get_state_dict's `optim`, else `optimizer`."""
    return "optim" if "optim" in tops else "optimizer" if "optimizer" in tops else None


def key_layout(paths: list[PathKey]) -> str:
    """How a training checkpoint's keys are laid out (from key paths alone):
    'get_state_dict': the model nested under `model`, the optimizer under `optim` (or `optimizer`) with
    `state`/`param_groups` nested, as torch's get_state_dict returns them; 'torchtitan': model keys at
    the top level, the optimizer under `optimizer` (flattened per parameter by torchtitan); 'flat': a
    state dict with no optimizer."""
    tops = {str(p[0]) for p in paths if p}
    optimizer = optimizer_key(tops)
    if optimizer is None:
        return "get_state_dict" if "model" in tops else "flat"
    rest = [p for p in paths if p and str(p[0]) not in NON_MODEL and str(p[0]) not in STEP_KEYS and str(p[0]) != "train_state"]
    nested = bool(rest) and all(str(p[0]) == "model" and len(p) > 1 for p in rest)  # HF models have top-level "model.*" too
    return "get_state_dict" if nested or optimizer == "optim" else "torchtitan"


def _top(path: PathKey) -> str:
    return str(path[0]).lower() if path else ""


def is_optimizer_key(top: str) -> bool:
    return top in OPTIMIZER_KEYS or NUMBERED_OPTIMIZER.fullmatch(top) is not None


def tensor_role(path: PathKey) -> str:
    top = _top(path)
    if is_optimizer_key(top):
        return "optimizer"
    if top in NON_MODEL:
        return "other"
    return "model"


def object_role(path: PathKey) -> str:
    return "optimizer" if is_optimizer_key(_top(path)) else "other"


def find_step(ckpt: Checkpoint) -> int | None:
    """The step saved at the top level (`step`, `global_step`, ...) or in torchtitan's `train_state`."""
    for key in STEP_KEYS:
        for obj in ckpt.objects.values():
            where = tuple(str(p) for p in obj.path)
            if where in ((key,), ("train_state", key)) and isinstance(obj.value, int) and not isinstance(obj.value, bool):
                return obj.value
    return None


def describe_training_state(ckpt: Checkpoint) -> dict[str, Any]:
    """What training state is present beyond the weights: the reader's account, else inferred from names."""
    return ckpt.training_state if ckpt.training_state is not None else infer_training_state(ckpt)


def infer_training_state(ckpt: Checkpoint) -> dict[str, Any]:
    """Training state from key names alone (no tensor reads)."""
    state: dict[str, Any] = {"optimizer": None, "lr_scheduler": None, "rng": None, "dataloader": None, "client_state": None}
    opt_tensors = [t for t in ckpt.tensors.values() if t.role == "optimizer"]
    if opt_tensors:
        kinds = sorted({str(t.path[-1]).rsplit(".", 1)[-1] for t in opt_tensors})  # torchtitan: "state.FQN.exp_avg"
        name = (
            "Adam/AdamW" if {"exp_avg", "exp_avg_sq"} <= set(kinds) else ("SGD with momentum" if "momentum_buffer" in kinds else "unknown")
        )
        state["optimizer"] = {
            "kind": name,
            "states": kinds,
            "tensors": len(opt_tensors),
            "param_groups": param_group_count(ckpt),
        }
    client: list[str] = []
    for obj in ckpt.objects.values():
        top = _top(obj.path)
        if top in SCHEDULER_KEYS:
            state["lr_scheduler"] = state["lr_scheduler"] or _scheduler_summary(ckpt, obj.path[0])
        elif top in RNG_KEYS:
            state["rng"] = state["rng"] or {"keys": [str(obj.path[0])]}
        elif top in DATALOADER_KEYS:
            state["dataloader"] = state["dataloader"] or _object_summary(ckpt, obj.path[0])
        elif not is_optimizer_key(top) and top not in MODEL_KEYS and top not in STEP_KEYS and top != "train_state":
            client.append(obj.name)
    for t in ckpt.tensors.values():
        if _top(t.path) in RNG_KEYS and not state["rng"]:
            state["rng"] = {"keys": [str(t.path[0])]}
    if client:
        state["client_state"] = {"keys": client[:20]}
    return state


def param_group_count(ckpt: Checkpoint) -> int | None:
    """Param groups as one pickled list (torch files), flattened per hyper-parameter (DCP), or per parameter
    (torchtitan's `param_groups.FQN.key`: parameters with the same hyper-parameters make one group)."""
    positions = set()
    per_param: dict[str, dict[str, str]] = {}
    for o in ckpt.objects.values():
        if str(o.path[-1]) == "param_groups" and isinstance(o.value, list):
            return len(o.value)
        for i, part in enumerate(o.path[:-1]):
            if part == "param_groups" and isinstance(o.path[i + 1], int):
                positions.add(o.path[i + 1])
        last = str(o.path[-1])
        if last.startswith("param_groups."):
            fqn, _, key = last[len("param_groups.") :].rpartition(".")
            per_param.setdefault(fqn, {})[key] = repr(o.value)
    if positions:
        return len(positions)
    return len({tuple(sorted(h.items())) for h in per_param.values()}) or None


def _object_summary(ckpt: Checkpoint, top: Any) -> dict[str, Any]:
    return {
        ".".join(map(str, o.path[1:])) or str(top): o.value
        for o in ckpt.objects.values()
        if o.path[0] == top and isinstance(o.value, (int, float, str, bool))
    }


def _scheduler_summary(ckpt: Checkpoint, top: Any) -> dict[str, Any]:
    summary = _object_summary(ckpt, top)
    keep = ("last_epoch", "_step_count", "_last_lr", "base_lrs")
    picked = {k.split(".")[-1]: v for k, v in summary.items() if k.split(".")[-1] in keep}
    for o in ckpt.objects.values():
        if o.path[0] == top and str(o.path[-1]) in ("_last_lr", "base_lrs"):
            picked[str(o.path[-1])] = o.value
    return picked or summary
