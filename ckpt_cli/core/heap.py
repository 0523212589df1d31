"""The heap: freed memory handed back to the system during a long write (glibc; elsewhere a no-op), and the cyclic
collector paused while a read builds its objects.

A wide write makes and drops its segments, archive headers and records a thousand chunks at a time. glibc keeps what
each batch freed inside its arenas, between blocks still alive, so the process's RSS climbs by tens of MB over a
write while its live memory hardly grows (docs/benchmarks.md, "what the DCP write's rise is made of").
malloc_trim(0) returns every whole free page of every arena (madvise); the next batch takes pages back as it needs
them.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
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
