"""Megatron-Core `torch_dist` checkpoints (reader and checks), as `megatron.core.dist_checkpointing.save` writes them.

A torch_dist folder is a PyTorch DCP checkpoint (`.metadata` + `__R_I.distcp`, read by formats/dcp/reader.py) whose
items are Megatron's sharded keys (`decoder.layers.self_attention.linear_qkv.weight`; homogeneous layers are
stacked along a leading layer dimension), plus `common.pt` (rank 0's torch.save of everything not sharded:
iteration, args, optimizer param groups) and `metadata.json` ({"sharded_backend": "torch_dist", ...}, written
last: without it Megatron does not load the folder). Megatron's `.metadata` also pickles the savers' plans
(`all_local_plans`) and, before 0.14, `mcore_data`; both are read through inert stand-ins, never by importing
Megatron. Facts: docs/formats.md §9.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core import roles, structured
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint, FileInfo, ObjectEntry, Opaque, TensorEntry
from ckpt_cli.core.paths import open_regular, present, read_regular_text
from ckpt_cli.core.pickles import pickler
from ckpt_cli.core.pickles.frozen import Frozen, Sealed, frozen
from ckpt_cli.core.pickles.pickle_guard import PickleRefused, charge
from ckpt_cli.core.pickles.pickler import Global, Instance, Reduce
from ckpt_cli.errors import DataError, UnsafePickleError, UsageError
from ckpt_cli.formats.dcp import reader as dcp
from ckpt_cli.formats.torch_save import crc_problems, entries_from_tree, load_archive, open_archive

CONFIG = "metadata.json"
COMMON = "common.pt"
REFORMULATED = "nd_reformulated_orig_global_shape"


class _Record(metaclass=Sealed):
    """An inert stand-in for a pickled dataclass: its state, nothing else."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict):
            raise PickleRefused("a pickled record whose state is not a dict")
        charge(len(state))
        self.__dict__.update(state)


class PlanRec(_Record):
    """torch's SavePlan / WriteItem / TensorWriteData, as Megatron keeps them in `Metadata.all_local_plans`."""


class MCoreMetadataRec(dcp.MetadataRec):
    """Megatron 0.15's MCoreMetadata: DCP's Metadata with `mcore_data`."""


class Namespace(_Record):
    """argparse.Namespace: Megatron-LM's `args` in common.pt."""


@frozen
class EnumValue(Frozen):
    """A member of one of Megatron's enums, by its class and value (`AttnBackend(5)`)."""

    module: str
    cls: str
    value: Any

    def __repr__(self) -> str:
        return f"{self.cls}({self.value!r})"


def _enum(module: str, cls: str) -> Any:
    def make(value: Any) -> EnumValue:
        if not isinstance(value, int | str):
            raise PickleRefused(f"{cls} of something other than a number or a name")
        return EnumValue(module, cls, value)

    return make


pickler.register(Namespace, lambda ns: Instance(Global("argparse", "Namespace"), dict(ns.__dict__)))
pickler.register(EnumValue, lambda e: Reduce(Global(e.module, e.cls), (e.value,)))

_PLANNER = "torch.distributed.checkpoint.planner"
_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **dcp.METADATA_GLOBALS,
    **{(_PLANNER, name): PlanRec for name in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")},
    (_PLANNER, "WriteItemType"): lambda v: v,
    (_STRATEGY, "MCoreMetadata"): MCoreMetadataRec,
    (_STRATEGY, "MCoreSavePlan"): PlanRec,
}
_ENUMS = {
    "megatron.core.enums": ("ModelType", "Fp8Recipe", "Fp4Recipe"),
    "megatron.core.transformer.enums": ("ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend", "CudaGraphScope"),
}
COMMON_GLOBALS: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): Namespace,
    **{(module, cls): _enum(module, cls) for module, names in _ENUMS.items() for cls in names},
}
ARGS_SHOWN = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
)  # fmt: skip


@dataclass(frozen=True)
class MegatronSource(dcp.DCPSource):
    """DCP's parsed files plus Megatron's own: whether metadata.json and common.pt are there."""

    config: dict[str, Any] | None = None
    common: bool = False


