"""ckpt: inspect, verify and convert training checkpoints (DCP, DeepSpeed, Hugging Face, safetensors, torch).

The Python API (ckpt_cli/api.py): `ckpt_cli.open(path)` for metadata and streamed tensor reads, and
`convert`, `reshard`, `merge`, `split`, `verify`, `inspect`, `diff`, `parity` as functions returning the reports the CLI prints.
The library never imports typer, rich or tqdm; those belong to `ckpt_cli.cli`.
"""

from __future__ import annotations

# Ctrl-C while `ckpt` starts, first of all: before ckpt's errors module pulls in dataclasses (and the CLI typer, numpy,
# torch), a process that is the `ckpt` command (`python -m ckpt_cli`, the console script) exits 130 with one line on
# SIGINT, never a KeyboardInterrupt traceback; nothing is written yet, so nothing needs cleaning up. cli/entry.py hands
# SIGINT back to KeyboardInterrupt where its `try` reports it (release_sigint), and takes it again for the interpreter's
# shutdown (hold_sigint). Importing ckpt as a library changes no handler.
# What no code of ckpt can cover: Python's own start-up before the `_signal.signal` call below. Before the interpreter
# installs its SIGINT handler, the signal kills the process silently (status -2; a shell shows 130). After that, `site`
# and the .pth files it runs (an editable install's finder imports pathlib and urllib: tens of ms on a busy machine),
# runpy finding this package (-m) or the console script's `import re`: a KeyboardInterrupt there is printed by Python
# with a traceback in which no frame is ckpt's, then the process dies of SIGINT. `-X` options change none of it.
import _signal  # already loaded by the interpreter: no file is searched for
import os as _os  # loaded by site
import sys as _sys


def _stop_at_start(signum: int, frame: object) -> None:
    """SIGINT while ckpt starts (or shuts down after its command returned): one line, exit 130 at once."""
    try:
        _sys.stdout.flush()  # what a finished command printed
    except BaseException:  # noqa: S110  # a flush this signal interrupted: exiting is what matters
        pass
    _os.write(2, b"ckpt: error: interrupted\n")
    _os._exit(130)


def _is_cli() -> bool:
    """This process runs the `ckpt` command: `python -m ckpt_cli[...]` (runpy imports this package while argv[0] is
    still '-m'), or a console script whose file imports ckpt's entry point (it is importing it now)."""
    argv = getattr(_sys, "orig_argv", [])
    if _sys.argv[:1] == ["-m"]:
        at = argv.index("-m") + 1 if "-m" in argv else len(argv)
        module = argv[at] if at < len(argv) else next((a[2:] for a in argv if a.startswith("-m")), "")
        return module.split(".")[0] == "ckpt_cli"
    script = getattr(_sys.modules.get("__main__"), "__file__", None)
    if not script or script.endswith(".py") or hasattr(_sys.modules["__main__"], "main"):
        return False
    try:
        with open(script, "rb") as f:
            return b"from ckpt_cli.cli.entry import main" in f.read(4096)
    except OSError:
        return False


def _hold_at_start() -> bool:
    """Take SIGINT first, then ask whether this is the CLI (reading the script takes a moment): if not, give it back."""
    if _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler:  # an embedding program's own handler
        return False
    try:
        _signal.signal(_signal.SIGINT, _stop_at_start)  # tests/test_startup_signals.py: the line before this one
    except ValueError:  # imported from another thread than the main one
        return False
    if _is_cli():
        return True
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    return False


_HELD = _hold_at_start()


def release_sigint() -> None:
    """Ctrl-C raises KeyboardInterrupt again (cli/entry.py, inside the `try` that reports it); a no-op unless held."""
    if _HELD:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


def hold_sigint() -> bool:
    """Ctrl-C exits 130 at once again: the command has returned and the interpreter shuts down. Whether ckpt holds
    SIGINT at all (this process is the `ckpt` command); if not, a no-op."""
    if _HELD:
        _signal.signal(_signal.SIGINT, _stop_at_start)
    return _HELD


from ckpt_cli.errors import CkptError, DataError, UnsafePickleError, UsageError  # noqa: E402

_API: tuple[str, ...]
_API = ("Checkpoint", "Report", "TensorInfo", "Tree", "WriteReport", "convert", "diff", "inspect", "merge", "open", "reshard")
_API += ("split", "verify", "Request", "PreparedWrite", "prepare", "write", "convert_request", "reshard_request")
_API += ("merge_request", "split_request", "parity", "ParityReport")


def __getattr__(name: str) -> object:  # no typing import: ckpt starts without it (cli/entry.py)
    """The API is imported on first use, so that `ckpt` can handle Ctrl-C before its heavy imports (cli/entry.py)."""
    if name in _API:
        from ckpt_cli import api

        return getattr(api, name)
    if name == "open_checkpoint":
        from ckpt_cli.ops.source import open_checkpoint

        return open_checkpoint
    raise AttributeError(f"module 'ckpt_cli' has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = ["CkptError", "DataError", "UnsafePickleError", "UsageError", "__version__", "open_checkpoint", *_API]
