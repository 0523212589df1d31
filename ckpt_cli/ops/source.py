"""Opening a checkpoint: resolve the path (format, tag), read its metadata, note the choices made."""

from __future__ import annotations

from pathlib import Path

from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint
from ckpt_cli.formats import registry


def open_checkpoint(path: str | Path, format: str | None = None, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    """Read a checkpoint's metadata (no tensor data) from any supported format."""
    resolved = registry.resolve(Path(path), format, tag)
    ckpt = resolved.format.reader.read(resolved.path, ReadOptions(tag=resolved.tag, trust_pickle=trust_pickle))
    if resolved.tag and not ckpt.tag:
        ckpt.tag = resolved.tag
    if resolved.note:
        ckpt.notes.insert(0, resolved.note)
    return ckpt
