"""Every way a call can be wrong answers one line on stderr, `ckpt: error: ...` as every other error, and exit 2.

Usage errors (click's: a missing option or argument, a bad value, an unknown option or command) were four lines
(`Usage: ...`, `Try ...`, a blank line, `Error: ...`). Writing into a place that cannot be written named the hidden
temporary sibling (`/proc/.x.ckpt-partial-NNNN`) and exited 1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import run_subprocess
from safetensors.numpy import save_file


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.safetensors"
    save_file({"a.weight": np.ones((4, 4), np.float32), "b.weight": np.arange(8, dtype=np.float32)}, str(path))
    return path


# (kind, arguments with {src} and {out}, what the line names)
USAGE = [
    ("missing option", "convert {src} {out}", "missing option '--to'"),
    ("missing argument", "convert {src}", "missing argument 'DST'"),
    ("missing argument", "reshard", "missing argument 'SRC'"),
    ("missing argument", "inspect", "missing argument 'SRC'"),
    ("missing argument", "diff {src}", "missing argument"),
    ("missing argument", "merge {src}", "missing argument 'DST'"),
    ("missing argument", "demo", "missing argument 'DIR'"),
    ("bad choice", "completion tcsh", "'tcsh' is not one of"),
    ("bad choice", "convert {src} {out} --to nosuch", "nosuch"),
    ("bad choice", "convert {src} {out} --to hf --dtype fp12", "fp12"),
    ("bad choice", "inspect {src} --format nosuch", "nosuch"),
    ("unknown option", "inspect {src} --bogus", "no such option: --bogus"),
    ("unknown option", "split {src} {out} --shards 2", "no such option: --shards"),
    ("unknown option", "verify {src} --depp", "no such option: --depp"),
    ("unknown option", "--bogus", "no such option: --bogus"),
    ("bad integer", "reshard {src} {out} --world-size abc", "'--world-size'"),
    ("bad integer", "split {src} {out} --num-shards 1.5", "'--num-shards'"),
    ("bad integer", "reshard {src} {out} --world-size 0", "'--world-size'"),
    ("bad integer", "convert {src} {out} --to deepspeed --zero-stage 4", "'--zero-stage'"),
    ("bad number", "verify {src} --against {src} --atol x", "'--atol'"),
    ("bad size", "split {src} {out} --max-shard-size 5XB", "5XB"),
    ("unknown command", "frobnicate", "no such command 'frobnicate'"),
    ("unknown command", "inspec {src}", "no such command 'inspec'"),
    ("missing value", "inspect {src} --tag", "'--tag' requires an argument"),
    ("missing value", "convert {src} {out} --to", "'--to' requires an argument"),
]


def _one_usage_line(err: str, out: str, names: str) -> None:
    assert out == "", out
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("ckpt: error: ") and names in err, err
    assert "Usage:" not in err and "Try '" not in err and "Traceback" not in err, err


@pytest.mark.parametrize(("kind", "args", "names"), USAGE, ids=[f"{k}: {a}" for k, a, _ in USAGE])
def test_a_usage_error_is_one_line_and_exit_2(ckpt, small, tmp_path, kind, args, names):
    res = ckpt(*args.format(src=small, out=tmp_path / "out").split())
    assert res.code == 2, (kind, res.err)
    _one_usage_line(res.err, res.out, names)
    assert not (tmp_path / "out").exists()


def test_a_usage_error_points_at_the_help_of_its_command(ckpt, small, tmp_path):
    assert "(see 'ckpt convert --help')" in ckpt("convert", small).err
    assert "(see 'ckpt --help')" in ckpt("frobnicate").err
    assert "(see 'ckpt inspect --help')" in ckpt("inspect", small, "--tag").err  # found before inspect's own context


@pytest.mark.parametrize("args", ["convert {src} {out}", "inspect --bogus {src}", "frobnicate", "reshard {src} {out} --world-size x"])
def test_the_entry_point_prints_the_same_one_line(small, tmp_path, args):
    res = run_subprocess(*args.format(src=small, out=tmp_path / "out").split())
    assert res.code == 2
    _one_usage_line(res.err, res.out, "ckpt: error: ")


def test_bare_ckpt_still_shows_the_help(ckpt):
    res = ckpt()
    assert res.code == 2 and "Usage" in res.out + res.err and "COMMAND" in res.out + res.err
