"""Reading and checking a run checkpoint (formats/runs/detect.py) as one composite Checkpoint.

The composite holds every part's tensors and values (an optimizer part's as `optimizer`), the files of parts and
companions, and a training state completed from the companions: the scheduler, the RNG files, and the framework's
own counters (global step, epoch) read through the allow-list unpickler. Companions stay files: writers of the
same layout copy them (ops/runs.py); they are never re-encoded.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli import store
from ckpt_cli.core import roles, structured
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint, FileInfo, ObjectEntry, PathKey, TensorEntry
from ckpt_cli.core.paths import open_regular, read_regular_text
from ckpt_cli.core.pickles import zipio
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import registry
from ckpt_cli.formats.runs import detect as runs
from ckpt_cli.formats.runs.detect import Companion, Part, RunCheckpoint
from ckpt_cli.formats.torch_save import crc_problems

JSON_LIMIT = 64 * 2**20  # trainer_state.json holds the log history: generous, but bounded
PARSED_KINDS = ("scheduler", "rng", "framework_state", "custom")  # torch.save files read through the allow list
WEIGHTS_COPY = "weights_copy"  # the Trainer's model.safetensors beside ZeRO files: read by its format's reader
# The Trainer's counters ckpt reads from trainer_state.json (the rest, log history included, is carried as it is).
TRAINER_COUNTERS = {
    "global_step": structured.non_negative,
    "max_steps": structured.non_negative,
    "epoch": structured.Optional(float),
    "train_batch_size": structured.Optional(structured.non_negative),
}


@dataclass
class RunSource:
    """What `read` parsed: each part's own Checkpoint (for its writer), the companions' values, their problems."""

    run: RunCheckpoint
    parts: list[tuple[Part, Checkpoint]]
    values: dict[str, Any] = field(default_factory=dict)  # companion relpath -> parsed value (None: not parsed)
    problems: list[str] = field(default_factory=list)  # companions that failed to parse: what verify reports
    origin: dict[str, Part] = field(default_factory=dict)  # tensor name in the composite -> its part


def is_run(ckpt: Checkpoint) -> bool:
    return isinstance(ckpt.source, RunSource)


def read(run: RunCheckpoint, options: ReadOptions) -> Checkpoint:
    if run.unsupported:
        raise UsageError(run.unsupported)
    parts: list[tuple[Part, Checkpoint]] = []
    for part in run.parts:
        tag = options.tag if part.format == "deepspeed" else None  # --tag picks a DeepSpeed tag inside the save folder
        ckpt = registry.get(part.format).reader.read(run.part_path(part), dataclasses.replace(options, tag=tag))
        parts.append((_nesting(part, ckpt), ckpt))
    source = RunSource(run, parts)
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    files: list[FileInfo] = []
    containers: dict[PathKey, str] = {}
    for part, ckpt in parts:
        for t in ckpt.tensors.values():
            name = t.name if t.name not in tensors else f"{part.relpath}/{t.name}"
            tensors[name] = dataclasses.replace(t, name=name, role=part.role or t.role)
            source.origin[name] = part
        for o in ckpt.objects.values():
            name = o.name if o.name not in objects else f"{part.relpath}/{o.name}"
            objects[name] = dataclasses.replace(o, name=name, role=part.role or o.role)
        files += ckpt.files
        containers |= ckpt.containers
    for comp in run.companions:
        path = run.path / comp.relpath
        files.append(FileInfo(str(path), _size(path)))
        source.values[comp.relpath] = _parse_companion(comp, str(path), options, source.problems)
    primary = parts[0][1]
    part_rows = [
        {"path": p.relpath or ".", "format": c.format, "role": p.role or "model+optimizer", "tensors": len(c.tensors)} for p, c in parts
    ]
    companion_rows = [{"path": c.relpath, "kind": c.kind, **({"rank": c.rank} if c.rank is not None else {})} for c in run.companions]
    composite = Checkpoint(
        format=primary.format,
        path=str(run.path),
        tensors=tensors,
        objects=objects,
        files=files,
        tag=primary.tag,
        world_size=primary.world_size,
        containers=containers,
        details={**primary.details, "framework": run.framework, "parts": part_rows, "companions": companion_rows},
        notes=list(primary.notes)
        + [f"{run.path}: {p} (not part of the {run.framework} checkpoint; not carried)" for p in run.unknown]
        + [f"damaged: {p}" for p in source.problems],
        source=source,
    )
    composite.training_state = _training_state(composite, primary, source)
    composite.step = _framework_state(source, objects).get("global_step", primary.step)
    return composite


def _nesting(part: Part, ckpt: Checkpoint) -> Part:
    """The key the model weights are nested under, as this checkpoint has it: Lightning's sharded checkpoints use
    `model` (FSDPStrategy) or `state_dict` (ModelParallelStrategy)."""
    tops = {str(t.path[0]) for t in ckpt.tensors.values() if (part.role or t.role) == "model" and len(t.path) > 1}
    if part.model_prefix and len(tops) == 1 and (top := tops.pop()) in runs.NESTING_KEYS:
        return dataclasses.replace(part, model_prefix=f"{top}.")
    return part


def _size(path: str | os.PathLike[str]) -> int:
    try:
        return store.size(path)
    except OSError:
        return -1


def _parse_companion(comp: Companion, where: str, options: ReadOptions, problems: list[str]) -> Any:
    """The value of a companion that ckpt understands (None for the rest); a damaged one adds a problem."""
    try:
        if not store.location(where).is_file():
            raise DataError(f"{where}: not a regular file; a run checkpoint's files are copied as they are, so ckpt refuses it")
        if comp.kind == "other" and runs.foreign(store.location(where)):  # another tool's file (np.savez, a pickle): copied as is
            return None
        if comp.kind == "other" and _is_pickle(where):  # an unknown pickle is checked like a known one before it is copied
            return registry.get("torch").reader.read(store.location(where), ReadOptions(trust_pickle=options.trust_pickle))
        if comp.relpath.endswith(".json"):
            value = structured.load_json(read_regular_text(where, JSON_LIMIT), where, DataError)
            if comp.kind == "trainer_state":
                structured.check(value, dict, where, DataError)
                for key, spec in TRAINER_COUNTERS.items():
                    if key in value:
                        structured.check(value[key], spec, where, DataError, key)
            return value
        if comp.kind in PARSED_KINDS:
            return registry.get("torch").reader.read(store.location(where), ReadOptions(trust_pickle=options.trust_pickle))
        if comp.kind == WEIGHTS_COPY:
            fmt = "safetensors" if comp.relpath.endswith(".safetensors") else "torch"
            copy = registry.get(fmt).reader.read(store.location(where), ReadOptions(trust_pickle=options.trust_pickle))
            problems += [p for t in copy.tensors.values() for p in _beyond_end(t, where)]
            return copy
        if comp.kind == "args":  # a pickle of TrainingArguments: its archive is checked, never unpickled
            with open_regular(where) as f:
                zipio.read_records(f, where)
    except DataError as exc:
        problems.append(str(exc))
    except OSError as exc:
        problems.append(f"{where}: cannot read ({exc.strerror})")
    return None


def _is_pickle(where: str) -> bool:
    with open_regular(where) as f:
        magic = f.read(4)
    return magic == zipio.ZIP_MAGIC or magic[:1] == b"\x80"


def _beyond_end(t: TensorEntry, where: str) -> list[str]:
    size, end = _size(where), max((p.data.extent()[1] for p in t.pieces), default=0)
    return [f"{where}: tensor '{t.name}' needs bytes up to {end} but the file has {size} (truncated)"] if end > size else []


def _values(ckpt: Any) -> dict[str, Any]:
    """Top-level plain values of a companion read as a torch file."""
    if not isinstance(ckpt, Checkpoint):
        return {}
    return {o.name: o.value for o in ckpt.objects.values() if isinstance(o.value, (int, float, str, bool, list))}


def _framework_state(source: RunSource, objects: dict[str, ObjectEntry]) -> dict[str, Any]:
    """The framework's own counters: trainer_state.json, Lightning's meta.pt or its top-level entries."""
    state: dict[str, Any] = {}
    for comp in source.run.companions:
        value = source.values.get(comp.relpath)
        if comp.kind == "trainer_state" and isinstance(value, dict):
            state |= {k: value[k] for k in ("global_step", "epoch", "max_steps", "train_batch_size") if k in value}
        elif comp.kind == "framework_state":
            state |= {k: v for k, v in _values(value).items() if k in ("global_step", "epoch", "pytorch-lightning_version")}
    if source.run.framework == "lightning":
        for key in ("global_step", "epoch", "pytorch-lightning_version"):
            if key in objects and key not in state:
                state[key] = objects[key].value
    return {k: v for k, v in state.items() if not isinstance(v, bool) and isinstance(v, (int, float, str))}


def _training_state(composite: Checkpoint, primary: Checkpoint, source: RunSource) -> dict[str, Any]:
    state = dict(roles.describe_training_state(primary) if len(source.parts) == 1 else roles.infer_training_state(composite))
    for comp in source.run.companions:
        value = _values(source.values.get(comp.relpath))
        if comp.kind == "scheduler":
            keep = ("last_epoch", "_step_count", "_last_lr", "base_lrs")
            state["lr_scheduler"] = {"file": comp.relpath, **{k: value[k] for k in keep if k in value}}
    rng = [c.relpath for c in source.run.companions if c.kind == "rng"]
    if rng:
        state["rng"] = {"files": rng, "ranks": len(rng)}
    custom = [c.relpath for c in source.run.companions if c.kind == "custom"]
    if custom:
        state["client_state"] = {**(state.get("client_state") or {}), "files": custom}
    state["framework"] = {"name": source.run.framework, **_framework_state(source, composite.objects)}
    return state


def check(ckpt: Checkpoint, deep: bool) -> list[str]:
    """Every part checked by its own reader, every companion that failed to parse, and (deep) the records of every
    zip companion against their CRC32; Python scripts must at least parse (a truncated one seldom does)."""
    source = ckpt.source
    assert isinstance(source, RunSource)
    problems = list(source.problems)
    for part, part_ckpt in source.parts:
        problems += registry.get(part.format).reader.check(part_ckpt, deep)
    problems += _rank_problems(source, ckpt.world_size)
    for comp in source.run.companions:
        where = str(source.run.path / comp.relpath)
        if comp.relpath.endswith(".py"):
            problems += _script_problem(where)
        elif deep and (comp.kind in PARSED_KINDS or comp.kind == "args") and _size(where) > 0:
            problems += crc_problems([where])
    return problems


def _rank_problems(source: RunSource, world: int | None) -> list[str]:
    ranks = sorted(c.rank for c in source.run.companions if c.kind == "rng" and c.rank is not None)
    if not ranks or not world or ranks == list(range(world)):
        return []
    name = next(c.relpath for c in source.run.companions if c.kind == "rng" and c.rank is not None)
    missing = sorted(set(range(world)) - set(ranks))
    extra = sorted(set(ranks) - set(range(world)))
    what = f"missing for ranks {missing}" if missing else f"present for ranks {extra} beyond the world size {world}"
    return [f"{source.run.path}: per-rank files like {name} are {what}"]


def _script_problem(where: str) -> list[str]:
    """A shipped script (DeepSpeed's zero_to_fp32.py) must parse, never run, and still end in its command-line
    entry point: a truncated copy that happens to parse has lost it."""
    try:
        text = read_regular_text(where, JSON_LIMIT)
        tree = ast.parse(text, where)
    except SyntaxError as exc:
        return [f"{where}: not valid Python (line {exc.lineno}): truncated or damaged"]
    except DataError as exc:
        return [str(exc)]
    if Path(where).name.startswith("zero_to_") and not any(_is_main_guard(node) for node in tree.body):
        return [f"{where}: has no 'if __name__ == \"__main__\"' block: truncated or damaged"]
    return []


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    names = [n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)]
    consts = [n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)]
    return "__name__" in names and "__main__" in consts
