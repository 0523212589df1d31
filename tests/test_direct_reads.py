"""A write's large source reads past the page cache (core/direct.py, on request: CKPT_DIRECT_READS=1): the file's
bytes at any offset, announced or not, through the cache where O_DIRECT is refused, a truncated file a DataError, and a
damaged record still caught by its CRC32; the CRC32 through libdeflate equals zlib's."""

from __future__ import annotations

import errno
import os
import random
import zlib

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ckpt_cli
from ckpt_cli.core import direct
from ckpt_cli.core.direct import DirectReads
from ckpt_cli.core.reading import BLOCK_BYTES, SourceFiles, read_runs
from ckpt_cli.core.write.crc import RecordCheck, crc32
from ckpt_cli.errors import DataError

SIZE = 3 * BLOCK_BYTES + 12_345  # ends off a page


@pytest.fixture
def data_file(tmp_path):
    data = random.Random(53).randbytes(SIZE)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: the reads below go to the disk where they can
    yield str(path), data, fd
    os.close(fd)


def direct_here(path) -> bool:
    """Whether the filesystem under the test's files takes O_DIRECT (tmpfs before Linux 6.6 does not)."""
    try:
        os.close(os.open(path, os.O_RDONLY | direct._DIRECT))
    except OSError:
        return False
    return bool(direct._DIRECT)


BLOCKS = [(0, BLOCK_BYTES), (4097, BLOCK_BYTES), (BLOCK_BYTES + 1, 3 << 20), (SIZE - (2 << 20), 2 << 20)]
BLOCKS.append((SIZE - BLOCK_BYTES - 5, BLOCK_BYTES))


@pytest.mark.parametrize("ahead", [1, 3])  # a block skipped is still to be read ahead (1), or being read ahead (3)
def test_blocks_announced_or_not_are_the_files_bytes(data_file, ahead):
    path, data, fd = data_file
    reads = DirectReads(BLOCK_BYTES, lambda p: fd, ahead)
    assert reads.wants(path, 1 << 20) == direct_here(path) and not reads.wants(path, (1 << 20) - 1)
    try:
        reads.expect([(path, o, n) for o, n in BLOCKS])
        for o, n in BLOCKS:  # in the announced order: each read ahead while the last is used
            assert bytes(reads.read(path, o, n)) == data[o : o + n]
        reads.expect([(path, o, n) for o, n in BLOCKS])
        o, n = BLOCKS[2]  # the first two skipped (copied another way): the rest still read ahead
        assert bytes(reads.read(path, o, n)) == data[o : o + n]
        assert bytes(reads.read(path, 77, 1 << 20)) == data[77 : 77 + (1 << 20)]  # one never announced
        for o, n in BLOCKS[3:]:
            assert bytes(reads.read(path, o, n)) == data[o : o + n]
    finally:
        reads.close()


def test_a_file_that_ends_first_is_a_data_error(data_file):
    path, data, fd = data_file
    reads = DirectReads(BLOCK_BYTES, lambda p: fd)
    try:
        with pytest.raises(DataError, match="truncated"):
            reads.read(path, SIZE - (1 << 20), 2 << 20)
        reads.expect([(path, SIZE - 100_000, 2 << 20)])
        with pytest.raises(DataError, match="truncated"):
            reads.read(path, SIZE - 100_000, 2 << 20)
    finally:
        reads.close()


def test_where_o_direct_is_refused_reads_go_through_the_page_cache(data_file, monkeypatch):
    path, data, _ = data_file
    real_open = os.open

    def no_direct(file, flags, *args):
        if flags & direct._DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # tmpfs before 6.6, some FUSE and network filesystems
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setenv("CKPT_DIRECT_READS", "1")
    sources = SourceFiles(RecordCheck())
    try:
        assert not sources.direct(path, BLOCK_BYTES)
        runs = [(path, 3, SIZE - 3)]
        sources.expect(runs)
        assert b"".join(bytes(v) for v in read_runs(runs, sources)) == data[3:]
    finally:
        sources.close()


def test_a_cached_block_is_read_from_the_cache(data_file):
    path, data, fd = data_file
    os.pread(fd, 1 << 20, 8192)
    assert direct.cached(fd, 8192, 1 << 20) in (True, False)  # False only where cachestat is missing (Linux < 6.5)
    reads = DirectReads(BLOCK_BYTES, lambda p: fd)
    try:
        assert bytes(reads.read(path, 8192, 1 << 20)) == data[8192 : 8192 + (1 << 20)]
    finally:
        reads.close()


@pytest.mark.parametrize("reads", ["1", "0"])  # past the page cache, or through it (the default)
def test_a_flipped_byte_in_a_large_record_fails_the_write(tmp_path, monkeypatch, reads):
    monkeypatch.setenv("CKPT_DIRECT_READS", reads)
    src = tmp_path / "big.pt"
    torch.save({"w": torch.randn(3 << 20), "b": torch.randn(10)}, src)  # a 12 MB record: read past the cache
    good = tmp_path / "good.safetensors"
    blocks = []
    real_read = DirectReads.read
    monkeypatch.setattr(DirectReads, "read", lambda self, *key: blocks.append(key) or real_read(self, *key))
    ckpt_cli.convert(src, good, to="safetensors")
    assert len(blocks) == (3 if direct_here(src) and reads == "1" else 0)
    assert torch.equal(load_file(good)["w"], torch.load(src)["w"])
    raw = bytearray(src.read_bytes())
    at = raw.find(torch.load(src)["w"][1000:1004].numpy().tobytes())
    raw[at] ^= 0x40
    src.write_bytes(raw)
    with pytest.raises(DataError, match="fails its CRC32"):
        ckpt_cli.convert(src, tmp_path / "bad.safetensors", to="safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("size", [0, 100, 64 << 10, (1 << 20) + 3])
def test_crc32_equals_zlibs(size):
    data = random.Random(size).randbytes(size)
    views = [data, bytearray(data), memoryview(bytearray(data))[1:], np.frombuffer(data, np.uint8), memoryview(data)]
    for view in views:
        assert crc32(view) == zlib.crc32(view) and crc32(view, 12345) == zlib.crc32(view, 12345)