def load_config(folder: Path) -> dict[str, Any] | None:
    """metadata.json (None when absent); DataError when it is not Megatron's JSON object."""
    path = folder / CONFIG
    if not present(path):
        return None
    try:
        config = structured.load_json(read_regular_text(path, 1 << 20), str(path), DataError)
    except OSError as exc:
        raise DataError(f"{path}: not readable ({exc.strerror}); Megatron cannot load this checkpoint either") from exc
    if not isinstance(config, dict) or not isinstance(config.get("sharded_backend"), str):
        raise DataError(f"{path}: no sharded_backend; not a Megatron dist_checkpointing config")
    if config["sharded_backend"] != "torch_dist":
        raise UsageError(f"{path}: sharded_backend '{config['sharded_backend']}'; ckpt reads Megatron's torch_dist backend only")
    return config


def _common(folder: Path, options: ReadOptions) -> tuple[dict[str, TensorEntry], dict[str, ObjectEntry], dict[Any, str]]:
    """common.pt through the allow list: its tensors (the optimizer's common step) and values."""
    path = folder / COMMON
    try:
        tree, records = open_archive(path, options, COMMON_GLOBALS, not_zip="not a torch.save archive")
    except UnsafePickleError as exc:  # kept unparsed: inspect shows it, verify reports it, writers refuse it
        value = Opaque(f"needs {exc.global_name}; --trust-pickle to parse", exc.global_name)
        return {}, {COMMON: ObjectEntry(COMMON, value, raw=(str(path), 0, path.stat().st_size))}, {}
    if tree == {}:
        return {}, {}, {}
    if not isinstance(tree, dict):
        raise DataError(f"{path}: holds a {type(tree).__name__}, not Megatron's common state dict")
    return entries_from_tree(tree, records, str(path))


def _role(name: str, default: str) -> str:
    """Sharded keys are dotted FQNs: Megatron's optimizer state is `optimizer.state.exp_avg.<param key>`."""
    return "optimizer" if roles.is_optimizer_key(name.split(".", 1)[0].lower()) else default


class MegatronReader(dcp.DCPReader):
    name = "megatron"
    metadata_globals = METADATA_GLOBALS

    def detect(self, path: Path) -> bool:
        return path.is_dir() and present(path / dcp.METADATA) and (present(path / CONFIG) or present(path / COMMON))

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        config = load_config(path)
        ckpt = super().read(path, options)
        meta = ckpt.source.metadata
        for entry in ckpt.tensors.values():
            entry.role = _role(entry.name, entry.role)
        for obj in ckpt.objects.values():
            obj.role = _role(obj.name, obj.role)
        notes = _drop_reformulated(ckpt, getattr(meta, "mcore_data", None))
        _expand_objects(ckpt, options)
        has_common = present(path / COMMON)
        if has_common:
            tensors, objects, containers = _common(path, options)
            clash = (set(tensors) | set(objects)) & (set(ckpt.tensors) | set(ckpt.objects))
            if clash:
                raise DataError(f"{path / COMMON}: '{sorted(clash)[0]}' is also a sharded key in {dcp.METADATA}")
            ckpt.tensors.update(tensors)
            ckpt.objects.update(objects)
            ckpt.containers.update(containers)
            ckpt.files.append(FileInfo(str(path / COMMON), (path / COMMON).stat().st_size))
        if config is not None:
            ckpt.files.append(FileInfo(str(path / CONFIG), (path / CONFIG).stat().st_size))
        else:
            notes.append(f"{path / CONFIG} is missing: Megatron writes it last, so the save may not have finished")
        ckpt.details = {**_details(ckpt, config), **ckpt.details}
        ckpt.notes += notes
        parsed = {f.name: getattr(ckpt.source, f.name) for f in dataclasses.fields(dcp.DCPSource)}
        ckpt.source = MegatronSource(**parsed, config=config, common=has_common)
        ckpt.step = roles.find_step(ckpt)
        ckpt.training_state = _training_state(ckpt)
        refused = {o.name: o.value.unsafe_global for o in ckpt.unsafe_values()}
        if refused:
            ckpt.details["refused_pickles"] = refused
        return ckpt

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        source = ckpt.source
        if not isinstance(source, MegatronSource):
            raise TypeError(f"{ckpt.path}: MegatronReader.check needs the checkpoint its read() returned")
        problems = super().check(ckpt, deep)
        if source.config is None:
            problems.append(
                f"{source.folder / CONFIG}: missing; Megatron writes it after every shard, and does not load the folder without it"
            )
        if not source.common:
            problems.append(f"{source.folder / COMMON}: missing; Megatron's load reads it first (iteration, args, optimizer param groups)")
        elif deep:
            problems += crc_problems([source.folder / COMMON])
        return problems


