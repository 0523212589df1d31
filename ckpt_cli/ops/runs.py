"""Run roots and run checkpoints: listing every checkpoint under a root (`ckpt ls`; the walk is ops/resolve.find,
the choice ops/source.choose), the names a run checkpoint's weights are shown under, and writing a run checkpoint with
its companions (reshard)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_cli import store
from ckpt_cli.core import dtypes
from ckpt_cli.core.model import Checkpoint, FlatRange, Piece, StoredArray, TensorEntry
from ckpt_cli.core.tags import named as tags_named
from ckpt_cli.core.write.plan import OutputFile, TensorData, WritePlan
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import registry
from ckpt_cli.formats.runs import detect as runs
from ckpt_cli.formats.runs import read as run_read
from ckpt_cli.ops.request import Job, Request
from ckpt_cli.ops.resolve import Found, find, relative, root_run, run_of
from ckpt_cli.ops.source import open_found
from ckpt_cli.ops.structure import structure_problems


def shown_step(found: Found, ckpt: Checkpoint) -> int | None:
    """The step shown for a checkpoint (`ckpt ls`, `inspect`): its own, else (a bare core format, a torchtitan step
    folder) the step its name states. Shown only: the checkpoint's own step stays what it holds (diff compares it)."""
    return ckpt.step if ckpt.step is not None or found.framework not in (None, runs.TORCHTITAN) else found.name_step


# ---- ckpt ls ---------------------------------------------------------------------------------------------


def listing(root: Path, trust_pickle: bool = False, format_name: str | None = None, tag: str | None = None) -> list[dict[str, Any]]:
    """One row per checkpoint under `root`, in choose()'s order (oldest first): path, framework, format, step, world size, bytes,
    complete (a quick structural check), problem, newest (the newest complete one of its run), chosen (the one a command
    given `root` itself takes: choose()'s rule, root_run()). `format_name` and `tag`
    keep only the checkpoints of that format and those the tag names (by name or step, or a tag inside a DeepSpeed
    folder); none is then marked newest, since what a run resolves to may be among those left out."""
    rows: list[tuple[str, dict[str, Any]]] = []
    every = find(root)
    for found in every:
        if format_name is not None and found.format != format_name:
            continue
        inner = None
        if tag is not None and not _tag_names(found, tag):
            if found.framework is not None or not registry.get(found.format).own_tags:
                continue  # nor does it name a tag of the folder's own (a DeepSpeed folder's global_stepN)
            inner = tag
        row: dict[str, Any] = {"path": relative(found, root), "framework": found.framework, "format": found.format}
        try:
            try:
                ckpt = open_found(found, inner, trust_pickle)
            except UsageError:
                if inner is None:
                    raise  # a layout ckpt refuses by name: listed below as unsupported
                continue  # the tag names none of the folder's own tags
            if inner is not None:
                row["path"] = f"{row['path']}/{ckpt.tag}"
            problems = structure_problems(ckpt)
            row |= {"step": shown_step(found, ckpt), "world_size": ckpt.world_size, "bytes": sum(max(f.bytes, 0) for f in ckpt.files)}
        except (DataError, UsageError) as exc:  # a UsageError: a layout ckpt refuses by name (runs.FSDP_RANK_FILES, ...)
            problems = [str(exc)]
            row |= {"step": None, "world_size": None, "bytes": _du(found.path), "unsupported": isinstance(exc, UsageError)}
        row.setdefault("unsupported", False)
        row |= {"complete": not problems, "problem": problems[0] if problems else None, "newest": False}
        rows.append((run_of(found, root), row))
    runs_marked = {p for p, _ in rows} if format_name is None and tag is None else set()
    chosen = root_run(root, every) if runs_marked else None
    for parent in runs_marked:  # what choose() takes: the last complete one of each run (one run, one folder)
        complete = [r for p, r in rows if p == parent and r["complete"]]
        if complete:
            complete[-1]["newest"] = True
            complete[-1]["chosen"] = parent == chosen  # what a command given the root itself takes (choose)
    return [{**r, "chosen": r.get("chosen", False)} for _, r in rows]


