"""DCP chunks in object storage laid out from a parsed twin (formats/dcp/twins.py, store/predicted.py), on a moto S3
server, from checkpoints saved by dcp.save: a write fetches no chunk header of its own for the twins, its output
equals torch's own load bit for bit, a twin saved with other strides is caught and the write runs again (right),
and a twin whose data was damaged is refused with nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from ckpt_cli.formats.dcp import twins  # noqa: E402
from ckpt_cli.store import clients  # noqa: E402

SAVE = """\
import sys, warnings, torch, torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
g = torch.Generator().manual_seed(0)
state = {f"layers.{i}.weight": torch.empty(256, 512).uniform_(generator=g) for i in range(8)}
if sys.argv[2] == "transposed":  # the same dtype, shape and archive length as the others; strides (1, 256)
    state["layers.8.weight"] = torch.empty(512, 256).uniform_(generator=g).t()
dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[1], thread_count=2), no_dist=True)
"""


@pytest.fixture(scope="session")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Two checkpoints by dcp.save, 512 KiB float32 chunks over two files: plain, and with a transposed twin."""
    root = tmp_path_factory.mktemp("twins")
    for name in ("plain", "transposed"):
        subprocess.run([sys.executable, "-c", SAVE, str(root / name), name], check=True)
    return {name: root / name for name in ("plain", "transposed")}


def _torch_load(folder: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / f"{folder.name}.pt"
    if not out.exists():
        dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


def _equal_to_torch(hf: Path, source: Path) -> None:
    expected = _torch_load(source)
    got: dict[str, torch.Tensor] = {}
    for shard in hf.glob("*.safetensors"):
        got.update(load_file(shard))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor) and got[name].stride() == tuple(got[name].contiguous().stride()), name


def _gets(ckpt, *args: str) -> int:
    before = clients.stats().requests
    res = ckpt(*args)
    assert res.code == 0, res.out + res.err
    return clients.stats().requests - before


def test_twins_fetch_no_headers_and_write_what_torch_loads(ckpt, s3, saved, tmp_path, monkeypatch):
    url = s3.upload(saved["plain"], "twins/plain")
    predicted = _gets(ckpt, "convert", url, tmp_path / "hf", "--to", "hf", "--quiet")
    _equal_to_torch(tmp_path / "hf", saved["plain"])
    monkeypatch.setattr(twins, "TWIN_LEAST", 1 << 40)  # every chunk parsed from its own headers, as before
    parsed = _gets(ckpt, "convert", url, tmp_path / "hf-parsed", "--to", "hf", "--quiet")
    written = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert written == {p.name: p.read_bytes() for p in (tmp_path / "hf-parsed").iterdir()}
    # 8 chunks in 2 files: the parsed run fetches each chunk's head and tail (merged at the boundaries between chunks)
    assert predicted <= parsed - 6, (predicted, parsed)


def test_a_twin_with_other_strides_is_caught_and_the_write_runs_again(ckpt, s3, saved, tmp_path):
    url = s3.upload(saved["transposed"], "twins/transposed")
    res = ckpt("convert", url, s3.url("twins/out-transposed"), "--to", "hf", "--quiet")
    assert res.code == 0, res.out + res.err
    local = tmp_path / "out"
    local.mkdir()
    for key in s3.keys("twins/out-transposed/"):
        (local / Path(key).name).write_bytes(s3.get(key))
    _equal_to_torch(local, saved["transposed"])


def test_a_damaged_twin_is_refused_and_nothing_is_written(ckpt, s3, saved, tmp_path):
    url = s3.upload(saved["plain"], "twins/damaged")
    key = "twins/damaged/__0_1.distcp"  # the second file: every chunk in it is a twin of one in the first
    data = bytearray(s3.get(key))
    data[len(data) * 3 // 8] ^= 0xFF  # amid the second of its four chunks, in data that only its CRC32 covers
    s3.put(key, bytes(data))
    res = ckpt("convert", url, s3.url("twins/out-damaged"), "--to", "hf")
    assert res.code == 1, res.out + res.err
    assert res.err.count("\n") == 1 and f"{url}/__0_1.distcp: record data/0 at byte" in res.err, res.err
    assert "fails its CRC32 check" in res.err, res.err
    assert s3.keys("twins/out-damaged") == [] and s3.uploads("twins/out-damaged") == []
    assert ckpt("convert", url, tmp_path / "hf", "--to", "hf").code == 1 and not (tmp_path / "hf").exists()


def test_a_check_that_fails_unexpectedly_leaves_no_fetch_waiting():
    """An error that is not the data's (a bug, an interrupt) gives the item back: a fetch waiting on it takes it over."""
    from ckpt_cli.store import predicted

    def broken(fetched: bytes, at: int) -> None:
        raise RuntimeError("a bug in a check")

    url = "s3://unit/predicted"
    predicted.forget(url)
    predicted.expect(url, 0, 100, 10, 90, broken)
    mine, _ = predicted.claim(url, 10, 20)
    again, theirs = predicted.claim(url, 10, 20)  # a second fetch meets it claimed
    assert len(mine) == 1 and again == [] and len(theirs) == 1
    with pytest.raises(RuntimeError):
        predicted.settle(mine, b"x" * 100, 0)
    assert predicted.wait(theirs) == theirs  # given back, not waited on for ever: the second fetch checks it itself
    predicted.forget(url)
