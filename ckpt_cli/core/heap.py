"""The heap: freed memory handed back to the system during a long write (glibc; elsewhere a no-op), and the cyclic
collector paused while a read builds its objects.

A wide write makes and drops its segments, archive headers and records a thousand chunks at a time. glibc keeps what
each batch freed inside its arenas, between blocks still alive, so the process's RSS climbs by tens of MB over a
write while its live memory hardly grows (docs/benchmarks.md, "what the DCP write's rise is made of").
malloc_trim(0) returns every whole free page of every arena (madvise); the next batch takes pages back as it needs
them, so it is called once the process has grown by RISE, not after every batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from collections.abc import Callable, Iterator


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None).malloc_trim  # glibc; musl has none
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_size_t]
    call.restype = ctypes.c_int
    return call


_TRIM = _malloc_trim()


def give_back() -> None:
    """Return the free pages of the C heap to the system."""
    if _TRIM is not None:
        _TRIM(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_blocks(threshold: int = 1 << 20) -> None:
    """Blocks of `threshold` bytes and more get pages of their own (mmap), handed back when freed. glibc's threshold
    otherwise rises to each freed block's size (up to 32 MB): after a 16 MB chunk was freed once, the next ones came
    from the arenas and stayed resident when freed (an Orbax read through tensorstore's threads: 255 -> 160 MB).
    Setting it fixes it (glibc then stops moving it); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        call = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    call.argtypes = [ctypes.c_int, ctypes.c_int]
    call.restype = ctypes.c_int
    call(M_MMAP_THRESHOLD, threshold)


RISE = 8 << 20  # what the process may grow by before a batched write gives the heap's free pages back
_RSS_AFTER_TRIM = [0]


def give_back_when_grown() -> None:
    """`give_back` once the resident size has grown by RISE since the last time. A trim after every batch made the
    next batch fault its pages back in: a 1,024-rank DCP write, one small batch a file, made 21,000 madvise calls and
    530,000 page faults (~0.6 s of 14 on this VM), for a rise it did not have."""
    rss = _resident()
    if rss is None or rss - _RSS_AFTER_TRIM[0] >= RISE:
        give_back()
        _RSS_AFTER_TRIM[0] = _resident() or 0


def _resident() -> int | None:
    """This process's resident bytes (Linux /proc/self/statm; elsewhere None)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@contextlib.contextmanager
def collector_paused(pause: bool = True) -> Iterator[None]:
    """No cyclic garbage collection while a read builds its objects (a checkpoint's description, a large pickle's
    value): they are not garbage, and each time the long-lived ones grow by a quarter a full collection walks every
    one of them and finds nothing to free (8 of them, 0.5 of the 1.3 s an MoE ZeRO-2 `inspect` took). Nested pauses
    are one; the collector runs as usual after."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_FREEZE_AFTER_READS = [False]  # set by the CLI (one command a process); a library's caller keeps its collector as is


def freeze_after_reads() -> None:
    """From now on, what a read built leaves the collector's generations once the read is done (`read_done`)."""
    _FREEZE_AFTER_READS[0] = True


def read_done() -> None:
    """After a checkpoint is read in the CLI: its objects move to the collector's permanent generation (gc.freeze),
    where no later collection walks them. They live to the end of the command anyway; an MoE ZeRO-2 `inspect` made
    two full collections of its ~1 million objects (0.3 s) while it built its table."""
    if _FREEZE_AFTER_READS[0]:
        gc.freeze()
