"""Handing freed heap memory back to the system during a long write (glibc; elsewhere a no-op).

A wide write makes and drops its segments, archive headers and records a thousand chunks at a time. glibc keeps what
each batch freed inside its arenas, between blocks still alive, so the process's RSS climbs by tens of MB over a
write while its live memory hardly grows (docs/benchmarks.md, "what the DCP write's rise is made of").
malloc_trim(0) returns every whole free page of every arena (madvise); the next batch takes pages back as it needs
them.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


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
