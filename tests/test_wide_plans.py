"""Wide writes hold one output file's segments at a time: the DCP and DeepSpeed writers' rank files are made when the
executor writes them (core/write/plan.py `OutputFile.build`), `.metadata` offsets are planned from sizes alone, and the
source records those files read are still checked against their CRC32. Sources are real FSDP2 + dcp.save and
DeepSpeed saves (conftest); outputs are loaded by torch's own dcp_to_torch_save and by zero_to_fp32's reader."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from conftest import assert_fails
from test_dcp import assert_same_state, flat_state

import ckpt_cli
from ckpt_cli.core.model import box_runs
from ckpt_cli.core.pickles import zipio
from ckpt_cli.core.write.crc import RecordCheck
from ckpt_cli.errors import DataError
from ckpt_cli.formats import torch_save
from ckpt_cli.ops import writes


def _count_archives(monkeypatch) -> list[int]:
    """Counts the chunk archives made for a file (tensor_archive_size makes unscoped stubs)."""
    made = [0]
    real = torch_save.tensor_archive

    def counting(entry, scope):
        if scope:
            made[0] += 1
        return real(entry, scope)

    monkeypatch.setattr(torch_save, "tensor_archive", counting)
    return made


def test_dcp_rank_files_are_made_when_written(fsdp2_saves, tmp_path, monkeypatch):
    made = _count_archives(monkeypatch)
    dest = tmp_path / "w5"
    prepared = writes.prepare(ckpt_cli.reshard_request(fsdp2_saves[2] / "ckpt", dest, world_size=5))
    rank_files = [f for f in prepared.job.plan.files if f.relpath.endswith(".distcp")]
    assert len(rank_files) == 5 and all(f.build is not None and not f.segments for f in rank_files)
    assert made[0] == 0  # planned from sizes: no chunk's segments exist yet
    report = prepared.dry_run()
    assert made[0] == 0 and sum(f["tensors"] for f in report.files) > 0  # the dry run lists chunks without making them
    prepared.write()
    with open(dest / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own output: trusted here
    chunks = sum(len(m.chunks) for m in meta.state_dict_metadata.values() if hasattr(m, "chunks"))
    assert made[0] == chunks  # each made once, when its file was written
    for f in rank_files:  # the planned sizes (and so every offset in .metadata) are what was written
        assert (dest / f.relpath).stat().st_size == f.size
    assert_same_state(flat_state(dest), flat_state(fsdp2_saves[2] / "ckpt"))


def _flip_inside_a_chunk(folder, fqn: str) -> str:
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # torch's own save: trusted here
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    path = folder / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length - 900] ^= 0x10  # inside the chunk's data record
    path.write_bytes(bytes(data))
    os.utime(folder / ".metadata")  # a damaged byte, not a re-save that died (verify's staleness check)
    return info.relative_path


def test_a_damaged_record_read_by_a_built_file_stops_the_write(ckpt, fsdp2_saves, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fsdp2_saves[2] / "ckpt", src)
    name = _flip_inside_a_chunk(src, "model.embed.weight")
    dest = tmp_path / "out"
    assert_fails(ckpt("reshard", src, dest, "--world-size", 5), name, "CRC32")
    assert not dest.exists() and not list(tmp_path.glob("out*"))


def test_deepspeed_stage3_files_are_made_when_written(ckpt, ds_saves, tmp_path, monkeypatch):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = ds_saves[2] / "stage3-fp32"
    dest = tmp_path / "w5"
    prepared = writes.prepare(ckpt_cli.reshard_request(src, dest, world_size=5))
    files = prepared.job.plan.files
    built = [f for f in files if f.build is not None]
    assert len(built) == 2 * 5 - 1  # every rank's model states but rank 0's (it sets the notes) and every optimizer file
    prepared.write()
    for f in files:
        assert (dest / f.relpath).stat().st_size == f.size
    want = get_fp32_state_dict_from_zero_checkpoint(str(src))
    got = get_fp32_state_dict_from_zero_checkpoint(str(dest))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_deepspeed_damaged_partition_stops_a_built_file(ckpt, ds_saves, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ds_saves[2] / "stage3-fp32", src)
    optim = sorted(src.glob("*/*optim_states.pt"))[1]
    with open(optim, "rb") as f:
        records = zipio.read_records(f, str(optim))
    rec = max(records.values(), key=lambda r: r.size)  # the flat fp32 partition
    data = bytearray(optim.read_bytes())
    data[rec.data_offset + rec.size // 2] ^= 0x10
    optim.write_bytes(bytes(data))
    dest = tmp_path / "out"
    assert_fails(ckpt("reshard", src, dest, "--world-size", 3), optim.name, "CRC32")
    assert not dest.exists()


def test_record_check_learns_records_after_it_starts(tmp_path):
    path = tmp_path / "f.bin"
    payload = bytes(range(256)) * 4
    path.write_bytes(payload)
    import zlib

    good = zipio.Record("a", 0, 512, zlib.crc32(payload[:512]))
    bad = zipio.Record("b", 512, 512, zlib.crc32(payload[512:]) ^ 1)
    check = RecordCheck()
    assert not check.wants(str(path), 0, 512)
    check.learn([(str(path), good)])
    check.learn([(str(path), good)])  # learnt twice: one record
    assert check.wants(str(path), 0, 100) and not check.wants(str(path), 512, 10)
    check.add(str(path), 0, 256, zlib.crc32(payload[:256]))
    check.add(str(path), 256, 256, zlib.crc32(payload[256:512]))
    assert not check.wants(str(path), 0, 100)  # verified once covered
    assert check._sorted[str(path)][1] == [None]  # a record checked is let go (a wide write holds none of them)
    check.learn([(str(path), good)])  # learnt again by a later file: stays checked, not read again
    assert not check.wants(str(path), 0, 512) and check._sorted[str(path)][1] == [] and list(check._done[str(path)]) == [0]
    check.learn([(str(path), bad)])
    check.add(str(path), 512, 100, zlib.crc32(payload[512:612]))
    with pytest.raises(DataError, match="fails its CRC32"):
        check.finish()  # the rest read and compared
    outside = zipio.Record("c", 100, 50, zlib.crc32(payload[100:150]))
    check.whole(str(path), outside)  # checked whole without being learnt
    check.whole(str(path), outside._replace(crc=1))  # remembered: not read (nor compared) a second time


@pytest.mark.parametrize(
    "offsets,sizes,shape",
    [((0, 0), (3, 4), (6, 4)), ((1, 2), (2, 2), (4, 5)), ((0, 1), (20, 3), (20, 4)), ((0, 0, 1), (2, 9, 2), (2, 9, 4)), ((2,), (0,), (5,))],
)
def test_box_runs_remembered_or_not_are_the_plain_runs(offsets, sizes, shape):
    import itertools

    import numpy as np

    index = np.arange(int(np.prod(shape))).reshape(shape)
    box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
    for _ in range(2):  # the second call comes from the cache when the box has few runs
        runs = list(box_runs(offsets, sizes, shape))
        flat = list(itertools.chain.from_iterable(range(g, g + n) for g, n, _ in runs))
        assert flat == box.tolist()
        assert [loc for _, _, loc in runs] == list(itertools.accumulate([0] + [n for _, n, _ in runs[:-1]])) if runs else True


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (3, 5)), (torch.bfloat16, (7,)), (torch.int64, ()), (torch.float16, (0, 4))])
def test_a_chunk_archive_carries_its_crc_in_descriptor_and_directory(tmp_path, dtype, shape):
    """A one-tensor archive's trailer is laid out once per dtype and shape with the CRC patched in (torch_save._Trailer):
    zipfile checks every record's CRC against the data, and torch.load gives the tensor back."""
    import math
    import zipfile

    from safetensors.torch import save_file

    import ckpt_cli
    from ckpt_cli.core.write.executor import execute
    from ckpt_cli.core.write.plan import OutputFile, WritePlan

    tensor = (torch.arange(math.prod(shape)) * 3 - 5).to(dtype).reshape(shape)
    save_file({"t": tensor}, tmp_path / "src.safetensors")
    entry = ckpt_cli.open(tmp_path / "src.safetensors").raw.tensors["t"]
    out = tmp_path / "chunk.pt"
    execute(WritePlan("torch", out, False, [OutputFile("", torch_save.tensor_archive(entry, "scope"))]))
    assert out.stat().st_size == torch_save.tensor_archive_size(entry.dtype, entry.shape)
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
    back = torch.load(out, weights_only=True)
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


