"""What a write must not replace: an existing destination without --overwrite, and with it a source being read, a
folder holding one, a non-empty folder or a file that is not a checkpoint (every store)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckpt_cli.errors import Fix, UsageError
from ckpt_cli.store.location import is_remote, location


@dataclass(frozen=True)
class Guard:
    """What `--overwrite` must keep: the paths being read (never replaced, nor a folder holding one), and which
    existing folders are checkpoints (`is_checkpoint`; without it, only an empty folder may be replaced)."""

    sources: tuple[str, ...] = ()
    is_checkpoint: Callable[[Path], bool] | None = None


def check_destination(dest: Path, overwrite: bool, output_is_dir: bool, guard: Guard = Guard()) -> None:
    """Refuse (exit 2) an existing `dest` without --overwrite; with it, refuse what replacing would lose: a source
    or a folder holding one, a non-empty folder that is not a checkpoint, a file that is not a checkpoint when
    the output is a folder. `dest` may be in object storage (s3://, a prefix or an object)."""
    dest = location(dest)
    _refuse_inside_a_source(dest, guard.sources)
    if not (dest.exists() if is_remote(dest) else os.path.lexists(dest)):
        return
    if not overwrite:
        raise UsageError(f"{dest} already exists", Fix("overwrite", True, "to replace it"))
    target = _real(dest)
    for source in guard.sources:
        real = _real(location(source))
        if real == target or target in real.parents:
            what = "is the source" if real == target else f"holds the source {source}"
            raise UsageError(f"{dest} {what}; --overwrite never replaces what is being read")
    if dest.is_symlink():
        return  # os.replace swaps the link itself; what it points to stays
    checkpoint = guard.is_checkpoint is not None and guard.is_checkpoint(dest)
    if dest.is_dir() and any(dest.iterdir()) and not checkpoint:
        raise UsageError(f"{dest} is a folder that is neither empty nor a checkpoint; --overwrite replaces only those")
    if not dest.is_dir() and output_is_dir and not checkpoint:
        raise UsageError(f"{dest} is a file that is not a checkpoint; --overwrite replaces it only with a single-file output")


def _refuse_inside_a_source(dest: Path, sources: tuple[str, ...]) -> None:
    """A destination inside a folder being read would become part of that checkpoint (a stray sub-folder that
    `ls` then calls the newest checkpoint, files a later read takes for leftovers): refused, on every store."""
    above = set(_real(dest).parents)
    for source in sources:
        real = _real(location(source))
        if real in above and real.is_dir():
            raise UsageError(f"{dest} is inside the source {source}; write it outside the checkpoint being read")


def _real(path: Path) -> Path:
    """`path` with every symlink resolved (as far as they resolve: a loop stops there)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()
