"""Orbax's default chunks (zarr v2, zstd, in OCDBT) decoded as a stream a window at a time (formats/orbax/stream.py):
every read equals tensorstore's decode of the whole chunk, in any order and from several readers at once; a damaged
or cut frame is one line naming the data file, exit 1, no output."""

from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorstore")
pytest.importorskip("zstandard")

SAVE = "scanned/10"


def streamed(folder: Path) -> dict:
    from ckpt_cli.core.interface import ReadOptions
    from ckpt_cli.formats.orbax.reader import OrbaxReader

    ckpt = OrbaxReader().read(folder, ReadOptions())
    return {name: t.derived for name, t in ckpt.tensors.items() if t.derived.stream is not None}


def by_tensorstore(array, start: int, count: int) -> np.ndarray:
    from ckpt_cli.formats.orbax import arrays

    store = arrays._open(array.spec)
    return np.concatenate([np.ascontiguousarray(p).reshape(-1) for p in arrays._flat_range(store, array.shape, start, count)]).view(
        np.uint8
    )


def test_streamed_reads_equal_tensorstores(maxtext_saves):
    found = streamed(maxtext_saves / SAVE)
    assert len(found) >= 30  # every array but the scalars and the 1-row ones
    rng = random.Random(0)
    for name, array in found.items():
        numel = int(np.prod(array.shape))
        whole = by_tensorstore(array, 0, numel)
        got = np.concatenate([array.read_raw(s, n) for s, n in array.windows()])
        assert np.array_equal(got, whole), name
        for _ in range(5):  # anywhere, backwards too: a cursor goes on, or a new one starts
            start = rng.randrange(numel)
            count = rng.randrange(1, numel - start + 1)
            size = array.dtype.itemsize
            assert np.array_equal(array.read_raw(start, count), whole[start * size : (start + count) * size]), name


def test_streamed_reads_from_several_threads(maxtext_saves):
    """Two readers of one array in turns (a DCP write's two ranks): each has a cursor of its own."""
    array = max(streamed(maxtext_saves / SAVE).values(), key=lambda a: int(np.prod(a.shape)))
    numel, size = int(np.prod(array.shape)), array.dtype.itemsize
    whole = by_tensorstore(array, 0, numel)
    errors: list[str] = []

    def read(first: int, last: int) -> None:
        for start in range(first, last, 97):
            count = min(97, last - start)
            if not np.array_equal(array.read_raw(start, count), whole[start * size : (start + count) * size]):
                errors.append(f"{start}")

    threads = [threading.Thread(target=read, args=(0, numel // 2)), threading.Thread(target=read, args=(numel // 2, numel))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("damage", ["magic", "cut"])
def test_a_damaged_frame_is_one_line(maxtext_saves, ckpt, tmp_path, damage):
    """A frame whose header is not zstd's, or a data file cut inside a frame. (A changed byte inside a frame's raw
    block decodes: zstd as Orbax writes it has no checksum, and tensorstore returns it too; a manifest catches it.)"""
    from ckpt_cli.formats.orbax import ocdbt

    shutil.copytree(maxtext_saves / "scanned", tmp_path / "run")
    item = tmp_path / "run" / "10" / "items"
    ref = max(
        (r for r in ocdbt.references(item) if r.key and r.key.startswith("params.params.decoder.layers.mlp.wi_0.kernel/")),
        key=lambda r: r.length,
    )
    path = item / ref.file
    data = bytearray(path.read_bytes())
    if damage == "magic":
        data[ref.offset : ref.offset + 4] = bytes(4)
    else:
        del data[ref.offset + ref.length // 2 :]
    path.write_bytes(bytes(data))
    res = ckpt("convert", tmp_path / "run", tmp_path / "out.safetensors", "--to", "safetensors")
    errors = [line for line in res.err.strip().splitlines() if not line.startswith("note:")]
    assert res.code == 1 and len(errors) == 1 and "Traceback" not in res.err, res.err
    assert str(path) in errors[0] and "mlp.wi_0.kernel" in errors[0], errors
    assert not (tmp_path / "out.safetensors").exists()


def test_streamed_chunks_from_s3(maxtext_saves, ckpt, s3, tmp_path):
    """The same frames read by range from S3 objects (moto): the release is byte-equal to the local one."""
    url = s3.upload(maxtext_saves / "scanned", "maxtext/scanned") + "/10"
    for src, out in ((url, tmp_path / "s3"), (maxtext_saves / SAVE, tmp_path / "here")):
        res = ckpt("convert", src, out, "--to", "hf", "--preset", "maxtext-llama", "--hf-config", maxtext_saves / "hf-config")
        assert res.code == 0, res.err
    shard = "model-00001-of-00001.safetensors"
    assert (tmp_path / "s3" / shard).read_bytes() == (tmp_path / "here" / shard).read_bytes()


def test_a_frame_longer_than_its_chunk_is_refused(maxtext_saves):
    """A frame that decodes to more bytes than the chunk holds (tensorstore refuses it): the read that ends the chunk
    says so, naming the data file."""
    from ckpt_cli.errors import DataError
    from ckpt_cli.formats.orbax.stream import ChunkStream

    array = streamed(maxtext_saves / SAVE)["items.params.params.decoder.logits_dense.kernel"]
    real = array.stream
    short = ChunkStream(real.item, real.name, (real.rows - 1, *array.shape[1:]), real.chunk_rows - 1, real.row_bytes, real.separator)
    with pytest.raises(DataError, match="decodes to more than its"):
        short.read(0, short.chunk_bytes())
