"""The typer application, and `main`, which maps errors to one line and an exit code."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer

from ckpt_cli import __version__, interrupt
from ckpt_cli.cli import completion_cmd, convert_cmd, demo_cmd, diff_cmd, inspect_cmd, ls_cmd, parity_cmd, verify_cmd
from ckpt_cli.cli.examples import epilog
from ckpt_cli.cli.output import error
from ckpt_cli.errors import TORCH_INSTALL, CkptError, Terminated, for_cli, interrupt_inside, reset_reader

try:  # typer >= 0.29 vendors click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors  # type: ignore[no-redef]  # the same module, unvendored

app = typer.Typer(
    name="ckpt",
    help="Inspect, verify and convert training checkpoints: DCP, DeepSpeed ZeRO, Hugging Face, safetensors, torch.\n\n"
    "New here? 'ckpt demo demo' writes small real checkpoints of every format to try each command on.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckpt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True, help="Show the version and exit."),
) -> None:
    """Inspect, verify and convert training checkpoints."""


app.command("inspect", epilog=epilog("inspect"))(inspect_cmd.inspect)
app.command("verify", epilog=epilog("verify"))(verify_cmd.verify)
app.command("convert", epilog=epilog("convert"))(convert_cmd.convert)
app.command("reshard", epilog=epilog("reshard"))(convert_cmd.reshard)
app.command("merge", epilog=epilog("merge"))(convert_cmd.merge)
app.command("split", epilog=epilog("split"))(convert_cmd.split)
app.command("demo", epilog=epilog("demo"))(demo_cmd.demo)
app.command("ls", epilog=epilog("ls"))(ls_cmd.ls)
app.command("diff", epilog=epilog("diff"))(diff_cmd.diff)
app.command("parity", epilog=epilog("parity"))(parity_cmd.parity)
app.command("completion", epilog=epilog("completion"))(completion_cmd.completion)


def _on_sigterm(signum: int, frame: Any) -> None:
    if interrupt.deferred(signum, frame):  # in torch's code: raised there, it could abort the process
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    if not interrupt.request():  # a running write stops at its next block (ckpt_cli/interrupt.py says why)
        raise Terminated


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated (a KeyboardInterrupt) in the main thread while the CLI runs, so a preempted job
    removes its temporary output as Ctrl-C does; the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupt.reset()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminated(exc: BaseException) -> bool:
    """Whether SIGTERM caused `exc` (click turns a KeyboardInterrupt into Abort, keeping it as the cause)."""
    return isinstance(exc, Terminated) or isinstance(exc.__cause__, Terminated)


def _stopped(exc: BaseException) -> int:
    """Say which signal stopped the command; its exit code."""
    error("terminated (SIGTERM)" if _terminated(exc) else "interrupted")
    return 143 if _terminated(exc) else 130


def usage_line(exc: click_errors.UsageError, argv: list[str]) -> str:
    """A usage error as one line, as every other error: click's message (missing option, bad value, unknown
    command...) and where the help is, not click's four lines of Usage, Try and Error."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    message = message[:1].lower() + message[1:]
    if exc.ctx is not None:
        where = exc.ctx.command_path
    else:  # an option's missing value is found before the command's context exists
        named = {command.name for command in app.registered_commands}
        where = " ".join(["ckpt", *(arg for arg in argv[:1] if arg in named)])
    return f"{message} (see '{where} --help')"


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; exit 0 on success, 1 when the data is wrong, 2 when the call is wrong, 130 on Ctrl-C, 143 on SIGTERM."""
    reader = for_cli()  # messages name options as flags while the CLI runs (errors.worded)
    try:
        with _sigterm_as_interrupt():
            code = _run(argv)
    finally:
        reset_reader(reader)
    sys.exit(code)


def _run(argv: list[str] | None) -> int:
    debug = bool(os.environ.get("CKPT_DEBUG"))
    try:
        code = app(args=argv, prog_name="ckpt", standalone_mode=False)
        if code == 130:  # typer turns a KeyboardInterrupt in a command into a silent Exit(130), SIGTERM's included
            error("terminated (SIGTERM)" if interrupt.requested() else "interrupted")
            code = 143 if interrupt.requested() else 130
    except CkptError as exc:
        if debug:
            raise
        error(exc.cli_message())
        code = exc.exit_code
    except click_errors.NoArgsIsHelpError as exc:  # bare `ckpt`: the help itself
        exc.show()
        code = 2
    except click_errors.UsageError as exc:
        error(usage_line(exc, sys.argv[1:] if argv is None else argv))
        code = 2
    except click_errors.ClickException as exc:
        error(" ".join(exc.format_message().split()))
        code = exc.exit_code
    except (KeyboardInterrupt, typer.Abort) as exc:
        code = _stopped(exc)
    except OSError as exc:
        if debug:
            raise
        error(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))
        code = 1
    except Exception as exc:  # a bug in ckpt: still one line, the traceback on request
        if debug:
            raise
        stop = interrupt_inside(exc)
        if stop is not None:  # a signal that landed where Python wraps it (an import at start-up)
            return _stopped(stop)
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch":
            error(f"this needs torch, which is not installed: {TORCH_INSTALL}")
            code = 2
        else:
            error(f"internal error: {type(exc).__name__}: {exc} (set CKPT_DEBUG=1 for the traceback)")
            code = 1
    return code if isinstance(code, int) else 0
