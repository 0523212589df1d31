"""Ranged GETs shared by the output files of one write (store/shared_reads.py), on a moto S3 server, from a checkpoint
saved by dcp.save with a thread per file (tensor i in file i mod 4, so the hf shards, two tensors each, read every
tensor from another object than the one before): neighbours in a source object read by different output files are
fetched as one span, the output equals torch's own load bit for bit, and with no room for spans each file fetches its
own runs and the output is the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from ckpt_cli.core.write import executor  # noqa: E402
from ckpt_cli.store import clients, shared_reads  # noqa: E402

SAVE = """\
import sys, warnings, torch, torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
g = torch.Generator().manual_seed(0)
state = {f"w{i:02d}": torch.empty(512, 1024).uniform_(generator=g) for i in range(16)}  # 2 MiB each
dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[1], thread_count=4), no_dist=True)
"""


@pytest.fixture(scope="session")
def interleaved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shared_reads") / "dcp"
    subprocess.run([sys.executable, "-c", SAVE, str(out)], check=True)
    return out


def _convert(ckpt, s3, url: str, name: str) -> tuple[dict[str, torch.Tensor], clients.Stats]:
    before = clients.stats()
    res = ckpt("convert", url, s3.url(name), "--to", "hf", "--max-shard-size", "5MB", "--workers", "4", "--quiet")
    assert res.code == 0, res.out + res.err
    after = clients.stats()
    got: dict[str, torch.Tensor] = {}
    for key in s3.keys(f"{name}/"):
        if key.endswith(".safetensors"):
            got.update(load_file_bytes(s3.get(key)))
    moved = clients.Stats(after.requests - before.requests, after.bytes_in - before.bytes_in, 0, 0)
    return got, moved


def load_file_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def _expected(folder: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / "torch.pt"
    if not out.exists():
        dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


def test_neighbours_read_by_different_files_are_one_get(ckpt, s3, interleaved, monkeypatch):
    url = s3.upload(interleaved, "shared/src")
    expected = _expected(interleaved)
    got, shared = _convert(ckpt, s3, url, "shared/out")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], t) for n, t in expected.items())
    monkeypatch.setattr(executor, "shared_reads", lambda *_: None)  # each file fetches its own runs ahead
    alone, own = _convert(ckpt, s3, url, "shared/out-alone")
    assert all(torch.equal(alone[n], t) for n, t in expected.items())
    # 16 tensors of 2 MiB in 4 objects: 16 GETs file by file; as spans of about 8 MiB, a few
    assert shared.requests <= own.requests - 8, (shared, own)
    assert shared.bytes_in <= own.bytes_in + (1 << 20), (shared, own)


def test_with_no_room_to_hold_each_file_fetches_its_own_runs(ckpt, s3, interleaved, monkeypatch):
    url = s3.upload(interleaved, "shared/src-tight")
    monkeypatch.setattr(shared_reads, "LIVE_BYTES", 0)
    got, moved = _convert(ckpt, s3, url, "shared/out-tight")
    expected = _expected(interleaved)
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], t) for n, t in expected.items())
    assert moved.bytes_in >= sum(t.nbytes for t in expected.values())


def test_spans_join_what_files_read_at_about_the_same_time(monkeypatch):
    """The time model: runs of one object join when the files read them within a file's mean time of each other."""
    monkeypatch.setattr(shared_reads, "refuse_short", lambda runs: None)  # hand-made runs of no real object
    mib = 1 << 20
    run = lambda i: ("s3://b/o", i * (2 * mib + 4096), 2 * mib)  # noqa: E731  # chunk i of one object
    together = shared_reads.SharedReads([[run(0)], [run(1)]], workers=2)  # written at once
    assert together.spans_of[0][0] is together.spans_of[1][0]
    assert together.spans_of[0][0].left == 2
    far = shared_reads.SharedReads([[run(0)], [], [], [], [], [], [run(1)]], workers=1)  # six files' time apart
    assert far.spans_of[0][0] is not far.spans_of[6][0]
    big = shared_reads.SharedReads([[run(0), run(1), run(2), run(3), run(4)]], workers=1)  # one file: about 8 MiB a span
    assert len({id(s) for s in big.spans_of[0]}) == 2


def test_a_long_run_is_streamed_in_pieces_never_fetched_whole(monkeypatch):
    monkeypatch.setattr(shared_reads, "refuse_short", lambda runs: None)  # hand-made runs of no real object
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(shared_reads, "_fetch", lambda url, a, b: asked.append((a, b)))
    monkeypatch.setattr(shared_reads, "stream", lambda url, offset, n: iter([b"x" * (n // 2), b"y" * (n - n // 2)]))
    gib = 1 << 30
    reads = shared_reads.SharedReads([[("s3://b/o", 0, gib)], [("s3://b/o", gib, 4096)]], workers=2)
    reader = reads.reader(0, [("s3://b/o", 0, gib)])
    assert reader is not None and reads.spans_of[0][0] is not reads.spans_of[1][0]
    got = reader.take("s3://b/o", 0, gib)
    assert got is not None and sum(len(v) for v in got) == gib and asked == []
