"""Distributed mode: `torchrun --nproc-per-node 2 -m ckpt_cli ...` shares the output files between ranks, rank 0
commits, and the result is byte-identical to a single-process run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import torchrun_command

from ckpt_cli.core.write.executor import write_files
from ckpt_cli.core.write.plan import Literal, OutputFile
from ckpt_cli.store import Guard, begin


def run(cwd, *args, nproc: int = 1) -> None:
    prefix = [sys.executable, "-m", "ckpt_cli"] if nproc == 1 else [*torchrun_command(nproc), "-m", "ckpt_cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*prefix, *map(str, args), "-q"], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["dcp", "deepspeed", "hf"])
def test_torchrun_output_is_byte_identical(fsdp2_saves, ds_saves, tmp_path, kind):
    source, args = {
        "dcp": (fsdp2_saves[2] / "ckpt", ["reshard", "--world-size", "3"]),
        "deepspeed": (ds_saves[2] / "stage3-bf16", ["reshard", "--world-size", "3"]),
        "hf": (fsdp2_saves[3] / "ckpt", ["convert", "--to", "hf", "--num-shards", "3"]),
    }[kind]
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    single.mkdir()
    ranks.mkdir()
    command, options = args[0], args[1:]
    run(single, command, source, "out", *options)
    run(ranks, command, source, "out", *options, nproc=2)
    ours, reference = files(ranks / "out"), files(single / "out")
    assert ours.keys() == reference.keys() and len(ours) >= 4
    for name in reference:
        assert ours[name] == reference[name], name
    assert [p.name for p in ranks.iterdir()] == ["out"]  # no temporary folder left behind
    # Rank 0 wrote the markers first, while rank 1 took data files; they are still the newest files, as one process
    # leaves them (a folder's newest file tells which checkpoint a save finished last)
    marker = {"dcp": ".metadata", "deepspeed": "latest", "hf": "model.safetensors.index.json"}[kind]
    times = {p.relative_to(ranks / "out"): p.stat().st_mtime_ns for p in (ranks / "out").rglob("*") if p.is_file()}
    assert times[Path(marker)] == max(times.values()), marker


def test_torchrun_refuses_an_existing_destination(fsdp2_saves, tmp_path):
    (tmp_path / "out").mkdir()
    cmd = [*torchrun_command(2), "-m", "ckpt_cli", "reshard", str(fsdp2_saves[2] / "ckpt"), "out", "--world-size", "3"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and "--overwrite" in proc.stderr
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("workers", [1, 3])
def test_a_process_writes_the_files_it_takes(tmp_path, workers):
    """Under torchrun the ranks take data files from a shared counter (core/distributed._claims); a process writes
    exactly the files it is given, on any number of threads, and says which they were."""
    files = [OutputFile(f"f{i}", [Literal(b"%d" % i)]) for i in range(6)]
    given = iter([4, 1, 5, 6])  # then past the end: none left

    def take() -> int:
        return next(given, 6)

    write = begin(tmp_path / "out", True, False, Guard(()))
    written = write_files(write, [(write.root / f.relpath, f) for f in files], workers, None, take)
    write.commit()
    assert sorted(out.relpath for _, out in written) == ["f1", "f4", "f5"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == {"f1": b"1", "f4": b"4", "f5": b"5"}
