"""A checkpoint copied the ways people copy folders verifies like the original; a DCP re-save that died
before its commit is still caught (by birth and modification times together: core/file_times.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_fails

from ckpt_cli.core.file_times import birth_time_ns


def _cp(src: Path, dest: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(dest)], check=True)


def _rsync(src: Path, dest: Path) -> None:
    subprocess.run(["rsync", "-r", f"{src}/", str(dest)], check=True)  # -r without -t: new modification times


def _copytree(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, copy_function=shutil.copy)  # contents only: new modification times


COPIES = {"cp -r": _cp, "rsync -r": _rsync, "copytree": _copytree}


def _sources(fsdp2_saves, ds_saves, mixed_files, tiny_llama) -> dict[str, Path]:
    return {
        "dcp": fsdp2_saves[2] / "ckpt",
        "deepspeed": ds_saves[2] / "stage3-fp32",
        "hf": tiny_llama[1] / "sharded",
        "hf-hub": mixed_files["hf"],
    }


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_verifies(ckpt, tmp_path, how, fsdp2_saves, ds_saves, mixed_files, tiny_llama):
    if how == "rsync -r" and shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    for name, src in _sources(fsdp2_saves, ds_saves, mixed_files, tiny_llama).items():
        dest = tmp_path / name
        time.sleep(0.01)  # copies made in the same tick would hide an ordering mistake
        COPIES[how](src, dest)
        res = ckpt("verify", dest)
        assert res.code == 0, (name, how, res.out + res.err)
        res = ckpt("verify", dest, "--deep")
        assert res.code == 0, (name, how, res.out + res.err)
    for name in ("safetensors", "torch"):
        dest = tmp_path / mixed_files[name].name
        shutil.copy(mixed_files[name], dest)
        assert ckpt("verify", dest, "--deep").code == 0


def _save(state: dict, folder: Path, commit: bool) -> None:
    """torch's own dcp.save (one process); without `commit`, it dies as a re-save would between writing its
    data files and writing .metadata."""
    import torch.distributed.checkpoint as dcp

    died = []

    class DiesBeforeCommit(dcp.FileSystemWriter):
        def finish(self, metadata, results):  # noqa: ANN001, ANN202 - torch's signature
            died.append(True)
            raise RuntimeError("interrupted before the commit")

    writer = dcp.FileSystemWriter(folder) if commit else DiesBeforeCommit(folder)
    try:
        dcp.save(state, storage_writer=writer)
    except BaseException:  # torch wraps the writer's exception in its CheckpointException (a BaseException)
        if not died:
            raise
    assert bool(died) != commit


def test_an_interrupted_resave_is_caught_and_its_copy_is_not_blamed(ckpt, tmp_path):
    folder = tmp_path / "step_100"
    state = {"w": torch.arange(64, dtype=torch.float32), "step": 100}
    _save(state, folder, commit=True)
    if birth_time_ns(folder / ".metadata") is None:
        pytest.skip("this file system does not keep birth times")
    copy = tmp_path / "copy"
    _cp(folder, copy)
    time.sleep(0.01)
    _save({"w": torch.arange(64, dtype=torch.float32) * 2, "step": 100}, folder, commit=False)
    assert_fails(ckpt("verify", folder), "__0_0.distcp", "rewritten after .metadata")
    assert_fails(ckpt("convert", folder, tmp_path / "out", "--to", "safetensors"), "__0_0.distcp")
    assert not (tmp_path / "out").exists()
    assert ckpt("verify", copy).code == 0
    _save(state, folder, commit=True)  # the re-save that finishes
    assert ckpt("verify", folder).code == 0
