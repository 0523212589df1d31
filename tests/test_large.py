"""A tensor over 4 GiB through the writers: zip64 records in torch files, offsets past 2^32 in safetensors.

The source is a sparse safetensors file (zeros cost no disk), with marked values at the edges."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open

BIG = (4 * 2**30 + 4096) // 4  # float32 elements: 4 GiB + 4 KiB
MARKS = {0: 1.5, 2**30 - 1: -2.0, BIG // 2: 3.25, BIG - 1: 7.0}


def sparse_source(path):
    header = {
        "big": {"dtype": "F32", "shape": [BIG], "data_offsets": [0, BIG * 4]},
        "tail": {"dtype": "F32", "shape": [3], "data_offsets": [BIG * 4, BIG * 4 + 12]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(start + BIG * 4 + 12)
        for index, value in MARKS.items():
            f.seek(start + index * 4)
            f.write(struct.pack("<f", value))
        f.seek(start + BIG * 4)
        f.write(struct.pack("<3f", 1.0, 2.0, 3.0))


@pytest.fixture
def big_dir(tmp_path):
    """4.3 GB files: removed at once (pytest keeps the temporary folders of recent runs)."""
    yield tmp_path
    for f in tmp_path.iterdir():
        f.unlink()


@pytest.mark.slow
def test_over_4gib_tensor_roundtrips_through_torch_and_safetensors(ckpt, big_dir):
    tmp_path = big_dir
    src = tmp_path / "big.safetensors"
    sparse_source(src)
    assert ckpt("convert", src, tmp_path / "big.pt", "--to", "torch", "-q").code == 0
    loaded = torch.load(tmp_path / "big.pt", mmap=True, weights_only=True)
    assert loaded["big"].shape == (BIG,) and loaded["tail"].tolist() == [1.0, 2.0, 3.0]
    for index, value in MARKS.items():
        assert loaded["big"][index].item() == value
    del loaded
    assert ckpt("verify", tmp_path / "big.pt").code == 0
    assert ckpt("convert", tmp_path / "big.pt", tmp_path / "back.safetensors", "--to", "safetensors", "-q").code == 0
    with safe_open(tmp_path / "back.safetensors", "pt") as f:
        big = f.get_slice("big")
        for index, value in MARKS.items():
            assert big[index : index + 1].item() == value
        assert f.get_tensor("tail").tolist() == [1.0, 2.0, 3.0]

    def data_bytes(path):
        with open(path, "rb") as f:
            return path.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]

    assert data_bytes(tmp_path / "back.safetensors") == data_bytes(src) == BIG * 4 + 12


@pytest.mark.slow
def test_over_4gib_tensor_through_dcp_and_hf_writers(ckpt, big_dir):
    """One 4 GiB+ DCP chunk (a zip64 record inside a .distcp file), loaded by torch's dcp.load; and an hf shard whose
    offsets pass 2^32, read by safetensors."""
    import torch.distributed.checkpoint as dcp

    tmp_path = big_dir
    src = tmp_path / "big.safetensors"
    sparse_source(src)
    assert ckpt("convert", src, tmp_path / "dcp", "--to", "dcp", "--world-size", "1", "-q").code == 0
    state = {"big": torch.empty(BIG), "tail": torch.empty(3)}
    dcp.load(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert state["tail"].tolist() == [1.0, 2.0, 3.0]
    for index, value in MARKS.items():
        assert state["big"][index].item() == value
    del state
    for f in (tmp_path / "dcp").iterdir():
        f.unlink()
    (tmp_path / "dcp").rmdir()
    assert ckpt("split", src, tmp_path / "hf", "--max-shard-size", "1GB", "-q").code == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = tmp_path / "hf" / index["weight_map"]["big"]
    with safe_open(shard, "pt") as f:
        big = f.get_slice("big")
        for i, value in MARKS.items():
            assert big[i : i + 1].item() == value
    for f in (tmp_path / "hf").iterdir():
        f.unlink()
    (tmp_path / "hf").rmdir()
