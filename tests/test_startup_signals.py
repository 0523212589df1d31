"""Ctrl-C at any moment of `ckpt`'s start-up: exit 130 and one line, never a KeyboardInterrupt traceback.

A SIGINT in the first 20 ms (while the entry module imported) printed a traceback. ckpt_cli/__init__.py now takes SIGINT
first. What stays outside any code of ckpt is Python's own start-up before that line (its comment says which): there the
signal either kills the process before Python has a handler (status -SIGINT, nothing printed) or Python prints a
KeyboardInterrupt traceback in which no frame is ckpt's (site, a .pth file, runpy). The tests tolerate exactly that:
a traceback is accepted only when its innermost ckpt frame, if any, is a line of ckpt_cli/__init__.py before the one that
installs the handler.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import ckpt_cli

PACKAGE = Path(ckpt_cli.__file__).resolve().parent
INIT = PACKAGE / "__init__.py"
INSTALL = "_signal.signal(_signal.SIGINT, _stop_at_start)"
INSTALL_LINE = next(n for n, line in enumerate(INIT.read_text().splitlines(), 1) if INSTALL in line)
SCRIPT = Path(sys.executable).parent / "ckpt"
# Ctrl-C as a terminal delivers it: to a process whose SIGINT is not ignored (one started with `&` from a script inherits
# it ignored, and Python then leaves it so)
DELIVERED = {"preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)}
DELAYS_MS = (0, 1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 160, 240, 400)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sig") / "w.safetensors"
    save_file({"w": np.arange(12, dtype=np.float32)}, str(path))
    return path


def _launchers() -> dict[str, list[str]]:
    found = {"python -m ckpt_cli": [sys.executable, "-m", "ckpt_cli"]}
    if SCRIPT.is_file() and "ckpt_cli.cli.entry" in SCRIPT.read_text(errors="replace"):
        found["console script"] = [str(SCRIPT)]
        found["python -X dev <console script>"] = [sys.executable, "-X", "dev", str(SCRIPT)]
    return found


def _before_ckpt(err: str) -> bool:
    """A traceback from before ckpt's handler: no ckpt frame, or the innermost one above the line that installs it."""
    frames = [(Path(f), int(n)) for f, n in re.findall(r'File "([^"]+)", line (\d+)', err)]
    ours = [(f, n) for f, n in frames if f.resolve().is_relative_to(PACKAGE)]
    return not ours or (ours[-1][0].resolve() == INIT.resolve() and ours[-1][1] <= INSTALL_LINE)


def _judge(code: int, err: str, what: str) -> str:
    """'ckpt' when ckpt answered (130 and one line, or 0: it had finished), 'python' for the window before it."""
    if "Traceback" in err or "Fatal Python error" in err:
        assert _before_ckpt(err), f"{what}: a traceback once ckpt's code ran:\n{err}"
        return "python"
    if code == -signal.SIGINT:
        assert err == "", f"{what}: died of SIGINT after printing:\n{err}"
        return "python"  # before the interpreter installed its handler
    assert (code, err) in ((130, "ckpt: error: interrupted\n"), (0, "")), f"{what}: exit {code}\n{err}"
    return "ckpt"


@pytest.mark.parametrize("launcher", sorted(_launchers()))
def test_ctrl_c_at_any_moment_of_start_up_exits_130_without_a_traceback(src, launcher):
    answered = 0
    for delay in DELAYS_MS:
        proc = subprocess.Popen(
            [*_launchers()[launcher], "inspect", str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **DELIVERED
        )
        time.sleep(delay / 1000)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        answered += _judge(proc.returncode, err, f"{launcher}, SIGINT after {delay} ms") == "ckpt"
    assert answered, "no SIGINT reached ckpt's code: the delays are all shorter than Python's start-up here"


# Modules whose import line `-X importtime` prints while ckpt starts: the signal is sent the moment one appears, so it
# lands inside ckpt's own start-up (its package, the entry module, the CLI's imports), not by chance of timing.
MILESTONES = ("ckpt_cli.errors", "ckpt_cli.interrupt", "ckpt_cli.cli.entry", "typer", "ckpt_cli.cli.output", "ckpt_cli.cli.app")


@pytest.mark.parametrize("milestone", MILESTONES)
@pytest.mark.parametrize("launcher", sorted(_launchers()))
def test_ctrl_c_inside_ckpts_own_imports_exits_130(src, launcher, milestone):
    command = _launchers()[launcher]
    command = [sys.executable, "-X", "importtime", *(command[1:] if command[0] == sys.executable else command)]
    proc = subprocess.Popen([*command, "inspect", str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **DELIVERED)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == milestone:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    err = "".join(line for line in seen + rest.splitlines(keepends=True) if not line.startswith("import time:"))
    assert any(milestone in line for line in seen), f"{milestone} was never imported:\n{''.join(seen[-5:])}"
    assert "Traceback" not in err and proc.returncode == 130 and err == "ckpt: error: interrupted\n", (proc.returncode, err)
