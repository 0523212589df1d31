"""Opening a checkpoint: resolve the path (a run root, a run checkpoint, a core format and its tag), read its
metadata, note the choices made."""

from __future__ import annotations

from pathlib import Path

from ckpt_cli import store
from ckpt_cli.core import heap
from ckpt_cli.core.model import Checkpoint
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import registry
from ckpt_cli.formats.runs import detect as runs
from ckpt_cli.ops import runs as run_roots


def open_checkpoint(
    path: str | Path,
    format: str | None = None,
    tag: str | None = None,
    trust_pickle: bool = False,
    layout_only: bool = False,
    pieces_when_read: bool = False,
) -> Checkpoint:
    """Read a checkpoint's metadata (no tensor data) from any supported format or framework run folder; `layout_only`:
    what inspect reports, no more, and `pieces_when_read` (ReadOptions), for a checkpoint named directly."""
    with heap.collector_paused():  # the read's objects are not garbage: see heap.collector_paused
        ckpt = _open(path, format, tag, trust_pickle, layout_only, pieces_when_read)
    heap.read_done()
    return ckpt


def _open(
    path: str | Path, format: str | None, tag: str | None, trust_pickle: bool, layout_only: bool, pieces_when_read: bool
) -> Checkpoint:
    path = store.location(path)  # s3://bucket/prefix: a store.Location
    store.fresh()  # listings and blocks cached by an earlier command in this process may be stale
    if not store.renames(path):
        problem = missing_marker(path)
        if problem:
            raise DataError(problem)
    if not path.exists():
        raise UsageError(f"{path}: no such file or folder")
    holder = registry.member_of(path) if format is None else None
    if holder is not None:
        folder, fmt = holder
        run = runs.is_part_of(folder)  # the DCP folder of a Trainer or accelerate save: name the whole save
        what, at = (f"the {run[0].framework} checkpoint", run[1]) if run else (f"the {fmt.name} checkpoint", folder)
        raise UsageError(
            f"{path}: one file of {what} {at}, not a checkpoint by itself; point at that folder "
            "(or name --format to read this one file alone)"
        )
    itself = runs.detect(path) is not None or (registry.detect(path) is not None and not run_roots.holds_others(path))
    if format is not None or itself:
        ckpt = run_roots.open_exact(path, format, tag, trust_pickle, layout_only, pieces_when_read)
        note = run_roots.part_note(path) if format is None and not runs.detect(path) else None
        if note:
            ckpt.notes.append(note)
        return ckpt
    found = run_roots.find(path) if path.is_dir() else []
    if not found:
        raise UsageError(run_roots.not_found_message(path))
    return run_roots.choose(path, found, tag, trust_pickle)  # read whole: the newest *complete* one is chosen


def missing_marker(path: Path) -> str | None:
    """Why a prefix in object storage holds an unfinished write: data objects without the commit marker that a
    write uploads last (each format's `Commit` in the registry: DCP `.metadata`, the hf index, DeepSpeed `latest`).
    Object storage has no rename, so the marker is all that tells a finished checkpoint from an interrupted one
    (locally a write is renamed into place)."""
    if not path.is_dir():
        return None
    entries = {p.name: p for p in path.iterdir()}  # one listing for every format's check
    commit = next((f.commit for f in registry.FORMATS.values() if f.commit is not None and f.commit.missing(entries)), None)
    if commit is None:
        return None
    what, has, marker = commit.what, commit.has, commit.shown
    pending = len(store.unfinished(path))
    uploads = f", {pending} upload(s) never completed" if pending else ""
    return (
        f"{path}: incomplete {what}: {has} but no {marker}, the commit marker a write uploads last{uploads}; "
        "a write was interrupted or is still running (rerun it with --overwrite)"
    )
