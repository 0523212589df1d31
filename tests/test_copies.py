"""A checkpoint copied the ways people copy folders, and touched afterwards, verifies like the original: file times
say nothing certain about a copy, so they give a note at most (core/file_times.py) and the structural and CRC checks
decide; a real change of a data file's bytes or size still fails."""

from __future__ import annotations

import json
import os
import pickle
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


def test_an_interrupted_resave_is_a_note_unless_its_data_no_longer_fits(ckpt, tmp_path):
    """A re-save of the same layout that died before its commit leaves data the checks cannot tell from a touched
    copy: a note, exit 0. One whose layout changed no longer matches `.metadata`: a failure."""
    folder = tmp_path / "step_100"
    state = {"w": torch.arange(64, dtype=torch.float32), "step": 100}
    _save(state, folder, commit=True)
    copy = tmp_path / "copy"
    _cp(folder, copy)
    time.sleep(0.01)
    _save({"w": torch.arange(64, dtype=torch.float32) * 2, "step": 100}, folder, commit=False)
    res = ckpt("verify", folder, "--deep", "--json")
    assert res.code == 0, res.out + res.err
    if birth_time_ns(folder / ".metadata") is not None:
        assert any("modified after .metadata" in note for note in json.loads(res.out)["notes"]), res.out
    assert ckpt("convert", folder, tmp_path / "out", "--to", "safetensors").code == 0
    assert ckpt("verify", copy).code == 0 and not json.loads(ckpt("verify", copy, "--json").out)["notes"]
    _save({"w": torch.arange(96, dtype=torch.float32), "step": 100}, folder, commit=False)
    assert_fails(ckpt("verify", folder), "__0_0.distcp")
    _save(state, folder, commit=True)  # the re-save that finishes
    assert ckpt("verify", folder).code == 0


def _data_first(src: Path, dest: Path) -> list[Path]:
    """A parallel download or sync that wrote `.metadata` last: every data file born before it."""
    dest.mkdir()
    data = sorted(src.glob("*.distcp"), reverse=True)  # not in name order either
    for f in data:
        shutil.copyfile(f, dest / f.name)
    time.sleep(0.01)
    shutil.copyfile(src / ".metadata", dest / ".metadata")
    time.sleep(0.01)
    return [dest / f.name for f in data]


def _touch(paths: list[Path], when: float | None = None) -> None:
    for p in paths:
        os.utime(p, None if when is None else (when, when))


def _find_touch(src: Path, dest: Path) -> None:
    _data_first(src, dest)
    subprocess.run(["touch", str(dest / ".metadata")], check=True)  # `find -exec touch`, the metadata first
    time.sleep(0.01)
    subprocess.run(["find", str(dest), "-name", "*.distcp", "-exec", "touch", "{}", "+"], check=True)


def _touch_d_future(src: Path, dest: Path) -> None:
    subprocess.run(["touch", "-d", "+3 hours", *map(str, _data_first(src, dest))], check=True)


def _hours_newer(src: Path, dest: Path) -> None:
    _touch(_data_first(src, dest), (dest / ".metadata").stat().st_mtime + 5 * 3600)


def _same_mtime(src: Path, dest: Path) -> None:
    _touch([dest / ".metadata", *_data_first(src, dest)], 1_700_000_000)


def _metadata_in_1970(src: Path, dest: Path) -> None:
    data = _data_first(src, dest)
    _touch([dest / ".metadata"], 86_400)  # every data file decades newer
    _touch(data)


def _each_its_own_time(src: Path, dest: Path) -> None:
    for i, p in enumerate(_data_first(src, dest) + [dest / ".metadata"]):
        _touch([p], 1_600_000_000 + 1000 * i)


def _metadata_first_kept_times(src: Path, dest: Path) -> None:
    """rsync -t that sent `.metadata` first (data born after it, the source's times kept), data touched since."""
    dest.mkdir()
    for f in [src / ".metadata", *sorted(src.glob("*.distcp"))]:
        shutil.copy2(f, dest / f.name)
    _touch(list(dest.glob("*.distcp")), time.time() + 60)


def _cp_then_touch_all(src: Path, dest: Path) -> None:
    _cp(src, dest)
    time.sleep(0.01)
    _touch([dest / ".metadata"])
    _touch(sorted(dest.glob("*.distcp")), time.time() + 1)


TOUCHES = {
    "find -exec touch": _find_touch,
    "touch -d +3 hours": _touch_d_future,
    "data hours newer": _hours_newer,
    "one mtime for all": _same_mtime,
    "metadata in 1970": _metadata_in_1970,
    "each its own time": _each_its_own_time,
    "rsync -t metadata first": _metadata_first_kept_times,
    "cp -r then touch": _cp_then_touch_all,
}


@pytest.fixture(params=[2, 4], ids=["w2", "w4"])
def dcp_source(request, fsdp2_saves) -> Path:
    return fsdp2_saves[request.param] / "ckpt"


@pytest.mark.parametrize("touch", list(TOUCHES))
def test_a_copy_touched_after_verifies(ckpt, tmp_path, touch, dcp_source):
    """Data files copied before `.metadata`, then touched in any order and to any time: exit 0 (a note at most),
    deep too; inspect and convert read it."""
    dest = tmp_path / "copy"
    TOUCHES[touch](dcp_source, dest)
    for args in ((), ("--deep",)):
        res = ckpt("verify", dest, *args)
        assert res.code == 0 and "FAILED" not in res.out, (touch, args, res.out + res.err)
    doc = json.loads(ckpt("verify", dest, "--deep", "--json").out)
    assert doc["problems"] == [] and all("modified after .metadata" in n for n in doc["notes"]), doc
    assert ckpt("inspect", dest).code == 0
    assert ckpt("convert", dest, tmp_path / "out", "--to", "safetensors").code == 0


def _flip_in_record(dest: Path) -> None:
    with open(dest / ".metadata", "rb") as f:
        meta = pickle.load(f)  # torch's own output: trusted here
    info = max(meta.storage_data.values(), key=lambda i: i.length)
    path = dest / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length - 900] ^= 0x10  # inside the record's data, under its CRC32
    path.write_bytes(bytes(data))


def _cut(dest: Path, keep: float) -> None:
    path = sorted(dest.glob("*.distcp"))[-1]
    os.truncate(path, int(path.stat().st_size * keep))


def _swap(dest: Path) -> None:
    first, last = sorted(dest.glob("*.distcp"))[0], sorted(dest.glob("*.distcp"))[-1]
    first.write_bytes(last.read_bytes())


CHANGES = {
    "a byte flipped": _flip_in_record,
    "one byte cut": lambda dest: _cut(dest, 1 - 1e-9),
    "half cut": lambda dest: _cut(dest, 0.5),
    "emptied": lambda dest: _cut(dest, 0),
    "another rank's bytes": _swap,
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("touch", ["find -exec touch", "one mtime for all"])
def test_a_changed_data_file_of_a_touched_copy_still_fails(ckpt, tmp_path, change, touch, dcp_source):
    dest = tmp_path / "copy"
    TOUCHES[touch](dcp_source, dest)
    CHANGES[change](dest)
    assert_fails(ckpt("verify", dest, "--deep"), ".distcp")