@pytest.mark.parametrize("order", ["in order", "reversed", "shuffled"])
def test_a_record_read_in_slivers_is_checked_with_one_piece_kept(tmp_path, order):
    """Slivers of one record (a ZeRO-3 flat read one element per parameter by each output rank) are joined as they come:
    the CRC of the whole is checked, a flipped byte found, and the pieces kept stay few whatever the order."""
    import random
    import zlib

    path = tmp_path / "f.bin"
    payload = bytes(random.Random(0).randrange(256) for _ in range(4000))
    path.write_bytes(payload)
    slivers = [(o, 4) for o in range(0, 4000, 4)]
    if order == "reversed":
        slivers.reverse()
    elif order == "shuffled":
        random.Random(1).shuffle(slivers)
    for flip in (False, True):
        data = bytearray(payload)
        if flip:
            data[1999] ^= 1
        check = RecordCheck([(str(path), zipio.Record("flat", 0, 4000, zlib.crc32(bytes(data))))])
        most = 0

        def read_all(check: RecordCheck = check, flip: bool = flip) -> None:
            nonlocal most
            for offset, n in slivers:
                if flip and offset == 1996:
                    continue  # never read: the check reads the gap itself
                check.add(str(path), offset, n, zlib.crc32(payload[offset : offset + n]))
                most = max(most, sum(len(p.parts) for p in check._pieces.values()))
            check.finish()

        if flip:
            with pytest.raises(DataError, match="fails its CRC32"):
                read_all()
        else:
            read_all()
            assert most <= 64  # joined, or checked whole once read in more pieces (crc.SLIVERS)


