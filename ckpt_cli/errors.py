"""Exceptions that carry their exit code: 1 when the data is wrong, 2 when the call is wrong."""

from __future__ import annotations


class CkptError(Exception):
    """Base class: the message states the facts (what failed, which file); a front end adds how to act on them."""

    exit_code = 1


class DataError(CkptError):
    """The checkpoint is corrupt, incomplete or inconsistent (exit code 1)."""

    exit_code = 1


class UsageError(CkptError):
    """The call is wrong: bad option, missing path, unknown format (exit code 2)."""

    exit_code = 2


class UnsafePickleError(DataError):
    """A pickle names a global outside the allow list; nothing was executed."""

    def __init__(self, path: str, global_name: str) -> None:
        super().__init__(f"{path}: refusing to load pickled global '{global_name}' (not on the allow list; nothing was executed)")
        self.path = path
        self.global_name = global_name


class Interrupted(CkptError):
    """Ctrl-C or SIGTERM during a write: the temporary output was removed. Exit code 130 for Ctrl-C and 143 for
    SIGTERM (128 + the signal, as shells and schedulers report a process the signal ended)."""

    exit_code = 130

    def __init__(self, message: str, terminated: bool = False) -> None:
        super().__init__(message)
        self.exit_code = 143 if terminated else 130


class Terminated(KeyboardInterrupt):
    """SIGTERM (how clusters preempt a job), raised in the main thread like Ctrl-C so the same cleanup runs."""


# torch is optional: reading, verifying, merging and resharding stream bytes without it
TORCH_INSTALL = "pip install torch (the CPU build: --index-url https://download.pytorch.org/whl/cpu)"
