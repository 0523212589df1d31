"""torch is an extra: without it, inspect, verify (--deep), ls, diff, merge, reshard and conversions that copy bytes run
on every format, saved by the real producers, and write what a run with torch writes, byte for byte. What needs torch
(a dtype cast, the demo's training) exits 2 with the install command, in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Result

# `import torch` raises ImportError in the child, as on a machine where it is not installed
BLOCKED = "import sys; sys.modules['torch'] = None; from ckpt_cli.cli.entry import main; main()"


def without_torch(*args: str | Path) -> Result:
    proc = subprocess.run([sys.executable, "-c", BLOCKED, *map(str, args)], capture_output=True, text=True, timeout=300)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def files_of(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saves(mixed_files, fsdp2_saves, ds_saves) -> dict[str, Path]:
    return {
        "safetensors": mixed_files["safetensors"],
        "torch": mixed_files["torch"],
        "hf": mixed_files["hf"],
        "dcp": fsdp2_saves[2] / "ckpt",
        "deepspeed": ds_saves[2] / "stage2-bf16",
        "deepspeed3": ds_saves[2] / "stage3-fp32",
    }


@pytest.mark.parametrize("name", ["safetensors", "torch", "hf", "dcp", "deepspeed", "deepspeed3"])
def test_reads_and_byte_copies_need_no_torch(ckpt, saves, tmp_path, name):
    source = saves[name]
    reads = [["inspect"], ["inspect", "--json"], ["verify", "--deep"], ["verify", "--finite"]] + ([["ls"]] if source.is_dir() else [])
    for args in reads:
        res, want = without_torch(*args, source), ckpt(*args, source)
        assert res.code == want.code == 0, res.err
        assert res.out == want.out, args
    assert without_torch("diff", source, source).code == 0
    writes = {"merged.safetensors": ["merge"], "hf": ["convert", "--to", "hf", "--num-shards", "2"]}
    if name in ("dcp", "deepspeed", "deepspeed3"):
        writes["resharded"] = ["reshard", "--world-size", "3"]
    for out, args in writes.items():  # one destination path: DCP's .metadata records where it was written
        res = without_torch(*args, source, tmp_path / out, "--quiet")
        assert res.code == 0, (args, res.err)
        bare = files_of(tmp_path / out)
        assert ckpt(*args, source, tmp_path / out, "--quiet", "--overwrite").code == 0
        assert bare == files_of(tmp_path / out), args


READ_ONLY = {  # formats ckpt reads but does not write, each saved by its real producer (the session's fixtures)
    "deepspeed-moe": ("ds_moe", lambda f: f / "w2" / "stage2-bf16-ep2"),
    "dtensor-fsdp2": ("dtensor_saves_2", lambda f: f / "fsdp2"),
    "dcp-hf": ("dtensor_saves_2", lambda f: f / "dcp-hf"),
    "megatron": ("mcore", lambda f: f / "stacked"),
}


@pytest.mark.parametrize("name", sorted(READ_ONLY))
def test_read_only_formats_need_no_torch(request, ckpt, tmp_path, name):
    fixture, inside = READ_ONLY[name]
    source = inside(request.getfixturevalue(fixture))
    for args in (["inspect"], ["verify", "--deep"]):
        res, want = without_torch(*args, source), ckpt(*args, source)
        assert res.code == want.code == 0, res.err
        assert res.out == want.out, args
    res = without_torch("merge", source, tmp_path / "merged.safetensors", "--quiet")
    assert res.code == 0, res.err
    bare = files_of(tmp_path / "merged.safetensors")
    assert ckpt("merge", source, tmp_path / "merged.safetensors", "--quiet", "--overwrite").code == 0
    assert bare == files_of(tmp_path / "merged.safetensors")


def test_what_needs_torch_says_so_in_one_line(saves, tmp_path):
    for args in (
        ["convert", saves["dcp"], tmp_path / "bf16.safetensors", "--to", "safetensors", "--dtype", "bf16"],
        ["demo", tmp_path / "demo"],
    ):
        res = without_torch(*args)
        assert res.code == 2, res.err
        assert res.err.startswith("ckpt: error: ") and "needs torch, which is not installed: pip install torch" in res.err, res.err
        assert len(res.err.strip().splitlines()) == 1, res.err
    assert not (tmp_path / "bf16.safetensors").exists() and not (tmp_path / "demo").exists()