def _tag_names(found: Found, tag: str) -> bool:
    """Whether `tag` names the checkpoint itself: its name, that name less its suffix, or the step in its name."""
    return bool(tags_named(tag, [found.path.name])) or (tag.isdigit() and found.name_step == int(tag))


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


# ---- writing a run checkpoint ------------------------------------------------------------------------------

PlanOne = Callable[[Checkpoint, Request], Job]


def plan_run(ckpt: Checkpoint, request: Request, plan_one: PlanOne) -> Job:
    """Reshard (or convert to the parts' own format): every part written by its format's writer under its own
    path, the companions copied (per-rank ones re-keyed by the per-rank rule). Any other write (another format,
    weights only, merge): the parts as one checkpoint, model weights under the model's own names; the companions
    are named as not carried."""
    source: run_read.RunSource = ckpt.source
    if request.to is None and any(registry.get(p.format).reshard_by != "world_size" for p, _ in source.parts):
        raise UsageError(
            f"{source.run.path}: this {source.run.framework} checkpoint holds unsharded weights ({source.parts[0][0].relpath or '.'}), "
            "which load at any world size as they are; there is nothing to reshard"
        )
    same_layout = not request.transform.weights_only and all(p.format == (request.to or p.format) for p, _ in source.parts)
    if not same_layout or len({p.format for p, _ in source.parts}) != 1:
        return _plan_export(ckpt, request, plan_one)
    files: list[OutputFile] = []
    notes: list[str] = []
    sources: list[str] = [str(request.src)]
    for part, part_ckpt in source.parts:
        sub = dataclasses.replace(request, dest=request.dest / part.relpath if part.relpath else request.dest)
        job = plan_one(part_ckpt, sub)
        prefix = f"{part.relpath}/" if part.relpath else ""
        files += [dataclasses.replace(f, relpath=prefix + f.relpath) for f in job.plan.files]
        notes += job.notes
        sources += job.sources
    companion_files, companion_notes = _companion_files(source, request)
    plan = WritePlan(source.parts[0][1].format, request.dest, True, files + companion_files)
    companions = tuple(str(source.run.path / c.relpath) for c in source.run.companions)
    return Job(plan, notes + companion_notes, tuple(sources) + companions, source.parts[0][1].format)


def _plan_export(ckpt: Checkpoint, request: Request, plan_one: PlanOne) -> Job:
    source: run_read.RunSource = ckpt.source
    export = request.transform.weights_only or request.to is None or registry.get(request.to).training is None
    view = export_view(ckpt) if export else dataclasses.replace(ckpt, source=source.parts[0][1].source if len(source.parts) == 1 else None)
    job = plan_one(view, request)
    carried = []
    if job.plan.format == "hf":  # the model's config and tokenizer beside its weights, as from_pretrained wants them
        written = {f.relpath for f in job.plan.files}
        carried = [c for c in source.run.companions if c.kind in ("config", "tokenizer") and c.relpath not in written]
        job.plan.files += [OutputFile(c.relpath, [_file_copy(source.run.path / c.relpath)]) for c in carried]
    left = [c.relpath for c in source.run.companions if c not in carried]
    if left:
        job.notes.append(f"not carried ({source.run.framework} files this target cannot hold): {', '.join(left)}")
    return job


def shown(ckpt: Checkpoint) -> Checkpoint:
    """A run checkpoint with its model weights under the names its exports write (export_view's), its source kept:
    the names inspect, --tree and --filter show, so that --select and --strip-prefix read off them act as shown."""
    if not run_read.is_run(ckpt):
        return ckpt
    try:
        tensors = export_view(ckpt).tensors
    except DataError:  # two tensors would share a name: the stored names, which the export refuses
        return ckpt
    renamed = [(old, new) for old, new in zip(ckpt.tensors, tensors) if old != new]
    if not renamed:
        return ckpt
    old, new = renamed[0]
    note = (
        f"names: model weights shown as exports write them, without the {ckpt.source.run.framework} nesting key "
        f"'{old[: len(old) - len(new)]}' (stored as '{old}', shown as '{new}'); --select and --strip-prefix act on the names shown"
    )
    return dataclasses.replace(ckpt, tensors=tensors, notes=[*ckpt.notes, note])