def test_a_flat_made_by_range_equals_the_flat_made_whole():
    """lazy_flat (pieces made for the range a read asks) gives the elements concat_flat of sub_tensors gives."""
    from ckpt_cli.core.dtypes import FLOAT32
    from ckpt_cli.core.model import FlatRange, LazyPieces, Piece, StoredArray, TensorEntry, concat_flat, lazy_flat, sub_tensor

    arrays = [StoredArray(f"rank{i}", 0, FLOAT32, (10,), (1,)) for i in range(4)]
    sources = []
    for k in range(3):  # tensors of 10 elements in 4 slivers, made by range like a ZeRO-3 parameter
        make = lambda k=k: [Piece(FlatRange(i * 3, min(3, 10 - i * 3)), arrays[i], 0) for i in range(4)]  # noqa: E731
        span = lambda a, n, make=make: [p for p in make() if p.region.start < a + n and p.region.start + p.region.length > a]  # noqa: E731
        sources.append(TensorEntry(f"t{k}", FLOAT32, (10,), "model", LazyPieces(make, 4, by_layout=True, span=span)))
    parts = [(0, sources[0], 2, 5), (7, sources[1], 0, 10), (20, sources[2], 9, 1)]
    lazy = lazy_flat("flat", FLOAT32, 24, parts)
    eager = concat_flat("flat", FLOAT32, 24, [(at, sub_tensor(s, "x", a, (n,))) for at, s, a, n in parts])

    def elements(runs: list, start: int, count: int) -> list[tuple[str, int]]:
        """Where each element of [start, start + count) is read from: (file, element of its stored array)."""
        out = {}
        for g, n, piece, local in runs:
            for i in range(max(g, start), min(g + n, start + count)):
                out[i] = (piece.data.path, local + i - g if piece.data.path != "<zeros>" else 0)
        return [out[i] for i in range(start, start + count)]

    assert elements(lazy.runs(), 0, 24) == elements(eager.runs(), 0, 24)
    for start, count in ((0, 24), (3, 5), (6, 2), (16, 8), (21, 1)):
        assert elements(lazy.runs_in(start, count), start, count) == elements(eager.runs_in(start, count), start, count)
    assert lazy.made_by_range() and not eager.made_by_range()
    assert {a.path for a in lazy.stored_arrays()} == {"<zeros>", "rank0", "rank1", "rank2", "rank3"}


