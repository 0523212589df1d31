"""A write of several local files copies tensor data in the order the sources hold it (core/write/source_order.py),
and a write's large reads leave the page cache as they found it (core/reading.SourceFiles.passing). The folders come
from Hugging Face's own sharding (huggingface_hub.save_torch_state_dict); the DCP written is read back by torch's
own dcp_to_torch_save and compared bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_same_tensors
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpt_cli.core import direct


def state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(53)
    # 1.4-8 MB tensors among small ones, in shards larger than the read-ahead that reading their headers starts
    sizes = [(96, 64), (2048, 1024), (33, 7), (1600, 1024), (128, 256), (1, 5), (700, 512), (2048, 1000), (3, 3), (1024, 1024), (9, 9)]
    return {f"layers.{i}.weight": torch.randn(*shape) for i, shape in enumerate(sizes)}


@pytest.fixture
def hf_folder(tmp_path):
    tensors = state_dict()
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(tensors, tmp_path / "hf", max_shard_size="16MB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) >= 2
    return tmp_path / "hf", tensors


def path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def cold(folder) -> None:
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


@pytest.mark.parametrize("command", ["dcp", "merge"])  # four rank files; one file whose tensors are in name order
def test_a_write_reads_each_source_file_front_to_back(hf_folder, ckpt, monkeypatch, tmp_path, command):
    folder, tensors = hf_folder
    reads: list[tuple[str, int]] = []
    real_preadv, real_pread = os.preadv, os.pread

    def preadv(fd, buffers, offset, *rest):
        if path_of(fd).endswith(".safetensors"):
            reads.append((path_of(fd), offset))
        return real_preadv(fd, buffers, offset, *rest)

    def pread(fd, nbytes, offset):
        if path_of(fd).endswith(".safetensors") and offset > 4096:  # (not the headers)
            reads.append((path_of(fd), offset))
        return real_pread(fd, nbytes, offset)

    def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
        reads.append((path_of(src), offset_src))
        return real_copy(src, dst, count, offset_src, offset_dst)

    real_copy = os.copy_file_range
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "copy_file_range", copy_file_range)  # (a merge's bytes move in the kernel)
    if command == "dcp":
        res = ckpt("convert", folder, tmp_path / "dcp", "--to", "dcp", "--world-size", "4", "--workers", "1")
    else:  # layers.10 comes before layers.2 in the merged file, after it in the shards
        res = ckpt("merge", folder, tmp_path / "merged.safetensors", "--workers", "1")
    assert res.code == 0, res.err
    for path in {p for p, _ in reads}:
        offsets = [o for p, o in reads if p == path]
        assert offsets == sorted(offsets), f"{path} read out of order: {offsets}"
    visits = [p for i, (p, _) in enumerate(reads) if i == 0 or reads[i - 1][0] != p]
    assert len(visits) == len(set(visits)), f"a source file left and read again: {visits}"  # one thread: file by file
    assert len(reads) >= 4  # (written file by file, each rank file read a quarter of every tensor: back for the next)
    if command == "dcp":
        dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
        assert_same_tensors(torch.load(tmp_path / "back.pt"), tensors)
    else:
        assert_same_tensors(load_file(tmp_path / "merged.safetensors"), tensors)


def fadvised(monkeypatch) -> list[tuple[str, int, int]]:
    calls: list[tuple[str, int, int]] = []
    real = os.posix_fadvise

    def posix_fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED and path_of(fd).endswith(".safetensors"):
            calls.append((path_of(fd), offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", posix_fadvise)
    return calls


@pytest.mark.parametrize("to", ["dcp", "hf"])  # read into a buffer (CRC-bearing DCP chunks) or copied by the kernel
def test_a_write_lets_go_of_the_large_source_reads_the_cache_did_not_hold(hf_folder, ckpt, monkeypatch, tmp_path, to):
    folder, tensors = hf_folder
    cold(folder)
    calls = fadvised(monkeypatch)
    res = ckpt("convert", folder, tmp_path / "out", "--to", to, "--world-size" if to == "dcp" else "--num-shards", "2")
    assert res.code == 0, res.err
    let_go = sum(length for _, _, length in calls)
    large = sum(t.numel() * 4 for t in tensors.values() if t.numel() * 4 >= direct.DIRECT_BYTES)
    assert let_go >= large // 2 and let_go <= sum(t.numel() * 4 for t in tensors.values())  # (DCP: halves of 1.4 MB tensors are small)
    if to == "dcp":
        dcp_to_torch_save(tmp_path / "out", tmp_path / "back.pt")
        assert_same_tensors(torch.load(tmp_path / "back.pt"), tensors)


@pytest.mark.skipif(direct._cachestat() is None, reason="cachestat(2) needs Linux 6.5: whether pages are cached is unknown")
def test_a_write_keeps_the_source_pages_the_cache_held(hf_folder, ckpt, monkeypatch, tmp_path):
    folder, _ = hf_folder
    for f in folder.glob("*.safetensors"):
        f.read_bytes()  # warm
    calls = fadvised(monkeypatch)
    assert ckpt("convert", folder, tmp_path / "out", "--to", "hf", "--num-shards", "2").code == 0
    assert calls == []


def test_a_failure_in_a_source_ordered_write_leaves_nothing(hf_folder, ckpt, monkeypatch, tmp_path):
    from ckpt_cli.core.write import source_order
    from ckpt_cli.errors import DataError

    folder, _ = hf_folder
    real, calls = source_order.copy_runs, []

    def failing(runs, out, sources, with_crc):
        calls.append(runs)
        if len(calls) == 5:  # other files and threads are mid-way
            raise DataError(f"{runs[0][0]}: broken on purpose")
        return real(runs, out, sources, with_crc)

    monkeypatch.setattr(source_order, "copy_runs", failing)
    res = ckpt("convert", folder, tmp_path / "dcp", "--to", "dcp", "--world-size", "4")
    assert res.code == 1 and "broken on purpose" in res.err and "Traceback" not in res.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no destination, no temporary


def test_a_write_from_many_source_files_keeps_few_open(tmp_path, ckpt, monkeypatch):
    from ckpt_cli.core.write import source_order

    tensors = {f"t{i:03d}": torch.full((64,), float(i)) for i in range(120)}
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(tensors, tmp_path / "hf", max_shard_size=300)  # a shard per tensor
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 120
    before, peak = len(os.listdir("/proc/self/fd")), [0]
    real = source_order.copy_runs

    def counted(*args):
        peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")) - before)
        return real(*args)

    monkeypatch.setattr(source_order, "copy_runs", counted)
    assert ckpt("convert", tmp_path / "hf", tmp_path / "out", "--to", "hf", "--num-shards", "2").code == 0
    assert 0 < peak[0] <= 2 * 17 + 2 + 8, peak[0]  # (held open, every shard's: 120)
    assert_same_tensors(
        load_file(tmp_path / "out" / "model-00001-of-00002.safetensors") | load_file(tmp_path / "out" / "model-00002-of-00002.safetensors"),
        tensors,
    )


def test_a_write_past_the_segment_bound_goes_file_by_file_without_making_its_files_first(hf_folder, ckpt, monkeypatch, tmp_path):
    from ckpt_cli.core.write import source_order

    folder, tensors = hf_folder
    made = []
    real = source_order.made
    monkeypatch.setattr(source_order, "MAX_SEGMENTS", 5)  # a rank file holds 11 chunks
    monkeypatch.setattr(source_order, "made", lambda out, check: made.append(out) or real(out, check))
    assert ckpt("convert", folder, tmp_path / "dcp", "--to", "dcp", "--world-size", "4").code == 0
    assert made == []  # its rank files' chunks counted from the plan: none made here to be held through the write
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    assert_same_tensors(torch.load(tmp_path / "back.pt"), tensors)