def export_view(ckpt: Checkpoint) -> Checkpoint:
    """The composite with its model weights under the model's own names (the framework's nesting key stripped)."""
    source: run_read.RunSource = ckpt.source
    tensors: dict[str, TensorEntry] = {}
    for name, t in ckpt.tensors.items():
        prefix = source.origin[name].model_prefix
        if t.role == "model" and prefix and name.startswith(prefix):
            key = prefix[:-1]
            path = t.path[1:] if len(t.path) > 1 and str(t.path[0]) == key else (name[len(prefix) :],)
            t = dataclasses.replace(t, name=name[len(prefix) :], path=path)
        if t.name in tensors:
            raise DataError(f"{ckpt.path}: two tensors are both named '{t.name}' once the framework's prefix is removed")
        tensors[t.name] = t
    primary = source.parts[0][1]
    return dataclasses.replace(ckpt, tensors=tensors, source=primary.source if len(source.parts) == 1 else None)


def _companion_files(source: run_read.RunSource, request: Request) -> tuple[list[OutputFile], list[str]]:
    """The companions as verbatim copies; per-rank files re-keyed for the new world size by the per-rank rule."""
    out, notes, ranked = [], [], []
    for comp in source.run.companions:
        path = source.run.path / comp.relpath
        if comp.kind == "args" and not request.source.trust_pickle:
            why = "a pickle of the framework's arguments, outside the allow list; pass --trust-pickle to copy it"
            notes.append(f"not carried: {comp.relpath} ({why})")
        elif comp.kind == "rng" and (comp.rank is not None or source.run.framework == runs.TRAINER):
            ranked.append(comp if comp.rank is not None else dataclasses.replace(comp, rank=0))  # one process: rank 0
        else:
            out.append(OutputFile(comp.relpath, [_file_copy(path)]))
    world, rule = request.write.world_size, request.cross.per_rank
    if ranked and world:
        by_rank = {c.rank: c for c in ranked}
        old = len(by_rank)
        if rule != "drop":
            for r in range(world):
                src = by_rank.get(r % old if rule == "wrap" else 0)
                if src is None:
                    raise DataError(f"{source.run.path}: no per-rank file for rank {r % old} ({ranked[0].relpath} and others)")
                name = _rank_file(src.relpath, r, world, source.run.framework)
                out.append(OutputFile(name, [_file_copy(source.run.path / src.relpath)]))
        if old != world or rule != "wrap":
            how = {"wrap": f"rank r gets rank r mod {old}'s", "first": "every rank gets rank 0's", "drop": "none written"}[rule]
            notes.append(f"per-rank files {_rank_name(ranked[0].relpath, 'R')} ({old} ranks -> {world}): rule '{rule}': {how}")
    elif ranked:
        out += [OutputFile(c.relpath, [_file_copy(source.run.path / c.relpath)]) for c in ranked]
    return out, notes


def _rank_name(name: str, rank: int | str) -> str:
    """rng_state_R.pth / random_states_R.pkl for `rank` (the Trainer's one-process rng_state.pth too)."""
    stem, dot, ext = name.rpartition(".")
    base = re.sub(r"_\d+$", "", stem)
    return f"{base}_{rank}{dot}{ext}"


def _rank_file(name: str, rank: int, world: int, framework: str) -> str:
    """The Trainer reads rng_state.pth in a one-process run and rng_state_R.pth otherwise (trainer.py _load_rng_state)."""
    if framework == runs.TRAINER and world == 1:
        return re.sub(r"_\d+\.pth$", ".pth", _rank_name(name, 0))
    return _rank_name(name, rank)


def _file_copy(path: Path) -> TensorData:
    """A whole file as one byte array, streamed (copy_file_range) by the executor like tensor data."""
    size = store.size(path)
    u8 = dtypes.by_name("uint8")
    data = StoredArray(str(path), 0, u8, (size,), (1,))
    entry = TensorEntry(f"file:{path.name}", u8, (size,), "other", [Piece(FlatRange(0, size), data)])
    return TensorData(entry, u8)
