"""Unit tests of the core: piece geometry, tiling, sizes, sharding, the safe unpickler, the executor.

Hand-made inputs here are extra unit tests; the proofs use files from the real producers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conftest import mixed_state_dict
from safetensors.torch import load_file

from ckpt_cli.core import dtypes
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Box, Checkpoint, FlatRange, Piece, StoredArray, TensorEntry, box_runs, contiguous_strides
from ckpt_cli.core.pickles.safe_pickle import safe_loads
from ckpt_cli.core.sizes import parse_size
from ckpt_cli.core.write.executor import execute
from ckpt_cli.errors import DataError, UnsafePickleError, UsageError
from ckpt_cli.formats import safetensors, torch_save
from ckpt_cli.formats.hf.folder import shard_groups

F32 = dtypes.FLOAT32


def test_box_runs_row_shards_are_single_runs():
    # FSDP2 on 4 ranks of a (5, 6) tensor: torch.chunk rows, an empty chunk at the end (docs/formats.md §1.6).
    chunks = [((0, 0), (2, 6)), ((2, 0), (2, 6)), ((4, 0), (1, 6)), ((5, 0), (0, 6))]
    runs = [list(box_runs(o, s, (5, 6))) for o, s in chunks]
    assert runs == [[(0, 12, 0)], [(12, 12, 0)], [(24, 6, 0)], []]


def test_box_runs_column_blocks_and_scalars():
    assert list(box_runs((1, 2), (2, 2), (4, 5))) == [(7, 2, 0), (12, 2, 2)]
    assert list(box_runs((), (), ())) == [(0, 1, 0)]
    assert list(box_runs((0, 0, 0), (2, 3, 4), (2, 3, 4))) == [(0, 24, 0)]


def _entry(pieces, shape=(10,)):
    return TensorEntry("t", F32, shape, "model", pieces)


def _array(n):
    return StoredArray("/dev/null", 0, F32, (n,), (1,))


def test_tiling_problems():
    ok = _entry([Piece(FlatRange(0, 4), _array(4)), Piece(FlatRange(4, 6), _array(6))])
    assert ok.tiling_problem() is None
    gap = _entry([Piece(FlatRange(0, 4), _array(4)), Piece(FlatRange(5, 5), _array(5))])
    assert "no piece covers elements 4..4" in gap.tiling_problem()
    overlap = _entry([Piece(FlatRange(0, 6), _array(6)), Piece(FlatRange(4, 6), _array(6))])
    assert "overlap" in overlap.tiling_problem()
    short = _entry([Piece(FlatRange(0, 4), _array(4))])
    assert "4..9" in short.tiling_problem()


def test_executor_assembles_flat_and_box_pieces_with_casts(tmp_path):
    """A tensor stored as out-of-order flat ranges (ZeRO-like) and one stored as 2-d blocks (DCP-like)."""
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    raw = tmp_path / "raw.bin"
    flat = full.reshape(-1)
    blocks = [full[:2, :3], full[:2, 3:], full[2:, :3].t().contiguous().t(), full[2:, 3:].to(torch.bfloat16)]
    payload = [flat[12:], flat[:12]] + [b.contiguous() if i != 2 else b.t().contiguous() for i, b in enumerate(blocks)]
    offsets, pos = [], 0
    with open(raw, "wb") as f:
        for t in payload:
            offsets.append(pos)
            data = t.view(torch.uint8).numpy().tobytes()
            f.write(data)
            pos += len(data)
    p = str(raw)
    zero = TensorEntry(
        "zero",
        F32,
        (4, 6),
        "optimizer",
        [
            Piece(FlatRange(12, 12), StoredArray(p, offsets[0], F32, (12,), (1,))),
            Piece(FlatRange(0, 12), StoredArray(p, offsets[1], F32, (12,), (1,))),
        ],
    )
    boxes = [((0, 0), F32, (1, 3)), ((0, 3), F32, (3, 1)), ((2, 0), F32, None), ((2, 3), dtypes.by_name("bf16"), (3, 1))]
    pieces = []
    for i, (origin, dt, stride) in enumerate(boxes):
        shape = (2, 3)
        stride = contiguous_strides(shape) if stride != (1, 3) or i != 2 else stride
        if i == 2:
            stride = (1, 2)  # stored transposed: column-major
        else:
            stride = contiguous_strides(shape)
        pieces.append(Piece(Box(origin, shape), StoredArray(p, offsets[2 + i], dt, shape, stride)))
    dcp_like = TensorEntry("blocks", F32, (4, 6), "model", pieces)
    ckpt = Checkpoint("test", p, {"zero": zero, "blocks": dcp_like})
    execute(safetensors.WRITER.plan(ckpt, tmp_path / "out.safetensors", WriteOptions()))
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["zero"], full)
    expected = full.clone()
    expected[2:, 3:] = full[2:, 3:].to(torch.bfloat16).float()
    assert torch.equal(out["blocks"], expected)
    execute(torch_save.WRITER.plan(ckpt, tmp_path / "out.pt", WriteOptions()))
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["zero"], full)


def test_executor_refuses_a_gap(tmp_path):
    (tmp_path / "raw").write_bytes(bytes(40))
    entry = TensorEntry("t", F32, (10,), "model", [Piece(FlatRange(0, 4), StoredArray(str(tmp_path / "raw"), 0, F32, (4,), (1,)))])
    with pytest.raises(DataError, match="no piece covers"):
        execute(safetensors.WRITER.plan(Checkpoint("x", "x", {"t": entry}), tmp_path / "o.safetensors", WriteOptions()))
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize(
    "text,value",
    [("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 500 * 10**6), ("1048576", 1048576), ("1.5kb", 1500), ("2 MiB", 2 * 2**20)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["5XB", "", "GB", "-1", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_num_shards_balances_and_never_leaves_a_shard_empty():
    def tensors(sizes):
        return [TensorEntry(f"t{i}", F32, (n,), "model", []) for i, n in enumerate(sizes)]

    for sizes, n in [([1] * 10, 3), ([1000, 1, 1, 1], 4), ([1, 1, 1, 1000], 2), ([5, 5], 2), ([100] * 7, 7)]:
        groups = shard_groups(tensors(sizes), None, n)
        assert len(groups) == n and all(groups), (sizes, n, groups)
        assert [t.name for g in groups for t in g] == [f"t{i}" for i in range(len(sizes))]
    even = shard_groups(tensors([10] * 12), None, 4)
    assert [len(g) for g in even] == [3, 3, 3, 3]
    with pytest.raises(UsageError):
        shard_groups(tensors([1, 1]), None, 3)


class Boom:
    def __reduce__(self):
        return (print, ("ran",))


def test_safe_unpickler_refuses_globals_and_reads_plain_values():
    with pytest.raises(UnsafePickleError, match="builtins.print.*nothing was executed"):
        safe_loads(pickle.dumps({"x": Boom()}, protocol=2), "f.pt")
    value = {"a": [1, 2.5, "s", b"bytes", (1, 2)], "arr": np.arange(3, dtype=np.uint32), "o": {1: None}}
    loaded = safe_loads(pickle.dumps(value, protocol=2), "f.pt")
    assert loaded["a"] == value["a"] and np.array_equal(loaded["arr"], value["arr"])
    with pytest.raises(DataError, match="unreadable pickle"):
        safe_loads(b"\x80\x02}q\x00(X", "f.pt")


def test_key_layout():
    """get_state_dict nests model/optim; torchtitan keeps model keys at the top (an HF model's own "model." too)."""
    from ckpt_cli.core.roles import key_layout

    assert key_layout([("model", "w"), ("optim", "state", "w", "exp_avg"), ("step",)]) == "get_state_dict"
    assert key_layout([("model", "w"), ("optimizer", "state", "w", "exp_avg"), ("lr_scheduler", "last_epoch")]) == "get_state_dict"
    assert key_layout([("w",), ("optimizer", "state.w.exp_avg"), ("train_state", "step")]) == "torchtitan"
    assert key_layout([("model", "layers", "w"), ("lm_head", "w"), ("optimizer", "state.model.layers.w.exp_avg")]) == "torchtitan"
    assert key_layout([("model", "w")]) == "get_state_dict" and key_layout([("w",)]) == "flat"


def test_crc32_combine_and_split_runs():
    import os
    import zlib

    from ckpt_cli.core.write.crc import crc32_combine
    from ckpt_cli.core.write.sinks import split_runs

    for a, b in [(b"", b"x"), (b"hello ", b"world"), (os.urandom(1000), os.urandom(77777)), (os.urandom(5), b"")]:
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    chunks = split_runs([("a", 0, 10), ("b", 100, 25)], 12)
    assert chunks == [[("a", 0, 10), ("b", 100, 2)], [("b", 102, 12)], [("b", 114, 11)]]


def test_threads_sharing_one_file_write_the_same_bytes(ckpt, mixed_files, tmp_path, monkeypatch):
    """One output file, large CRC-bearing tensors cut into pieces copied by 2 threads at their offsets (CRCs
    combined): byte-identical to one thread (torch zip); safetensors (kernel copies) stays one job per tensor."""
    from ckpt_cli.core.write import executor

    monkeypatch.setattr(executor, "CHUNK_BYTES", 16)  # every tensor over 32 bytes is shared
    for name in ("merged.safetensors", "merged.pt"):
        one, two = tmp_path / "one" / name, tmp_path / "two" / name
        assert ckpt("merge", mixed_files["hf"], one, "--workers", "1", "--all" if name.endswith(".pt") else "--weights-only").code == 0
        assert ckpt("merge", mixed_files["hf"], two, "--workers", "2", "--all" if name.endswith(".pt") else "--weights-only").code == 0
        assert one.read_bytes() == two.read_bytes()
    assert sorted(torch.load(tmp_path / "two" / "merged.pt", weights_only=True)) == sorted(mixed_state_dict())


def test_a_large_pickle_is_read_in_pieces_let_go_as_read():
    """A pickle past LEAN_FROM reaches the unpickler in 1 MB pieces dropped once read, and builds the same value."""
    import pickle

    from ckpt_cli.core.pickles import pickle_guard, pickle_stream
    from ckpt_cli.core.pickles.safe_pickle import safe_loads

    value = {f"layers.{i}.weight": [i, (i, i + 1), "x" * (i % 50)] for i in range(60_000)}
    data = pickle.dumps(value, protocol=4)
    assert len(data) > 2 * pickle_guard.LEAN_FROM
    assert safe_loads(data, "x") == value
    stream = pickle_stream.reader(data)
    pieces = stream.raw.pieces
    count = len(pieces)
    assert count == -(-len(data) // (1 << 20))
    assert stream.read(3 << 20) == data[: 3 << 20] and len(pieces) <= count - 2  # what was read is let go
    assert stream.read() == data[3 << 20 :] and not pieces


@pytest.mark.parametrize("budget", [None, 300 << 10])
def test_read_ahead_windows_stay_within_their_budget_over_many_files(tmp_path, monkeypatch, budget):
    """Small reads from many rank files in turn (a wide reshard or merge) go through one read-ahead window a file; the
    windows together stay within WINDOW_BUDGET (sized once each, 1,024 files' windows had reached 240 MB of a 64 MB
    budget), or the reader's own smaller budget (diff's two readers share one), and every read returns the file's
    bytes, at a window's edge and at the end of a file too."""
    from ckpt_cli.core import reading

    monkeypatch.setattr(reading, "WINDOW_BYTES", 256 << 10)
    monkeypatch.setattr(reading, "WINDOW_BUDGET", 1 << 20)
    rng = np.random.default_rng(0)
    files = []
    for i in range(40):
        path = tmp_path / f"__{i}_0.distcp"
        path.write_bytes(rng.integers(0, 256, 512 << 10, dtype=np.uint8).tobytes())
        files.append((str(path), path.read_bytes()))
    sources = reading.SourceFiles(window_budget=budget)
    limit = reading.WINDOW_BUDGET if budget is None else budget
    try:
        for offset in [*range(0, 300_000, 7_000), (512 << 10) - 100]:
            for path, data in files:
                buf = bytearray(100)
                sources.pread_into(path, offset, buf)
                assert bytes(buf) == data[offset : offset + 100], (path, offset)
                held = sum(len(window) for _, window in sources._windows.values())
                assert held <= limit, (held, path, offset)
        assert held == sources._window_bytes  # the running count the budget is checked against
    finally:
        sources.close()


def test_dtype_digest_tells_names_dtypes_and_order_apart():
    """What a source keeps to refuse a reshard through a view (selected, renamed or cast tensors): the same names and
    dtypes in the same order give the same digest, and anything else another, wherever the text boundaries fall."""
    from types import SimpleNamespace as Entry

    f32, bf16 = dtypes.FLOAT32, dtypes.BY_NAME["bfloat16"]
    base = {"a.weight": Entry(dtype=f32), "a.bias": Entry(dtype=bf16)}
    same = {"a.weight": Entry(dtype=f32), "a.bias": Entry(dtype=bf16)}
    others = [
        {"a.bias": Entry(dtype=bf16), "a.weight": Entry(dtype=f32)},  # order
        {"a.weight": Entry(dtype=f32), "a.bias": Entry(dtype=f32)},  # a cast
        {"a.weight": Entry(dtype=f32)},  # a filter
        {"a.weightfloat32a.bias": Entry(dtype=bf16)},  # boundaries moved
        {"x.weight": Entry(dtype=f32), "a.bias": Entry(dtype=bf16)},  # a rename
    ]
    digests = {dtypes.dtype_digest(t) for t in others}
    assert dtypes.dtype_digest(base) == dtypes.dtype_digest(same) and len(digests) == len(others)
    assert dtypes.dtype_digest(base) not in digests
