"""The `ckpt` entry point: Ctrl-C and SIGTERM handled from the first instruction, heavy imports after.

Importing the CLI pulls in typer, numpy and (for most commands) torch, a second or more of start-up in
which a signal would otherwise print a KeyboardInterrupt traceback or end the process without a word.
Here both become one line and the documented exit code (130 Ctrl-C, 143 SIGTERM) at any moment; once
the CLI runs, its own handlers take over (cli/app.py: a running write stops at a safe point).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

from ckpt_cli import interrupt
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
    try:
        from ckpt_cli.cli import app
        from ckpt_cli.core import heap

        heap.freeze_after_reads()  # one command a process: what it reads lives to its end (core/heap.py)
        app.main(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM before (or after) the CLI's own handling
        sys.exit(_stopped(exc))
    except Exception as exc:  # one wrapped by Python while the CLI's modules import (interrupt_inside)
        stop = interrupt_inside(exc)
        if stop is None:
            raise
        sys.exit(_stopped(stop))


if __name__ == "__main__":
    main()