@pytest.mark.parametrize(("world", "tp", "rows"), [(8, 1, 3), (6, 2, 5), (12, 3, 7), (16, 4, 32), (64, 1, 40), (48, 4, 9)])
def test_dedup_keeps_what_torch_dedup_save_plans_keeps(world, tp, rows):
    """The writer's dedup (each item once, with its holders) gives each rank the items torch's own dedup_save_plans
    keeps from the per-rank plans, in the same order: uneven rows (empty chunks held by many ranks), a 2-D mesh
    (tp-split and replicated tensors), a non-tensor value every rank holds."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from ckpt_cli.core import dtypes
    from ckpt_cli.core.model import Checkpoint, ObjectEntry, TensorEntry
    from ckpt_cli.formats.dcp import plan as dcp_plan
    from ckpt_cli.formats.dcp import writer as dcp_writer
    from ckpt_cli.formats.dcp.mesh import Split

    shapes = {"a": (rows, 4), "b": (rows + 1,), "c": (2, rows), "d": (3,)}
    tensors = {n: TensorEntry(n, dtypes.FLOAT32, s, "model", [], (n,)) for n, s in shapes.items()}
    ckpt = Checkpoint("dcp", "", tensors, {"step": ObjectEntry("step", 3, "other", ("step",))})
    splits = {"a": Split(0, None), "b": Split(0, 0), "c": Split(0, 1)}  # "d": replicated
    layout = dcp_writer.Layout((world // tp, tp), splits, [])
    plan, _ = dcp_writer.rank_plans(ckpt, layout)
    ours = [[plan.key(i) for i in positions] for positions in dcp_plan.dedup(plan)]

    plans = []
    for r in range(world):
        items = []
        for i in range(len(plan)):
            if r not in plan.holders(i):
                continue
            fqn, offsets = plan.key(i)
            if plan.which[i] < 0:
                items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
                continue
            tensor = plan.tensors[plan.which[i]]
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(tensor.shape_of(plan.box[i])))
            data = TensorWriteData(chunk, TensorProperties(dtype=torch.float32), torch.Size(tensor.entry.shape))
            items.append(WriteItem(MetadataIndex(fqn, torch.Size(offsets)), WriteItemType.SHARD, tensor_data=data))
        plans.append(SavePlan(items))
    theirs = [
        [(w.index.fqn, tuple(w.index.offset) if w.index.offset is not None else None) for w in p.items] for p in dedup_save_plans(plans)
    ]
    assert ours == theirs


def test_packed_dcp_chunks_make_the_pieces_as_read(ckpt, fsdp2_saves, tmp_path):
    """A DCP tensor's plain chunks are packed (three numbers a chunk) and made again on demand: the same pieces, zip
    records and CRCs included, as those read one by one; a strided chunk keeps its list."""
    from ckpt_cli.core.model import LazyPieces, Piece, StoredArray
    from ckpt_cli.formats.dcp import chunks as dcp_chunks
    from ckpt_cli.ops.source import open_checkpoint

    src = tmp_path / "w5"
    assert ckpt("reshard", fsdp2_saves[2] / "ckpt", src, "--world-size", "5", "-q").code == 0
    packed = open_checkpoint(src, None, None, False)
    plain = open_checkpoint(src, None, None, False, pieces_when_read=True)
    several = [t for t in packed.tensors.values() if len(t.pieces) > 1]
    assert several and all(isinstance(t.pieces, LazyPieces) and not t.pieces._keep for t in several)
    for name, t in packed.tensors.items():
        want = list(plain.tensors[name].pieces)
        assert list(t.pieces) == want and [p.data.record for p in t.pieces] == [p.data.record for p in want], name
    first = several[0].pieces[0]
    strided = Piece(first.region, StoredArray(first.data.path, first.data.offset, first.data.dtype, (1,), (2,), 0, first.data.record))
    kept = [first, strided]
    assert dcp_chunks.pack(kept, first.data.dtype, several[0].shape, dcp_chunks.Paths()) is kept
    # A range read makes only the chunks it meets, and finds the same runs as a walk of every piece
    for t in several[:20]:
        for start, count in [(0, 1), (0, t.numel), (t.numel // 3, t.numel // 4 + 1), (t.numel - 1, 1)]:
            whole = [r for r in plain.tensors[t.name].runs() if r[0] < start + count and r[0] + r[1] > start]
            assert t.runs_in(start, count) == whole, (t.name, start, count)


@pytest.mark.parametrize(
    "shape, boxes",
    [
        ((10, 4), [((0, 0), (3, 4)), ((3, 0), (3, 4)), ((6, 0), (4, 4)), ((10, 0), (0, 4))]),  # rows, an empty chunk
        ((6, 8), [((r, c), (3, 4)) for r in (0, 3) for c in (0, 4)]),  # a 2 x 2 mesh: boxes interleave by row
        ((4, 6, 2), [((0, 0, 0), (4, 3, 2)), ((0, 3, 0), (4, 3, 2))]),  # columns of every row
    ],
)
def test_extents_find_every_box_a_range_meets(shape, boxes):
    """The bisection over the boxes' flat extents returns exactly the boxes holding an element of the range (a box
    whose extent meets the range without holding any of its elements may come too: the runs are filtered after)."""
    import math

    from ckpt_cli.core.model import Box, box_runs
    from ckpt_cli.formats.dcp.chunks import Extents

    extents = Extents(tuple(Box(o, z) for o, z in boxes), shape)
    numel = math.prod(shape)
    for start in range(numel):
        for count in range(1, numel - start + 1):
            found = set(extents.meeting(start, count))
            holding = {i for i, (o, z) in enumerate(boxes) if any(g < start + count and g + n > start for g, n, _ in box_runs(o, z, shape))}
            assert holding <= found, (start, count)
            assert all(boxes[i][1][0] for i in found), "an empty chunk is never made for a range"


def test_storage_index_answers_as_the_dict_it_packs():
    """The packed storage index (formats/dcp_metadata.StorageIndex) gives back every entry as read: chunks of tensors
    stored alike (their offsets shared), a later entry under a key already given (the dict's rule: the later wins),
    a non-tensor value (offsets None), and entries it keeps as read (a transform, a field it does not know, a number
    past 64 bits); and the real `.metadata` of an FSDP2 save (test_dcp) reads through it."""
    from ckpt_cli.formats.dcp.metadata import StorageIndex, StorageInfoRec

    def info(path, offset, length, **more):
        return StorageInfoRec(relative_path=path, offset=offset, length=length, **more)

    entries = [
        (("a", (0, 0)), info("__0_0.distcp", 0, 100)),
        (("a", (4, 0)), info("__1_0.distcp", 0, 100)),
        (("b", (0, 0)), info("__0_0.distcp", 100, 100)),
        (("b", (4, 0)), info("__1_0.distcp", 100, 100)),
        (("c", None), info("__0_0.distcp", 200, 7)),
        (("d", (0,)), info("__0_0.distcp", 207, 9, transform_descriptors=["zstd"])),
        (("e", (0,)), info("__0_0.distcp", 216, 9, newer_field=1)),
        (("f", (0,)), info("__0_0.distcp", 1 << 64, 9)),
    ]
    index, expected = StorageIndex(), {}
    for key, value in entries:
        index[key] = value
        expected[key] = value
    assert index.get(("a", (4, 0))).offset == 0 and index.get(("a", (8, 0))) is None and index.get(("z", None)) is None
    index[("a", (0, 0))] = expected[("a", (0, 0))] = info("__2_0.distcp", 5, 100)  # after a lookup: the later wins
    index[("b", (0, 0))] = expected[("b", (0, 0))] = info("__3_0.distcp", 6, 100)  # before one
    got = dict(index.items())
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        for field in ("relative_path", "offset", "length", "transform_descriptors"):
            assert getattr(got[key], field) == getattr(value, field) == getattr(index.get(key), field), (key, field)
    assert got[("e", (0,))] is expected[("e", (0,))] and got[("e", (0,))].newer_field == 1
    assert len(list(index.values())) == len(expected)
    a, b = index.by_fqn["a"], index.by_fqn["b"]
    index.get(("c", None))
    assert a[0] is b[0] and a[2] is b[2]  # stored alike: one tuple of offsets and one lookup table


def test_tensors_stored_alike_share_their_chunk_records(fsdp2_saves):
    """A DCP read keeps one chunk list and one properties record per layout (formats/dcp_metadata.SharedRecords): the
    Adam moments of a parameter are stored as it is, so they share its chunks. A record with a field ckpt does not
    know is kept as read, and the storage entries are taken out of `.metadata`'s dict as the index is built."""
    from ckpt_cli.core.interface import ReadOptions
    from ckpt_cli.formats.dcp.metadata import ChunkRec, SharedRecords, TensorPropertiesRec, TensorStorageRec, drained
    from ckpt_cli.formats.dcp.reader import DCPReader
    from ckpt_cli.ops.source import open_checkpoint

    folder = fsdp2_saves[2] / "ckpt"
    ckpt = DCPReader().read(folder, ReadOptions(pieces_when_read=True))
    items = ckpt.source.metadata.state_dict_metadata
    weight = next(n for n in items if n.endswith("weight") and not n.startswith("optim"))
    moments = [n for n in items if n.startswith("optim") and weight.removeprefix("model.") in n and "exp_avg" in n]
    assert len(moments) == 2 and all(items[m].chunks is items[weight].chunks for m in moments)
    assert all(items[m].properties is items[weight].properties for m in moments)
    whole = open_checkpoint(folder)  # the pieces made at once: same boxes and bytes as made when read
    assert [p.region for p in ckpt.tensors[weight].pieces] == [p.region for p in whole.tensors[weight].pieces]

    def item(*chunks):
        rec = TensorStorageRec(properties=TensorPropertiesRec(dtype=ckpt.tensors[weight].dtype), size=(4, 2))
        object.__setattr__(rec, "chunks", list(chunks))
        return rec

    shared, newer = SharedRecords(), ChunkRec(offsets=(2, 0), sizes=(2, 2), newer_field=1)
    a, b = item(ChunkRec(offsets=(0, 0), sizes=(2, 2))), item(ChunkRec(offsets=(0, 0), sizes=(2, 2)))
    c, d = item(ChunkRec(offsets=(0, 0), sizes=(4, 2))), item(newer)
    for rec in (a, b, c, d):
        shared.share(rec)
    assert a.chunks is b.chunks and c.chunks is not a.chunks and d.chunks == [newer] and a.properties is d.properties
    entries = {"x": 1, "y": 2, "z": 3}
    taken = []
    for key, value in drained(entries):
        taken.append((key, value, len(entries)))
    assert taken == [("x", 1, 2), ("y", 2, 1), ("z", 3, 0)]


def test_spans_of_a_tensor_made_by_range_follow_its_pieces(ds_saves, tmp_path, monkeypatch):
    """A new ZeRO-3 rank's flat partition made part by part (where its plan of copies cannot serve: a cast) is streamed
    in spans sized from the last span's pieces (core/write/sinks.py SPAN_PIECES): tiny slices make short spans, not a
    piece per element across a million elements at once. And a check of every rank's model states keeps none of them
    parsed (LazyRanks.passing). The output is still what zero_to_fp32 reads from the source."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ckpt_cli.core import copies, reading
    from ckpt_cli.core.write import sinks
    from ckpt_cli.formats.deepspeed.rank_files import LazyRanks
    from ckpt_cli.ops.source import open_checkpoint
    from ckpt_cli.ops.structure import format_check

    wide = tmp_path / "w5"
    writes.prepare(ckpt_cli.reshard_request(ds_saves[2] / "stage3-fp32", wide, world_size=5)).write()
    seen: list[tuple[int, int]] = []
    real = reading.byte_runs_in

    def counting(entry, dst, start, count):
        runs = real(entry, dst, start, count)
        seen.append((start, len(runs or ())))
        return runs

    monkeypatch.setattr(sinks, "byte_runs_in", counting)
    monkeypatch.setattr(copies.PlannedFlat, "copies", lambda self, start, count: None)  # the part by part path, as for a cast
    monkeypatch.setattr(sinks, "SPAN_PIECES", 4)
    monkeypatch.setattr(sinks, "FIRST_SPAN", 64)
    dest = tmp_path / "w3"
    writes.prepare(ckpt_cli.reshard_request(wide, dest, world_size=3)).write()
    later = [n for start, n in seen if start]  # spans after a tensor's first: none when one span takes it whole
    assert len(later) >= 10 and max(later) <= 16  # partitions in several spans, each of a few pieces
    want = get_fp32_state_dict_from_zero_checkpoint(str(ds_saves[2] / "stage3-fp32"))
    got = get_fp32_state_dict_from_zero_checkpoint(str(dest))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ckpt = open_checkpoint(wide)
    assert isinstance(ckpt.source.models, LazyRanks) and format_check(ckpt, False) == []
    assert len(ckpt.source.models.loaded) <= 1  # rank 0's, held by the read


def test_a_new_stage3_rank_holds_no_object_per_parameter(ds_saves, tmp_path):
    """A new ZeRO-3 rank's model-states file streams only its non-empty tensors: its params' placeholder records are
    empty, so their bytes and CRCs are known (an MoE model's 20,000 params made 60,000 segments, held while the
    file was written). Its flat partitions' parts follow from the rank's number (Stage3RankParts),
    not a tuple per param per rank. torch loads the file as DeepSpeed does, the source's placeholders in it."""
    from ckpt_cli.core.write.plan import TensorData
    from ckpt_cli.formats.deepspeed.stage3_reshard import Stage3RankParts

    src = ds_saves[2] / "stage3-fp32"
    dest = tmp_path / "w3"
    prepared = writes.prepare(ckpt_cli.reshard_request(src, dest, world_size=3))
    files = {f.relpath.rsplit("/", 1)[-1]: f for f in prepared.job.plan.files}
    segments = files["zero_pp_rank_1_mp_rank_00_model_states.pt"].parts()
    stored = [s for s in segments if isinstance(s, TensorData) and s.size]  # buffers: only non-empty tensors stream
    placeholders = [s for s in segments if isinstance(s, TensorData) and not s.size]  # listed last, for the report
    assert len(segments) <= 3 * len(stored) + 2 + len(placeholders) and segments[-len(placeholders) :] == placeholders
    optimizer = files["zero_pp_rank_1_mp_rank_00_optim_states.pt"].parts()
    flats = [s.tensor for s in optimizer if isinstance(s, TensorData) and "fp32_flat_groups" in s.tensor.name]
    assert flats and all(isinstance(t.pieces._layout.parts, Stage3RankParts) for t in flats)
    prepared.write()
    [source_file] = src.glob("*/zero_pp_rank_1_mp_rank_00_model_states.pt")
    want = torch.load(source_file, map_location="cpu", weights_only=False)["module"]
    got = torch.load(dest / source_file.parent.name / source_file.name, map_location="cpu", weights_only=False)["module"]
    assert list(got) == list(want) and all(torch.equal(v, w) for v, w in zip(got.values(), want.values()))
    assert sum(v.numel() == 0 for v in got.values()) == len(placeholders) >= len(stored) + 4
    names = files["zero_pp_rank_1_mp_rank_00_model_states.pt"].tensor_names()
    assert {f"module.{k}" for k in got} <= set(names)  # the write report still names every tensor the file holds


def test_a_zero3_reshard_of_slivers_is_written_by_one_thread_unless_asked(ds_saves, tmp_path, monkeypatch):
    """A ZeRO-3 reshard whose params are small next to the world size (each rank file thousands of slivers, made by
    Python arithmetic under the GIL) asks for one writing thread by default (WritePlan.threads); --workers still
    decides when given, and a plan without the limit gets the usual default."""
    from ckpt_cli.core.write import executor
    from ckpt_cli.core.write.plan import WritePlan
    from ckpt_cli.formats.deepspeed import stage3_reshard

    src = ds_saves[2] / "stage3-fp32"
    plan = writes.prepare(ckpt_cli.reshard_request(src, tmp_path / "w3", world_size=3)).job.plan
    assert plan.threads == 1
    monkeypatch.setattr(executor.os, "cpu_count", lambda: 8)
    assert executor.worker_count(None, plan.threads) == 1 and executor.worker_count(3, plan.threads) == 3
    assert executor.worker_count(None, WritePlan("x", tmp_path, True, []).threads) == 4
    monkeypatch.setattr(stage3_reshard, "SLIVER", 1)  # every share "large": the plan leaves the default alone
    assert writes.prepare(ckpt_cli.reshard_request(src, tmp_path / "w3b", world_size=3)).job.plan.threads is None


def test_a_dcp_reshard_of_small_chunks_is_written_by_one_thread_unless_asked(fsdp2_saves, tmp_path, monkeypatch):
    """Rank files of small chunks (each a torch.save archive made by Python under the GIL) ask for one writing thread
    by default; a plan of large chunks leaves the default alone."""
    from ckpt_cli.formats.dcp import writer as dcp_writer

    src = fsdp2_saves[2] / "ckpt"
    assert writes.prepare(ckpt_cli.reshard_request(src, tmp_path / "w3", world_size=3)).job.plan.threads == 1
    monkeypatch.setattr(dcp_writer, "SMALL_CHUNK", 1)  # every chunk "large"
    assert writes.prepare(ckpt_cli.reshard_request(src, tmp_path / "w3b", world_size=3)).job.plan.threads is None


def test_a_batched_write_gives_the_heap_back_once_grown(monkeypatch):
    """malloc_trim after every batch made each small file's next batch fault its pages back in; the heap is given
    back once the process has grown by RISE since the last time, and at once where its size cannot be read."""
    from ckpt_cli.core import heap

    trims: list[int] = []
    sizes = iter([100 << 20, 90 << 20, 95 << 20, 97 << 20, 120 << 20, 100 << 20])
    monkeypatch.setattr(heap, "give_back", lambda: trims.append(1))
    monkeypatch.setattr(heap, "_resident", lambda: next(sizes))
    monkeypatch.setattr(heap, "_RSS_AFTER_TRIM", [0])
    for _ in range(4):
        heap.give_back_when_grown()
    assert len(trims) == 2  # 100 MB (trimmed to 90), 95 and 97 (under 90 + 8), 120 (trimmed to 100)
    monkeypatch.setattr(heap, "_resident", lambda: None)
    heap.give_back_when_grown()
    assert len(trims) == 3