def _expand_objects(ckpt: Checkpoint, options: ReadOptions) -> None:
    """ShardedObjects that hold tensors (Megatron-LM's rng_state: torch's RNG state is a tensor) as their tensors and values, under
    the object's key: DCP's reader keeps such a value unparsed, which a torch.save export could not write back."""
    for name, obj in list(ckpt.objects.items()):
        if not (isinstance(obj.value, Opaque) and obj.value.unsafe_global is None and obj.raw):
            continue
        path, offset, length = obj.raw
        with open_regular(path) as f:
            value, records = load_archive(f, f"{path} ('{name}' at {offset})", options, offset, length)
        tensors, objects, containers = entries_from_tree({name: value}, records, path)
        del ckpt.objects[name]
        made: list[TensorEntry | ObjectEntry] = [*tensors.values(), *objects.values()]
        for entry in made:
            entry.role = _role(name, "other")
        ckpt.tensors.update(tensors)
        ckpt.objects.update(objects)
        ckpt.containers.update(containers)


def _drop_reformulated(ckpt: Checkpoint, mcore_data: Any) -> list[str]:
    """Tensors Megatron < 0.14 saved N-D reformulated (a distributed optimizer's fully_sharded_model_space state: the
    stored shape is not the logical one); they are left out, named in a note, rather than read under the wrong shape."""
    if not isinstance(mcore_data, dict):
        return []
    dropped = []
    for key, info in mcore_data.items():
        if isinstance(info, dict) and REFORMULATED in info and key in ckpt.tensors:
            shape = info[REFORMULATED]
            del ckpt.tensors[key]
            dropped.append(f"{key} {list(shape) if isinstance(shape, tuple | list) else shape}")
    if not dropped:
        return []
    return [
        f"{len(dropped)} tensors are stored N-D reformulated by Megatron < 0.14 (distributed optimizer, fully_sharded_model_space) "
        f"and are not read: {', '.join(dropped[:3])}{' ...' if len(dropped) > 3 else ''}"
    ]


def _details(ckpt: Checkpoint, config: dict[str, Any] | None) -> dict[str, Any]:
    stacked = [t for t in ckpt.tensors.values() if ".layers." in f".{t.name}" and not _layer_numbered(t.name)]
    details: dict[str, Any] = {
        "sharded_backend": f"{config['sharded_backend']} v{config.get('sharded_backend_version')}" if config else None,
        "layer_stacked_tensors": len(stacked),
        "sharded_objects": len({str(x.path[0]) for x in ckpt.entries() if "/shard_" in str(x.path[0])}),
    }
    args = next((o.value for o in ckpt.objects.values() if o.path == ("args",) and isinstance(o.value, Namespace)), None)
    if args is not None:
        details |= {k: v for k in ARGS_SHOWN if isinstance(v := args.__dict__.get(k), int) and not isinstance(v, bool)}
    return details


def _training_state(ckpt: Checkpoint) -> dict[str, Any]:
    """As inferred from names, with Megatron's own: optimizer state `optimizer.state.<kind>.<param key>`, sharded objects
    `<key>/shard_<offsets>_<grid>` (`rng_state/...`; a module's `_extra_state/...` is the model's)."""
    state = roles.infer_training_state(ckpt)
    found = {t.name.split(".")[2] for t in ckpt.tensors.values() if t.role == "optimizer" and t.name.startswith("optimizer.state.")}
    kinds = sorted(found - {"common_step"})
    if state["optimizer"] and kinds:
        adam = {"exp_avg", "exp_avg_sq"} <= set(kinds)
        state["optimizer"] |= {"kind": "Adam/AdamW" if adam else state["optimizer"]["kind"], "states": kinds}
    entries: list[ObjectEntry | TensorEntry] = [*ckpt.objects.values(), *ckpt.tensors.values()]
    keys = dict.fromkeys(str(x.path[0]) for x in entries if x.role != "model")
    tops = {key: key.split("/", 1)[0].split(".", 1)[0].lower() for key in keys}
    rng = [name for name, top in tops.items() if top in roles.RNG_KEYS]
    if rng:
        state["rng"] = {"keys": rng}
    known = roles.NON_MODEL | roles.MODEL_KEYS | set(roles.STEP_KEYS)
    client = [n for n, top in tops.items() if top not in known and "._extra_state/" not in n and not roles.is_optimizer_key(top)]
    state["client_state"] = {"keys": client[:20]} if client else None
    return state


def _layer_numbered(name: str) -> bool:
    parts = name.split(".")
    return any(p == "layers" and i + 1 < len(parts) and parts[i + 1].isdigit() for i, p in enumerate(parts))


READER = MegatronReader()
