"""Every way a call can be wrong answers one line on stderr, `ckpt: error: ...` as every other error, and exit 2.

Usage errors (click's: a missing option or argument, a bad value, an unknown option or command) were four lines
(`Usage: ...`, `Try ...`, a blank line, `Error: ...`). Writing into a place that cannot be written named the hidden
temporary sibling (`/proc/.x.ckpt-partial-NNNN`) and exited 1.
"""

from __future__ import annotations

import os
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


# ---- a destination that cannot be written ------------------------------------------------------------------------

WRITERS = {  # command -> its arguments before the destination, and after it
    "demo": ([], []),
    "convert": (["{src}"], ["--to", "hf"]),
    "merge": (["{hf}"], []),
    "split": (["{src}"], ["--num-shards", "2"]),
    "reshard": (["{hf}"], ["--num-shards", "1"]),
}


def _places(tmp_path: Path) -> dict[str, Path]:
    """Folders that cannot be written into, each a way the parent of a destination fails."""
    (tmp_path / "afile").write_text("x")
    places = {
        "/proc": Path("/proc"),  # exists, refuses new entries (ENOENT)
        "missing under /proc": Path("/proc/no-such-folder/deeper"),  # a missing parent that cannot be made
        "under a file": tmp_path / "afile",
        "deep under a file": tmp_path / "afile" / "a" / "b",
    }
    if Path("/sys").is_dir():
        places["/sys"] = Path("/sys")
    return places


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def sources(tmp_path: Path, small: Path, ckpt) -> dict[str, Path]:
    assert ckpt("split", small, tmp_path / "hf", "--num-shards", "2", "--quiet").code == 0
    return {"src": small, "hf": tmp_path / "hf"}


def _write(ckpt, command: str, dest: Path, sources: dict[str, Path]):
    before, after = WRITERS[command]
    args = [a.format(**sources) for a in before] + [str(dest)] + after
    return ckpt(command, *args, "--quiet")


def _refused(res, dest: Path) -> None:
    assert res.code == 2, res.err
    assert res.err.count("\n") == 1 and res.err.startswith(f"ckpt: error: {dest}: "), res.err
    assert ".ckpt-partial" not in res.err and "Traceback" not in res.err, res.err


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_a_destination_that_cannot_be_written_is_one_line_naming_it_and_exit_2(ckpt, tmp_path, sources, command):
    """`ckpt demo /proc/x` named `/proc/.x.ckpt-partial-NNNN` and exited 1."""
    for where, folder in _places(tmp_path).items():
        before = _tree(tmp_path)
        name = "x.safetensors" if command == "merge" else "x"
        res = _write(ckpt, command, folder / name, sources)
        _refused(res, folder / name)
        assert _tree(tmp_path) == before, f"{command} into {where} left {_tree(tmp_path) - before}"


@pytest.mark.parametrize("errno_name", ["EACCES", "EROFS", "EPERM"])
@pytest.mark.parametrize("command", sorted(WRITERS))
def test_a_folder_refusing_writes_is_refused_and_the_folders_made_are_removed(ckpt, tmp_path, sources, monkeypatch, command, errno_name):
    """Permission denied or a read-only filesystem (simulated: the tests may run as root, whom mode bits do not stop), at
    the destination's folder and at a missing folder above it: one line naming the destination, nothing left."""
    import errno
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    code = getattr(errno, errno_name)
    real_open, real_mkdir = os.open, os.mkdir

    def refused(path: object) -> bool:
        return Path(os.fsdecode(path)).parent == locked  # type: ignore[arg-type]

    def fake_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if refused(path) and args and args[0] & os.O_CREAT:
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        return real_open(path, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if refused(path):
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    name = "x.safetensors" if command == "merge" else "x"
    for dest in (locked / name, tmp_path / "made" / "for" / "it" / "locked" / name):
        if dest.parent.name == "locked" and dest.parent != locked:
            locked = dest.parent  # the missing folder above the destination is the one refused
        before = _tree(tmp_path)
        res = _write(ckpt, command, dest, sources)
        _refused(res, dest)
        assert os.strerror(code) in res.err, res.err
        assert _tree(tmp_path) == before, f"left {_tree(tmp_path) - before}"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_is_refused(ckpt, tmp_path, sources):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    try:
        for command in sorted(WRITERS):
            res = _write(ckpt, command, locked / "x", sources)
            _refused(res, locked / "x")
            assert not any(locked.iterdir())
    finally:
        locked.chmod(0o755)


def test_the_entry_point_refuses_demo_into_proc():
    res = run_subprocess("demo", "/proc/x")
    assert res.code == 2 and res.err == "ckpt: error: /proc/x: cannot write in /proc: No such file or directory\n", res.err
