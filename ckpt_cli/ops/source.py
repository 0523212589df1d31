"""Opening a checkpoint: resolve the path (a run root, a run checkpoint, a core format and its tag), read its
metadata, note the choices made."""

from __future__ import annotations

from pathlib import Path

from ckpt_cli.core.model import Checkpoint
from ckpt_cli.errors import UsageError
from ckpt_cli.formats import registry, runs
from ckpt_cli.ops import runs as run_roots


def open_checkpoint(path: str | Path, format: str | None = None, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    """Read a checkpoint's metadata (no tensor data) from any supported format or framework run folder."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file or folder")
    if format is not None or runs.detect(path) is not None or registry.detect(path) is not None:
        ckpt = run_roots.open_exact(path, format, tag, trust_pickle)
        note = run_roots.part_note(path) if format is None and not runs.detect(path) else None
        if note:
            ckpt.notes.append(note)
        return ckpt
    found = run_roots.find(path) if path.is_dir() else []
    if not found:
        raise UsageError(run_roots.not_found_message(path))
    return run_roots.choose(path, found, tag, trust_pickle)
