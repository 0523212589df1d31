"""When a file was created (its birth time): a hint, never a verdict, on a data file changed after its metadata.

A save rewrites an existing file in place (open with "wb" truncates the same inode): its modification time moves,
its birth time does not. A data file born before the metadata file and modified after it may therefore have been
rewritten after the metadata was committed (a re-save that did not reach its commit). But a copy made in that
order and then touched (a parallel download or a sync that wrote `.metadata` last, then `find -exec touch` against
a scratch purge) shows the very same times, and a copy's times are whatever the copy tool gave: times say nothing
certain about a copy. The structural and CRC checks decide whether a checkpoint is whole; these times give a
note at most (`rewrite_note`). Where the file system or platform keeps no birth times, None (nothing is guessed).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

_AT_FDCWD = -100
_STATX_BTIME = 0x800
_BTIME_OFFSET = 80  # struct statx: stx_btime (tv_sec i64, tv_nsec u32) after 64 bytes of fields and stx_atime
_STATX_SIZE = 256


@lru_cache(maxsize=1)
def _statx():  # noqa: ANN202 - a ctypes function or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # glibc before 2.28, musl without statx
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def birth_time_ns(path: Path) -> int | None:
    """The file's creation time in nanoseconds, or None when the platform or file system does not keep it."""
    native = getattr(os.stat(path), "st_birthtime_ns", None)  # macOS, BSD, Windows; Linux from Python 3.14?
    if native:
        return int(native)
    statx = _statx()
    if statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_BTIME, buf) != 0:
        return None
    mask = int.from_bytes(buf.raw[0:4], sys.byteorder)
    if not mask & _STATX_BTIME:
        return None
    seconds = int.from_bytes(buf.raw[_BTIME_OFFSET : _BTIME_OFFSET + 8], sys.byteorder, signed=True)
    nanos = int.from_bytes(buf.raw[_BTIME_OFFSET + 8 : _BTIME_OFFSET + 12], sys.byteorder)
    return seconds * 1_000_000_000 + nanos


def rewritten_after(data: Path, metadata: Path) -> bool:
    """True when `data` existed before `metadata` was created and was modified after `metadata` was: written in
    place after the commit, or copied before it and touched since (the times cannot tell which). False for a copy
    that made each file new without touching it, and when birth times are unknown."""
    data_birth, meta_birth = birth_time_ns(data), birth_time_ns(metadata)
    if data_birth is None or meta_birth is None:
        return False
    return data_birth < meta_birth and data.stat().st_mtime_ns > metadata.stat().st_mtime_ns


def rewrite_note(data_files: Iterable[Path], metadata: Path) -> str | None:
    """A note (never a problem) when data files were modified after `metadata` though created before it."""
    found = [p for p in data_files if p.exists() and rewritten_after(p, metadata)]
    if not found:
        return None
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return (
        f"{found[0]}{more}: modified after {metadata.name} though created before it; a copy touched since (as on a "
        f"purged scratch file system) does this, and so does a re-save that died before writing {metadata.name}. "
        "The times cannot tell which, so they fail nothing; if a re-save may have died here, check against a manifest "
        "recorded before it (--manifest FILE)"
    )
