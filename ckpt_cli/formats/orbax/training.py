"""An Orbax save's training state (a flax/optax train state: `params`, `opt_state`, `step`) read into a TrainingState,
and a TrainingState laid out as optax.adamw's state for the Orbax writer, so a run moves between JAX and PyTorch.

optax's Adam/AdamW keep one `ScaleByAdamState(count, mu, nu)` in the optimizer chain: `mu` and `nu` are trees shaped
like `params` (torch AdamW's `exp_avg` and `exp_avg_sq`), `count` the number of updates (torch keeps it once per
parameter as `step`, a float32 0-d tensor). optax.adamw's chain is (scale_by_adam, add_decayed_weights,
scale_by_learning_rate): its state `(ScaleByAdamState, EmptyState(), EmptyState())` for a constant learning rate.
Orbax saves no hyper-parameter (optax keeps them in code), so a torch param group gets optax.adamw's defaults and the
conversion says so. See docs/formats.md §14.7.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckpt_cli.core import dtypes
from ckpt_cli.core.computed import Cast
from ckpt_cli.core.model import Checkpoint, ObjectEntry, PathKey, TensorEntry
from ckpt_cli.core.training import StateOptions, TrainingState, scalar
from ckpt_cli.errors import DataError, UsageError

MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}  # optax ScaleByAdamState field -> torch Adam/AdamW state key
OPTIMIZER_TOPS = ("opt_state", "optimizer", "opt")
# torch.optim.AdamW's param group with optax.adamw's default hyper-parameters (b1, b2, eps, weight_decay); lr has no
# default in optax: 1e-3 stands in for it, and the conversion says so
ADAMW_GROUP: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-4,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
HYPER_NOTE = (
    "Orbax saves no optimizer hyper-parameters (optax keeps them in code): the torch param group holds optax.adamw's "
    "defaults (betas (0.9, 0.999), eps 1e-08, weight_decay 0.0001) and lr 0.001 in place of the run's; set the run's "
    "values on the torch optimizer (or its LR scheduler) after loading"
)


class Constant:
    """A 0-d tensor holding a number the source kept as a value (DCP's `step`)."""

    __slots__ = ("value", "dtype")

    def __init__(self, value: int, dtype: dtypes.DType) -> None:
        self.value, self.dtype = value, dtype

    def windows(self) -> Any:
        yield 0, 1

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        return torch.tensor([self.value], dtype=self.dtype.torch())


def cast(entry: TensorEntry, dtype: dtypes.DType, name: str, path: PathKey, role: str) -> TensorEntry:
    return TensorEntry(name, dtype, (), role, entry.pieces, path, derived=Cast(entry, dtype))


def constant(value: int, dtype: dtypes.DType, name: str, path: PathKey, role: str) -> TensorEntry:
    return TensorEntry(name, dtype, (), role, [], path, derived=Constant(value, dtype))


def leaf_keys(ckpt: Checkpoint) -> dict[str, tuple[str, ...]]:
    """Each tensor's key path in its item's tree (the Orbax reader's names are these joined with '.')."""
    return {item.prefix + leaf.name: leaf.keys for item in ckpt.source.items for leaf in item.tree.leaves}


def _adam_slot(keys: tuple[str, ...]) -> int | None:
    """The position of `mu`/`nu` in an optimizer leaf's keys (None: not an Adam moment)."""
    if not keys or keys[0] not in OPTIMIZER_TOPS:
        return None
    return next((i for i, k in enumerate(keys) if k in MOMENTS and i > 0), None)


class OrbaxTraining:
    """The TrainingFormat of Orbax saves (read); the Orbax writer lays out what `write_state` returns."""

    def layout_of(self, ckpt: Checkpoint) -> str:
        keys = leaf_keys(ckpt)
        return "optax" if any(_adam_slot(k) is not None for k in keys.values()) else "flat"

    def read_state(self, ckpt: Checkpoint, need_optimizer: bool) -> TrainingState:
        keys_of = leaf_keys(ckpt)
        has_params = any(k[0] == "params" for k in keys_of.values() if k)
        weights: dict[str, TensorEntry] = {}
        moments: dict[str, dict[str, TensorEntry]] = {}
        counts: dict[str, tuple[str, ...]] = {}  # FQN -> the count beside its moments
        taken: set[str] = set()
        for name, entry in ckpt.tensors.items():
            keys = keys_of.get(name, tuple(name.split(".")))
            slot = _adam_slot(keys)
            if has_params and keys[0] == "params" and len(keys) > 1:
                weights[".".join(keys[1:])] = entry
            elif not has_params and entry.role == "model":
                weights[name] = entry
            elif slot is not None:
                fqn = ".".join(keys[slot + 1 :])
                moments.setdefault(fqn, {})[MOMENTS[keys[slot]]] = entry
                counts[fqn] = (*keys[:slot], "count")
            else:
                continue
            taken.add(name)
        by_keys = {keys_of.get(n, tuple(n.split("."))): n for n in ckpt.tensors}
        for fqn, count_keys in counts.items():
            count = by_keys.get(count_keys)
            if count is None:
                raise DataError(f"{ckpt.path}: the Adam moments of '{fqn}' have no '{'.'.join(count_keys)}' beside them")
            entry = ckpt.tensors[count]
            if entry.shape or entry.dtype.is_float:
                raise DataError(f"{ckpt.path}: '{count}' is {entry.dtype.name} {list(entry.shape)}, not optax's integer count")
            moments[fqn]["step"] = cast(entry, dtypes.BY_NAME["float32"], count, (count,), "optimizer")
            taken.add(count)
        step = None
        step_entry = ckpt.tensors.get(by_keys.get(("step",), ""))
        if step_entry is not None and not step_entry.shape and not step_entry.dtype.is_float:
            step = int(scalar(step_entry))
            taken.add(step_entry.name)
        extras = [t for n, t in ckpt.tensors.items() if n not in taken]
        for fqn, held in moments.items():
            if set(held) != {"exp_avg", "exp_avg_sq", "step"}:
                raise DataError(f"{ckpt.path}: the optax Adam state of '{fqn}' has {', '.join(sorted(held))}, not mu, nu and count")
        groups = [{**ADAMW_GROUP, "params": [f for f in weights if f in moments]}] if moments else []
        notes = [HYPER_NOTE] if moments else []
        return TrainingState(weights, moments, groups, step, [], extras, notes=notes)

    def changes_layout(self, ckpt: Checkpoint, options: StateOptions) -> bool:
        return False

    def write_state(self, state: TrainingState, options: StateOptions) -> Checkpoint:
        return to_optax(state)


def _steps(state: TrainingState) -> int | None:
    """The one count every parameter's Adam step holds (optax keeps one per optimizer); refused when they differ."""
    found: dict[int, str] = {}
    for fqn, keys in state.moments.items():
        if "step" in keys:
            found.setdefault(_read_int_or_float(keys["step"]), fqn)
    if len(found) > 1:
        (a, fa), (b, fb) = list(found.items())[:2]
        raise UsageError(f"the Adam step differs between parameters ({fa}: {a}, {fb}: {b}); optax's adamw keeps one count for all of them")
    return next(iter(found), None)


def _read_int_or_float(entry: TensorEntry) -> int:
    value = float(scalar(entry))
    if value != int(value) or value < 0:
        raise DataError(f"{entry.name}: an Adam step of {value}, not a whole number")
    return int(value)


def to_optax(state: TrainingState) -> Checkpoint:
    """The tree optax.adamw's train state saves: params, opt_state (ScaleByAdamState(count, mu, nu), EmptyState(),
    EmptyState()) and step; each tensor's path is its key path (an int: a sequence index, as Orbax records tuples)."""
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}

    def put(path: PathKey, entry: TensorEntry, role: str) -> None:
        name = ".".join(map(str, path))
        if name in tensors:
            raise UsageError(f"two tensors are both '{name}' in the Orbax tree")
        tensors[name] = dataclasses.replace(entry, name=name, path=path, role=role)

    for fqn, entry in state.weights.items():
        put(("params", *fqn.split(".")), entry, "model")
    adam: PathKey = ("opt_state", 0)
    missing = [f for f in state.weights if state.moments and f not in state.moments]
    if missing:
        raise UsageError(
            f"'{missing[0]}' has no Adam state ({len(missing)} parameters without): optax keeps mu and nu for every parameter "
            "of params; a frozen parameter cannot be laid out as optax.adamw's state (--weights-only writes the weights)"
        )
    for fqn, keys in state.moments.items():
        unknown = set(keys) - {"exp_avg", "exp_avg_sq", "step"}
        if unknown or not {"exp_avg", "exp_avg_sq"} <= set(keys):
            raise UsageError(
                f"the optimizer state of '{fqn}' holds {', '.join(sorted(keys))}: not Adam/AdamW's, which optax.adamw's state is"
            )
        put((*adam, "mu", *fqn.split(".")), keys["exp_avg"], "optimizer")
        put((*adam, "nu", *fqn.split(".")), keys["exp_avg_sq"], "optimizer")
    notes = list(state.notes)
    if state.moments:
        count = _steps(state) or 0
        put((*adam, "count"), constant(count, dtypes.BY_NAME["int32"], "", (), "optimizer"), "optimizer")
        for index in (1, 2):  # add_decayed_weights and scale_by_learning_rate keep no state
            path: PathKey = ("opt_state", index)
            objects[f"opt_state.{index}"] = ObjectEntry(f"opt_state.{index}", None, "optimizer", path)
        notes.append("optimizer: laid out as optax.adamw's state (ScaleByAdamState(count, mu, nu), EmptyState(), EmptyState())")
        if state.groups:
            notes.append(f"param groups' hyper-parameters not kept: optax keeps them in code ({_hyper(state.groups)})")
    if state.step is not None:
        put(("step",), constant(state.step, dtypes.BY_NAME["int32"], "", (), "other"), "other")
    for extra in state.extra_tensors:
        put(tuple(extra.name.split(".")), extra, extra.role)
    dropped = [o.name for o in state.extra_objects]
    if dropped:
        notes.append(f"not written (an Orbax tree holds arrays): {', '.join(dropped[:8])}{', ...' if len(dropped) > 8 else ''}")
    return Checkpoint("training-state", "", tensors, objects, step=state.step, world_size=1, notes=notes)


def _hyper(groups: list[dict[str, Any]]) -> str:
    first = {k: v for k, v in groups[0].items() if k in ("lr", "betas", "eps", "weight_decay")}
    return ", ".join(f"{k} {v}" for k, v in first.items()) or "none recorded"


TRAINING = OrbaxTraining()
