"""Write into a temporary sibling and rename at the end, so a crash never leaves a destination
that looks complete; and never let `--overwrite` replace what it must keep.

The temporary sibling of `X` is `.X.ckpt-partial-OWNER`: OWNER is the writing process's PID, or `ranks` for
the one folder the ranks of a torchrun job share. A process killed outright (SIGKILL, a lost node) leaves
its partial behind: the next write to the same destination removes the partials whose process is gone
(os.kill(pid, 0)), and `verify` reports them. A file is committed with one os.replace; a folder replacing
an old one is swapped with it in one step (renameat2 RENAME_EXCHANGE) where the system can, else
renamed aside first.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ckpt_cli.core import interrupt, storage
from ckpt_cli.errors import UsageError

PARTIAL = ".ckpt-partial-"
OLD = ".ckpt-old-"  # the old destination moved aside, where a folder cannot be swapped in one step


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
    dest = storage.location(dest)
    _refuse_inside_a_source(dest, guard.sources)
    if not (dest.exists() if storage.is_remote(dest) else os.path.lexists(dest)):
        return
    if not overwrite:
        raise UsageError(f"{dest} already exists; pass --overwrite to replace it")
    target = _real(dest)
    for source in guard.sources:
        real = _real(storage.location(source))
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
        real = _real(storage.location(source))
        if real in above and real.is_dir():
            raise UsageError(f"{dest} is inside the source {source}; write it outside the checkpoint being read")


def _real(path: Path) -> Path:
    """`path` with every symlink resolved (as far as they resolve: a loop stops there)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def partial_path(dest: Path, owner: str) -> Path:
    return dest.parent / f".{dest.name}{PARTIAL}{owner}"


def process_gone(owner: str) -> bool:
    """Whether the process named by a partial's OWNER has ended (`ranks` and other names: not known, so False)."""
    if not owner.isdigit():
        return False
    pid = int(owner)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OverflowError:  # no process can have such a PID
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def temporaries(dest: Path) -> list[tuple[Path, str]]:
    """(path, owner) of every temporary sibling of `dest` a ckpt write made (partials and old destinations)."""
    try:
        names = sorted(os.listdir(dest.parent))
    except OSError:
        return []
    found = []
    for name in names:
        for marker in (PARTIAL, OLD):
            prefix = f".{dest.name}{marker}"
            if name.startswith(prefix):
                found.append((dest.parent / name, name[len(prefix) :]))
    return found


def leftovers(dest: Path) -> list[Path]:
    """Temporary siblings of `dest` whose writer is gone, and torchrun ones (interrupted, or a job still running)."""
    return [path for path, owner in temporaries(dest) if process_gone(owner) or owner == "ranks"]


def remove_stale(dest: Path) -> None:
    """Remove the temporary siblings of `dest` left by ckpt processes that no longer run."""
    for path, owner in temporaries(dest):
        if process_gone(owner):
            remove(path)


def prepare_partial(dest: Path, is_dir: bool, overwrite: bool, owner: str, guard: Guard = Guard()) -> Path:
    """A fresh temporary sibling of `dest` named after `owner` (a pid, or one name shared by all ranks)."""
    check_destination(dest, overwrite, is_dir, guard)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dest)
    tmp = partial_path(dest, owner)
    remove(tmp)
    if is_dir:
        tmp.mkdir()
    return tmp


@cache
def _renameat2() -> Callable[[Path, Path], bool] | None:
    """renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) through libc (Linux; Python's os module lacks it)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
        call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    except (OSError, AttributeError):
        return None
    at_fdcwd, rename_exchange = -100, 2
    return lambda a, b: call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where the system or filesystem cannot."""
    swap = _renameat2()
    return swap is not None and swap(a, b)


def commit(tmp: Path, dest: Path) -> None:
    """Make the finished temporary the destination, replacing an old one only once the new one is complete:
    one os.replace for a file over a file (or nothing), one swap for a folder, two renames where no swap exists."""
    dest_is_dir = dest.is_dir() and not dest.is_symlink()
    if not os.path.lexists(dest) or (not tmp.is_dir() and not dest_is_dir):
        os.replace(tmp, dest)
        return
    if _exchange(tmp, dest):
        remove(tmp)  # the old destination, now under the temporary name
        return
    old = dest.parent / f".{dest.name}{OLD}{os.getpid()}"
    os.replace(dest, old)
    os.replace(tmp, dest)
    remove(old)


@contextmanager
def staged(dest: Path, is_dir: bool, overwrite: bool, guard: Guard = Guard()) -> Iterator[Path]:
    """Yield a temporary path next to `dest`; on success it replaces `dest`, on failure it is removed."""
    tmp = prepare_partial(dest, is_dir, overwrite, str(os.getpid()), guard)
    try:
        with interrupt.writing():
            yield tmp
            interrupt.check()  # a SIGTERM during the last blocks: commit nothing
    except BaseException:
        remove(tmp)
        raise
    commit(tmp, dest)
