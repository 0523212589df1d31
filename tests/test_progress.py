"""Progress on a terminal, for reads as for writes; silent when piped or with --quiet. One flag vocabulary:
--quiet and --json on every command, ls narrowed by --format and --tag."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import run_subprocess

NOW = {"CKPT_PROGRESS_DELAY": "0"}  # show at once: these checkpoints take well under the half second a user waits


def on_terminal(*args: str | Path) -> tuple[int, str, str]:
    """The CLI with stderr on a pseudo-terminal of 120 columns (a terminal of 0 columns draws no bar), stdout piped."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, **NOW}
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_cli", *map(str, args)], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    out = proc.communicate()[0]
    return proc.returncode, out.decode(), err.decode()


def test_verify_shows_each_pass_on_a_terminal_and_nothing_when_piped_or_quiet(ds_saves):
    src = ds_saves[2] / "stage2-fp32"
    code, out, err = on_terminal("verify", "--deep", "--finite", src)
    assert code == 0 and out.startswith("OK"), err
    assert "verify stage2-fp32: checking CRCs" in err and "verify stage2-fp32: reading tensors" in err
    assert "B/s" in err and "iB" not in err  # decimal units, as the summary lines print sizes
    piped = run_subprocess("verify", "--deep", "--finite", src, env=NOW)
    assert piped.code == 0 and piped.err == "", piped.err
    code, out, err = on_terminal("verify", "--deep", "--finite", src, "--quiet")
    assert code == 0 and out.startswith("OK") and err == "", err


def test_diff_and_a_write_show_progress_labelled_from_source_to_target(ds_saves, tmp_path):
    src = ds_saves[2] / "stage2-fp32"
    code, out, err = on_terminal("convert", src, tmp_path / "hf", "--to", "hf")
    assert code == 0 and "deepspeed -> hf" in err and "iB" not in err, err
    code, out, err = on_terminal("diff", tmp_path / "hf", tmp_path / "hf")
    assert code == 0 and "diff hf hf: comparing values" in err, err


def test_demo_shows_a_clock_while_it_trains(tmp_path):
    code, out, err = on_terminal("demo", tmp_path / "d")
    assert code == 0 and "demo: training a tiny model and saving it" in err and "try: ckpt inspect" in err, err


def test_the_clock_while_metadata_are_read(monkeypatch):
    """A wide checkpoint's metadata take seconds to read: a clock says so, then is wiped for the first bar."""
    from ckpt_cli.cli import output

    screen = io.StringIO()
    monkeypatch.setattr(output, "DELAY", 0.05)
    monkeypatch.setattr(sys, "stderr", screen)
    passes = output._Passes("inspect wide")
    time.sleep(0.4)
    monkeypatch.setattr(output, "DELAY", 0)  # the bar at once
    passes.stage("reading tensors", 1000)
    passes.advance(1000)
    passes.close()
    text = screen.getvalue()
    assert "\rinspect wide: reading metadata 0s" in text and "\r\x1b[K" in text
    assert text.index("\r\x1b[K") < text.index("reading tensors")


def test_every_command_takes_quiet_and_json():
    import typer.main

    from ckpt_cli.cli.app import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        flags = {opt for param in command.params for opt in param.opts}
        if name == "completion":  # prints a shell script: neither a report nor notes
            continue
        assert {"--quiet", "--json"} <= flags, (name, sorted(flags))


def test_demo_json_and_quiet(ckpt, tmp_path):
    res = ckpt("demo", tmp_path / "d", "--json")
    doc = json.loads(res.out)
    assert res.code == 0 and doc["dest"] == str(tmp_path / "d") and str(tmp_path / "d" / "hf") in doc["checkpoints"]
    res = ckpt("demo", tmp_path / "d", "--overwrite", "--quiet")
    assert res.code == 0 and res.err == "" and str(tmp_path / "d" / "hf") in res.out.split()


def test_ls_narrowed_by_format_and_tag(ckpt, ds_saves, tmp_path):
    root = tmp_path / "root"
    assert ckpt("demo", root, "-q").code == 0
    ds = ds_saves[2] / "stage2-fp32"
    shutil.copytree(ds, root / "ds")
    shutil.copytree(ds / "global_step3", root / "ds" / "global_step1")  # a second tag, as a run saves at step 1 and 3

    def paths(*args: str) -> list[str]:
        res = ckpt("ls", root, "--json", *args)
        assert res.code == 0, res.err
        rows = json.loads(res.out)["checkpoints"]
        assert not any(r["newest"] for r in rows)  # what a run resolves to may be among the rows left out
        return [r["path"] for r in rows]

    assert paths("--format", "dcp") == ["dcp"]
    assert paths("--tag", "100") == paths("--tag", "step_100") == ["run/step_100.safetensors"]
    assert paths("--tag", "1") == ["ds/global_step1"]  # a tag inside a DeepSpeed folder
    assert paths("--format", "deepspeed", "--tag", "3") == ["deepspeed/global_step3", "ds/global_step3"]
    res = ckpt("ls", root, "--tag", "999")
    assert res.code == 2 and "no checkpoint matches --tag 999" in res.err
    res = ckpt("ls", root, "--format", "nope")
    assert res.code == 2 and "unknown format 'nope'" in res.err


@pytest.mark.parametrize("args", [("--tag", "3"), ()])
def test_ls_of_one_deepspeed_folder_by_tag(ckpt, ds_saves, args):
    res = ckpt("ls", ds_saves[2] / "stage2-fp32", "--json", *args)
    assert res.code == 0 and [r["path"] for r in json.loads(res.out)["checkpoints"] if r["format"] == "deepspeed"] == ["global_step3"]


def test_an_empty_selection_and_a_stray_tolerance_are_wrong_calls_in_every_command(ckpt, tmp_path):
    """`--filter` matching nothing is exit 2 wherever it is taken (before: inspect --tree printed "no tensors" and
    diff said "equal"), and a tolerance without --against is refused rather than ignored."""
    assert ckpt("demo", tmp_path / "d", "-q").code == 0
    hf, one = tmp_path / "d" / "hf", tmp_path / "d" / "model.safetensors"
    calls = [
        ("inspect", hf),
        ("inspect", hf, "--tree"),
        ("diff", hf, one),
        ("convert", hf, tmp_path / "o1", "--to", "torch"),
        ("merge", hf, tmp_path / "o2.safetensors"),
        ("split", one, tmp_path / "o3"),
    ]
    for call in calls:
        res = ckpt(*call, "--filter", "nothing.*")
        assert res.code == 2 and "--filter nothing.* matches no tensor" in res.err, (call, res.err)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2.safetensors", "o3"))
    for flag in ("--atol", "--rtol"):
        res = ckpt("verify", hf, flag, "0.1")
        assert res.code == 2 and "tolerances of --against" in res.err, res.err
