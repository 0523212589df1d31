"""A stop request (SIGTERM) that a write honours at safe points, not wherever the signal lands.

An exception raised by a signal handler lands wherever the main thread is: inside an import that
numpy or torch does lazily mid-write, it can be swallowed (the write then commits) or abort the
process (leaving the temporary output). So while a write runs, the CLI's handler only records the
request here; the write engine raises Terminated at its next block and before it commits, and the
temporary output is removed as on Ctrl-C.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ckpt_cli.errors import Terminated

_requested = threading.Event()
_lock = threading.Lock()
_writes = 0


def request() -> bool:
    """Record a stop request; True when a write is running and will stop at its next safe point."""
    _requested.set()
    with _lock:
        return _writes > 0


def check() -> None:
    """Raise Terminated when a stop was requested (called once per block written, and before a commit)."""
    if _requested.is_set():
        raise Terminated


def requested() -> bool:
    """Whether a stop (SIGTERM) was requested during this run."""
    return _requested.is_set()


def reset() -> None:
    """Forget a request (a new CLI run in the same process)."""
    _requested.clear()


@contextmanager
def writing() -> Iterator[None]:
    """Mark a write as running, so that a stop request waits for one of its safe points."""
    global _writes
    with _lock:
        _writes += 1
    try:
        yield
    finally:
        with _lock:
            _writes -= 1
