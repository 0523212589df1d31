"""Exceptions that carry their exit code: 1 when the data is wrong, 2 when the call is wrong."""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass

# Who reads the messages: the CLI (options as flags, `--world-size`) or a Python caller (as keyword arguments,
# `world_size`). Messages are written once, naming options as the CLI's flags; the API's names are the same words
# with `_` for `-` (ckpt_cli/options.py), so a message is worded for a Python caller by rewriting each flag.
_READER: contextvars.ContextVar[str] = contextvars.ContextVar("ckpt_reader", default="api")
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
_CLI_SPANS = re.compile(r"`[^`]*`|\bckpt [a-z]+ [^);]*")  # a command line quoted in a message stays a command line


def for_cli() -> contextvars.Token[str]:
    """Word messages for the CLI (flags) from here on in this context; the CLI's main sets it, and resets it after."""
    return _READER.set("cli")


def reset_reader(token: contextvars.Token[str]) -> None:
    _READER.reset(token)


def worded(text: str) -> str:
    """`text` (written with the CLI's flags) for whoever reads it now: unchanged for the CLI, else `api_words(text)`."""
    return text if _READER.get() == "cli" else api_words(text)


def api_words(text: str) -> str:
    """`text` for a Python caller: each option flag becomes its keyword name (`--world-size N` -> `world_size N`),
    quoted command lines aside."""

    def rewrite(part: str) -> str:
        return _FLAG.sub(lambda m: m.group(1).replace("-", "_"), part)

    out, last = [], 0
    for span in _CLI_SPANS.finditer(text):
        out += [rewrite(text[last : span.start()]), span.group(0)]
        last = span.end()
    out.append(rewrite(text[last:]))
    return "".join(out)


@dataclass(frozen=True)
class Fix:
    """How the caller can act on an error, as an option of the call: the message states the facts, and the fix is
    worded for its reader (the CLI: `pass --overwrite`; Python: `pass overwrite=True`)."""

    option: str  # the Python keyword; the CLI flag is the same name with dashes
    value: object = True
    why: str = ""  # "to replace it"

    def cli(self) -> str:
        flag = "--" + self.option.replace("_", "-")
        return f"pass {flag}" + ("" if self.value is True else f" {self.value}") + (f" {self.why}" if self.why else "")

    def api(self) -> str:
        return f"pass {self.option}={self.value!r}" + (f" {self.why}" if self.why else "")


class CkptError(Exception):
    """Base class: the message states the facts (what failed, which file) naming options as the CLI's flags, and how to
    act on them (`fix`, an option of the call). `str(exc)` words both for whoever reads it (errors.worded): a Python
    caller reads keyword names (`world_size`, `pass overwrite=True`), the CLI flags (`cli_message()`)."""

    exit_code = 1

    def __init__(self, message: str, fix: Fix | None = None) -> None:
        super().__init__(message)
        self.fact, self.fix = message, fix

    def cli_message(self) -> str:
        return self.fact if self.fix is None else f"{self.fact}; {self.fix.cli()}"

    def api_message(self) -> str:
        fact = api_words(self.fact)
        return fact if self.fix is None else f"{fact}; {self.fix.api()}"

    def __str__(self) -> str:
        return self.cli_message() if _READER.get() == "cli" else self.api_message()


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
