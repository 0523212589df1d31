"""A stop request (SIGTERM) that a write honours at safe points, not wherever the signal lands.

An exception raised by a signal handler lands wherever the main thread is: inside an import that
numpy or torch does lazily mid-write, it can be swallowed (the write then commits) or abort the
process (leaving the temporary output). So while a write runs, the CLI's handler only records the
request here; the write engine raises Terminated at its next block and before it commits, and the
temporary output is removed as on Ctrl-C. Outside a write the handler raises at once, except in torch's own code
(its import calls back into Python from C++): there the signal is sent again a moment later (`deferred`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

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


RESEND_S = 0.02
RESENDS = 100  # then raised wherever it lands: a signal is never put off for more than ~2 s
_resent = [0]


def deferred(signum: int, frame: FrameType | None) -> bool:
    """Whether a signal landed in torch's code, where an exception raised by its handler can cross C++ frames
    (pybind11 calling back into Python while torch imports) and abort the process without a word. Then it is sent
    again a moment later, when the main thread has likely left torch; True: the handler should return."""
    torch = sys.modules.get("torch")
    folder = os.path.dirname(getattr(torch, "__file__", None) or "") + os.sep
    while frame is not None and folder != os.sep and _resent[0] < RESENDS:
        if frame.f_code.co_filename.startswith(folder):
            _resent[0] += 1
            resend = threading.Timer(RESEND_S, os.kill, (os.getpid(), signum))
            resend.daemon = True  # a process that ends meanwhile is not kept waiting
            resend.start()
            return True
        frame = frame.f_back
    return False
