"""Opening a checkpoint: resolve the path once (ops/resolve: a run root, a run checkpoint, a core format and its tag),
read its metadata, note the choices made."""

from __future__ import annotations

from pathlib import Path

from ckpt_cli.core import heap
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint
from ckpt_cli.formats.runs import read as run_read
from ckpt_cli.ops import runs as run_roots
from ckpt_cli.ops.resolve import Resolved, resolve


def open_checkpoint(
    path: str | Path | Resolved,
    format: str | None = None,
    tag: str | None = None,
    trust_pickle: bool = False,
    layout_only: bool = False,
    pieces_when_read: bool = False,
) -> Checkpoint:
    """Read a checkpoint's metadata (no tensor data) from any supported format or framework run folder; `layout_only`:
    what inspect reports, no more, and `pieces_when_read` (ReadOptions), for a checkpoint named directly. `path`: a
    path string, or the value resolve() made of one (then `format` and `tag` are those it was resolved with)."""
    with heap.collector_paused():  # the read's objects are not garbage: see heap.collector_paused
        resolved = path if isinstance(path, Resolved) else resolve(path, format, tag)
        ckpt = open_resolved(resolved, trust_pickle, layout_only, pieces_when_read)
    heap.read_done()
    return ckpt


def open_resolved(resolved: Resolved, trust_pickle: bool, layout_only: bool = False, pieces_when_read: bool = False) -> Checkpoint:
    """Read what `resolved` names, detecting nothing again: a run root's chosen checkpoint (read whole: the newest
    *complete* one is chosen), a run checkpoint, or a checkpoint of a core format with the note of the run checkpoint
    it is one part of."""
    if resolved.level == "root":
        return run_roots.choose(resolved, trust_pickle)
    if resolved.run is not None:
        return run_read.read(resolved.run, ReadOptions(tag=resolved.tag, trust_pickle=trust_pickle, layout_only=layout_only))
    assert resolved.format is not None  # levels checkpoint and tagged always have one
    where, fmt, forced = resolved.location, resolved.format, resolved.forced
    ckpt = run_roots.open_core(where, fmt, forced, resolved.tag, trust_pickle, layout_only, pieces_when_read)
    if resolved.note:
        ckpt.notes.append(resolved.note)
    return ckpt
