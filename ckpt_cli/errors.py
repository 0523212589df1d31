"""Exceptions that carry their exit code: 1 when the data is wrong, 2 when the call is wrong."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fix:
    """How the caller can act on an error, as an option of the call (`overwrite=True` in Python): the message states
    the facts, and a front end words the fix in its own terms (the CLI: `--overwrite`)."""

    option: str  # the Python keyword; the CLI flag is the same name with dashes
    value: object = True
    why: str = ""  # "to replace it"

    def cli(self) -> str:
        flag = "--" + self.option.replace("_", "-")
        return f"pass {flag}" + ("" if self.value is True else f" {self.value}") + (f" {self.why}" if self.why else "")


class CkptError(Exception):
    """Base class: the message states the facts (what failed, which file); a front end adds how to act on them
    (`fix`, an option of the call; the CLI words it as a flag in `cli_message()`)."""

    exit_code = 1

    def __init__(self, message: str, fix: Fix | None = None) -> None:
        super().__init__(message)
        self.fact, self.fix = message, fix

    def cli_message(self) -> str:
        return self.fact if self.fix is None else f"{self.fact}; {self.fix.cli()}"


class DataError(CkptError):
    """The checkpoint is corrupt, incomplete or inconsistent (exit code 1)."""

    exit_code = 1


class UsageError(CkptError):
    """The call is wrong: bad option, missing path, unknown format (exit code 2)."""

    exit_code = 2


class UnsafePickleError(DataError):
    """A pickle names a global outside the allow list; nothing was executed."""

    def __init__(self, path: str, global_name: str) -> None:
        fact = f"{path}: refusing to load pickled global '{global_name}' (not on the allow list; nothing was executed)"
        super().__init__(fact, Fix("trust_pickle", True, "if you trust this file"))
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


def interrupt_inside(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an exception carries as its cause or context: Python turns one raised inside
    `__set_name__` (a dataclass being made while a module imports, at start-up) into a RuntimeError."""
    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        if isinstance(found, KeyboardInterrupt):
            return found
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return None


# torch is optional: reading, verifying, merging and resharding stream bytes without it
TORCH_INSTALL = "pip install torch (the CPU build: --index-url https://download.pytorch.org/whl/cpu)"
