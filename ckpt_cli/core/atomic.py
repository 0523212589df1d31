"""Write into a temporary sibling and rename at the end, so a crash never leaves a destination
that looks complete."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ckpt_cli.errors import UsageError


def check_destination(dest: Path, overwrite: bool) -> None:
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise UsageError(f"{dest} already exists; pass --overwrite to replace it")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def prepare_partial(dest: Path, is_dir: bool, overwrite: bool, owner: str) -> Path:
    """A fresh temporary sibling of `dest` named after `owner` (a pid, or one name shared by all ranks)."""
    check_destination(dest, overwrite)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.ckpt-partial-{owner}"
    remove(tmp)
    if is_dir:
        tmp.mkdir()
    return tmp


def commit(tmp: Path, dest: Path) -> None:
    """Make the finished temporary the destination, replacing an old one only once the new one is complete."""
    old = dest.parent / f".{dest.name}.ckpt-old-{os.getpid()}"
    if dest.exists() or dest.is_symlink():
        os.replace(dest, old)
    os.replace(tmp, dest)
    remove(old)


@contextmanager
def staged(dest: Path, is_dir: bool, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary path next to `dest`; on success it replaces `dest`, on failure it is removed."""
    tmp = prepare_partial(dest, is_dir, overwrite, str(os.getpid()))
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    commit(tmp, dest)
