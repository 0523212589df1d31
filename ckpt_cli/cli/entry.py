"""The `ckpt` entry point: Ctrl-C and SIGTERM handled from the first instruction, heavy imports after.

Ctrl-C is taken first by ckpt_cli/__init__.py (its top lines, which say what window of Python's own start-up remains):
it exits 130 at once until `main` releases it to KeyboardInterrupt inside the `try` below, and again once the command
has returned.

Importing the CLI pulls in typer, numpy and (for most commands) torch, a second or more of start-up in
which a signal would otherwise print a KeyboardInterrupt traceback or end the process without a word.
Here both become one line and the documented exit code (130 Ctrl-C, 143 SIGTERM) at any moment; once
the CLI runs, its own handlers take over (cli/app.py: a running write stops at a safe point).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from types import FrameType
from typing import NoReturn

from ckpt_cli import hold_sigint, interrupt, release_sigint
from ckpt_cli.errors import Terminated, interrupt_inside


def _early_sigterm(signum: int, frame: FrameType | None) -> None:
    if interrupt.deferred(signum, frame):  # in torch's import: raised there, it could abort the process
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def _stopped(exc: BaseException) -> int:
    terminated = isinstance(exc, Terminated) or isinstance(exc.__cause__, Terminated)
    sys.stderr.write("ckpt: error: terminated (SIGTERM)\n" if terminated else "ckpt: error: interrupted\n")
    return 143 if terminated else 130


def main(argv: list[str] | None = None) -> None:
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # an embedding program's own handler is kept
        signal.signal(signal.SIGTERM, _early_sigterm)
    # A Ctrl-C between importlib's open() of a module's .py or .pyc and its `with` drops the file unclosed; under -X dev
    # Python would print a ResourceWarning about its own file above ckpt's one line
    warnings.filterwarnings("ignore", category=ResourceWarning, message=r"unclosed file <_io\.BufferedReader name='.*\.pyc?'>")
    try:
        release_sigint()  # held since ckpt_cli/__init__.py: from here Ctrl-C is a KeyboardInterrupt, reported below
        from ckpt_cli.cli import app
        from ckpt_cli.core import heap

        heap.freeze_after_reads()  # one command a process: what it reads lives to its end (core/heap.py)
        app.main(argv)
    except SystemExit as exc:
        _leave(exc)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM before (or after) the CLI's own handling
        _leave(SystemExit(_stopped(exc)))
    except Exception as exc:  # one wrapped by Python while the CLI's modules import (interrupt_inside)
        stop = interrupt_inside(exc)
        if stop is None:
            raise
        _leave(SystemExit(_stopped(stop)))
    finally:
        hold_sigint()  # the command has returned: a Ctrl-C while the interpreter shuts down exits 130, without a traceback


def _leave(exit: SystemExit) -> NoReturn:
    """Exit as `exit` says. The `ckpt` process, stopped by Ctrl-C or SIGTERM (its temporary output already removed),
    leaves at once: CPython (3.11) marks a KeyboardInterrupt raised inside eval() of a string (typer evaluating
    annotations) as unhandled even once caught, and would end the process by SIGINT (status -2), not 130 or 143."""
    if exit.code in (130, 143) and hold_sigint():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, RuntimeError):  # a closed pipe, a flush this signal interrupted
                pass
        os._exit(exit.code)
    raise exit


if __name__ == "__main__":
    main()
