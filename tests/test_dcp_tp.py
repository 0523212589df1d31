"""DTensor layouts in DCP beyond Shard(0) (issue 13 item 2): FSDP2 + tensor parallel on a 2-D (dp, tp) mesh, with
_StridedShard, Shard(1) and grouped experts; read, verify, export, and reshard to another dp x tp mesh loaded by
dcp.load + set_state_dict (fixture `dcp_tp`, tests/producers/dcp_tp.py). The placement arithmetic of
formats/dcp/mesh.py is checked on numbers against torch's own."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DCP_TP_MESHES, assert_fails, assert_same_tensors

from ckpt_cli.core.boxes import sub_box
from ckpt_cli.core.dtypes import by_name
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Box, FlatRange, Piece, StoredArray, TensorEntry
from ckpt_cli.formats.dcp import reader as dcp
from ckpt_cli.formats.dcp.mesh import SourceMesh, Split, chunk_of, chunks, fits, source_mesh, strided

# ---- the placement arithmetic, on numbers ------------------------------------------------------------------------


def test_chunks_as_torch_saved_them():
    """The boxes the 2x2 save recorded (read from its .metadata): a colwise embedding of 37 rows is
    (_StridedShard(0, sf=2), Shard(0)), a rowwise weight (Shard(0), Shard(1)), a 3-row head leaves rank 3 empty."""
    assert chunks((37, 12), Split(0, 0), (2, 2)) == [((0, 0), (10, 12)), ((19, 0), (9, 12)), ((10, 0), (9, 12)), ((28, 0), (9, 12))]
    assert chunks((12, 22), Split(0, 1), (2, 2)) == [((0, 0), (6, 11)), ((0, 11), (6, 11)), ((6, 0), (6, 11)), ((6, 11), (6, 11))]
    assert chunks((3,), Split(0, 0), (2, 2)) == [((0,), (1,)), ((2,), (1,)), ((1,), (1,)), ((3,), (0,))]
    assert chunks((4, 12, 8), Split(1, 0), (2, 2))[1] == ((2, 0, 0), (2, 6, 8))  # experts: FSDP on dim 1, tp on the expert dim
    assert chunks((12,), Split(0, None), (2, 2)) == [((0,), (6,)), ((0,), (6,)), ((6,), (6,)), ((6,), (6,))]  # replicated over tp
    assert chunks((5, 6), Split(0, None), (4, 1))[3] == ((5, 0), (0, 6))  # FSDP alone: §1.6's empty chunk


def test_strided_is_torchs_not_fsdps_when_uneven():
    """7 rows on 3 x 2: FSDP holds row 6 on (dp 2, tp 1), torch's _StridedShard arithmetic (what DCP records) on (2, 0)."""
    assert strided(7, 3, 2, 2, 0) == (6, 1)
    assert strided(7, 3, 2, 2, 1) == (7, 0)
    assert strided(22, 2, 2, 1, 1) == (17, 5)  # even enough: FSDP's chunk 1 of tp chunk 1 (rows 11..21)


def test_strided_is_arithmetic_on_a_long_dim():
    """strided() counts runs of indices, not a list of every index: a 1-d tensor of 21M elements resharded from a DCP
    of 4 ranks had held 800 MB of ints while the source mesh was solved (benchmarks/beyond_ram.py)."""
    import tracemalloc

    def listed(n, dp, tp, i, t):  # torch's arithmetic spelt out: the indices coordinate i takes, then its t-th chunk
        picked = []
        for j in range(tp):
            per = -(-n // tp)
            part, length = min(per * j, n), min(per * (j + 1), n) - min(per * j, n)
            per_dp = -(-length // dp)
            start = min(per_dp * i, length)
            picked += range(part + start, part + min(start + per_dp, length))
        per = -(-len(picked) // tp)
        start, count = min(per * t, len(picked)), min(per * (t + 1), len(picked)) - min(per * t, len(picked))
        return (picked[start], count) if count else (n, 0)

    for n, dp, tp in [(7, 3, 2), (40, 3, 4), (13, 5, 3), (1, 4, 4), (64, 4, 1)]:
        assert all(strided(n, dp, tp, i, t) == listed(n, dp, tp, i, t) for i in range(dp) for t in range(tp))
    tracemalloc.start()
    assert strided(5 * 2**22, 4, 1, 3, 0) == (15 * 2**20, 5 * 2**20)
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


def test_chunks_agree_with_torch():
    """chunk_of equals compute_local_shape_and_global_offset (torch/distributed/tensor/_utils.py) for the placements
    FSDP2 + TP give, on every coordinate of meshes up to 4 x 4 and shapes that shard unevenly or not at all."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    def placements(split: Split, tp: int) -> list:
        if split.dp_dim is None:
            dp_p = Replicate()
        elif split.dp_dim == split.tp_dim and tp > 1:
            dp_p = _StridedShard(split.dp_dim, split_factor=tp)
        else:
            dp_p = Shard(split.dp_dim)
        return [dp_p, Replicate() if split.tp_dim is None else Shard(split.tp_dim)]

    shapes = [(n,) for n in (0, 1, 3, 5, 7, 8, 13, 37)] + [(3, 7), (6, 1), (0, 5), (4, 12, 8)]
    checked = 0
    for shape in shapes:
        splits = [Split(d, t) for d in (None, *range(len(shape))) for t in (None, *range(len(shape)))]
        for dp in range(1, 5):
            for tp in range(1, 5):
                for split in splits:
                    for r in range(dp * tp):
                        sizes, offsets = _compute_local_shape_and_global_offset(shape, (dp, tp), list(divmod(r, tp)), placements(split, tp))
                        assert chunk_of(shape, split, (dp, tp), r) == (tuple(offsets), tuple(sizes)), (shape, split, dp, tp, r)
                        checked += 1
    assert checked == 7500


def test_fits_tells_the_split_by_the_ranks_holding_each_chunk():
    """(Shard(0), Shard(1)) and (Shard(1), Shard(0)) give the same boxes on a 2x2 mesh; the file each chunk is in
    (the rank that saved it) tells them apart. A replicated chunk is in one of its holders' files."""
    shape, mesh = (4, 12, 8), (2, 2)
    experts = chunks(shape, Split(1, 0), mesh)
    assert set(experts) == set(chunks(shape, Split(0, 1), mesh))
    assert fits(shape, frozenset((c, None) for c in experts), mesh)[:2] == [Split(0, 1), Split(1, 0)]
    assert fits(shape, frozenset((c, r) for r, c in enumerate(experts)), mesh) == [Split(1, 0)]

    def halves(first: int, second: int) -> frozenset:  # rows 0..5 in rank first's file, 6..11 in rank second's
        return frozenset({(((0,), (6,)), first), (((6,), (6,)), second)})

    assert fits((12,), halves(1, 2), mesh) == [Split(0, None)]  # (Shard(0),) on dp: ranks 0, 1 hold rows 0..5
    assert fits((12,), halves(2, 3), mesh) == [Split(None, 0)]  # (Replicate(), Shard(0)): ranks 0, 2 hold rows 0..5
    assert fits((12,), halves(0, 3), mesh) == [Split(0, None), Split(None, 0)]
    assert fits((12,), halves(3, 0), mesh) == []


def test_source_mesh():
    """The smallest tp that explains every tensor; FSDP alone says nothing about tensor parallel."""

    def saved(shape: tuple[int, ...], split: Split, mesh: tuple[int, int]) -> tuple:
        return shape, frozenset((c, r) for r, c in enumerate(chunks(shape, split, mesh)))

    two_d = {
        "up": saved((22, 12), Split(0, 0), (2, 2)),
        "down": saved((12, 22), Split(0, 1), (2, 2)),
        "norm": (lambda s: (s[0], frozenset(x for x in s[1] if x[1] in (0, 2))))(saved((12,), Split(0, None), (2, 2))),
    }
    found = source_mesh(two_d, 4)
    assert isinstance(found, SourceMesh) and (found.dp, found.tp) == (2, 2) and found.tensor_parallel
    assert found.splits == {"up": Split(0, 0), "down": Split(0, 1), "norm": Split(0, None)}
    fsdp = source_mesh({"up": saved((22, 12), Split(0, None), (4, 1))}, 4)
    assert isinstance(fsdp, SourceMesh) and fsdp.tp == 1 and not fsdp.tensor_parallel
    pure_tp = source_mesh({"up": saved((22, 12), Split(0, 0), (1, 4)), "down": saved((12, 22), Split(0, 1), (1, 4))}, 4)
    assert isinstance(pure_tp, SourceMesh) and (pure_tp.dp, pure_tp.tp) == (1, 4) and pure_tp.others == ("4x1",)  # not Shard(1) FSDP
    odd = source_mesh({"x": ((6,), frozenset({(((0,), (1,)), 0), (((1,), (5,)), 1)}))}, 2)
    assert isinstance(odd, str) and "'x'" in odd


def test_sub_box_pieces():
    """A column range of a tensor stored as two row boxes: one flat piece per row, pointing into the right box."""
    f32 = by_name("fp32")
    top = Piece(Box((0, 0), (2, 4)), StoredArray("a", 0, f32, (2, 4), (4, 1)))
    bottom = Piece(Box((2, 0), (1, 4)), StoredArray("b", 0, f32, (1, 4), (4, 1)))
    part = sub_box(TensorEntry("t", f32, (3, 4), "model", [top, bottom]), "t", (1, 2), (2, 2))
    assert part.shape == (2, 2) and part.tiling_problem() is None
    assert [(p.region, p.data.path, p.data_start) for p in part.pieces] == [(FlatRange(0, 2), "a", 6), (FlatRange(2, 2), "b", 2)]


# ---- the real 2x2 save: read, verify, export ----------------------------------------------------------------------


def _reference(root: Path, config: str = "tp") -> dict:
    return torch.load(root / "references" / f"{config}.pt", weights_only=False)


def test_saved_placements(dcp_tp):
    """The fixture holds the layouts the issue names: _StridedShard, Shard(1), FSDP alone, grouped experts."""
    placements = _reference(dcp_tp)["placements"]
    assert placements["embed.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["block.down.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["block.down.bias"] == "(Shard(dim=0), Replicate())"
    assert placements["norm.weight"] == "(Shard(dim=0),)"
    assert placements["experts.w1"] == "(Shard(dim=1), Shard(dim=0))"
    assert placements["experts.w2"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


def test_inspect_lists_every_tensor(dcp_tp, ckpt):
    res = ckpt("inspect", dcp_tp / "tp", "--json", "--tensors")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    ref = _reference(dcp_tp)
    want = {k: list(v.shape) for k, v in ref.items() if k.startswith(("model.", "optim.state."))}
    assert {t["name"]: t["shape"] for t in doc["tensors"]} == want
    assert doc["world_size"] == 4 and doc["step"] == 2
    assert {t["name"]: t["pieces"] for t in doc["tensors"]}["model.block.down.weight"] == 4


def _chunk_data(folder: Path, fqn: str, offsets: tuple[int, ...]) -> tuple[Path, int]:
    """(file, byte offset) of one chunk's tensor data, as ckpt's reader locates it."""
    entry = dcp.READER.read(folder, ReadOptions()).tensors[fqn]
    piece = next(p for p in entry.pieces if p.region.offsets == offsets)
    return Path(piece.data.path), piece.data.offset


def test_verify_deep_and_damage(dcp_tp, ckpt, tmp_path):
    src = tmp_path / "tp"
    shutil.copytree(dcp_tp / "tp", src)
    res = ckpt("verify", src, "--deep")
    assert res.code == 0 and "OK" in res.out, res.out + res.err
    path, at = _chunk_data(src, "model.block.down.weight", (0, 11))  # the column half rank 1 holds
    data, stat = bytearray(path.read_bytes()), path.stat()
    data[at + 5] ^= 0x40
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a bit flipped on disk, the file's time unchanged
    assert ckpt("verify", src).code == 0  # structure alone cannot see it
    assert_fails(ckpt("verify", src, "--deep"), path.name)
    (src / "__3_0.distcp").write_bytes((src / "__3_0.distcp").read_bytes()[:-100])
    assert_fails(ckpt("verify", src), "__3_0.distcp")


def test_exports_equal_full_tensors_and_torch(dcp_tp, ckpt, tmp_path):
    """merge, merge --all and convert --to hf equal the run's full_tensor() values and torch's dcp_to_torch_save."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_tp / "tp", tmp_path / "torch.pt")
    theirs = torch.load(tmp_path / "torch.pt", weights_only=False)
    ref = _reference(dcp_tp)
    weights = {k: v for k, v in ref.items() if k.startswith("model.")}
    assert ckpt("merge", dcp_tp / "tp", tmp_path / "m.safetensors").code == 0
    assert_same_tensors(load_file(tmp_path / "m.safetensors"), weights)
    assert_same_tensors({f"model.{k}": v for k, v in theirs["model"].items()}, weights)
    assert ckpt("convert", dcp_tp / "tp", tmp_path / "hf", "--to", "hf").code == 0
    exported = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert_same_tensors(exported, weights)
    assert ckpt("merge", dcp_tp / "tp", tmp_path / "all.pt", "--all").code == 0
    everything = torch.load(tmp_path / "all.pt", weights_only=False)
    moments = {f"optim.state.{fqn}.{k}": v for fqn, st in everything["optim"]["state"].items() for k, v in st.items()}
    assert_same_tensors(moments, {k: v for k, v in ref.items() if k.startswith("optim.state.")})
    torch_moments = {f"optim.state.{fqn}.{k}": v for fqn, st in theirs["optim"]["state"].items() for k, v in st.items()}
    assert_same_tensors(moments, torch_moments)
    assert everything["step"] == theirs["step"] == 2


# ---- reshard to a dp x tp mesh -------------------------------------------------------------------------------------


def _layout(folder: Path) -> tuple:
    """What a DCP save lays out: every tensor's chunks (in order), state_dict_metadata's key order, planner_data and the
    file each item is in."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(folder)).read_metadata()
    chunk_lists = {
        k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks] for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")
    }
    files = {(i.fqn, None if i.offset is None else tuple(i.offset)): info.relative_path for i, info in meta.storage_data.items()}
    return chunk_lists, list(meta.state_dict_metadata), meta.planner_data, files


@pytest.mark.parametrize("mesh", DCP_TP_MESHES)
def test_reshard_loads_on_the_new_mesh(dcp_tp, ckpt, mesh):
    """dcp.load + set_state_dict into the 2-D model on the new mesh: the same weights and AdamW moments, bit for bit; and
    ckpt's files are laid out as torch's own dcp.save on that mesh lays them out (chunks, key order, files)."""
    out = dcp_tp / "reshard" / mesh
    assert ckpt("verify", out, "--deep").code == 0
    ref, got = _reference(dcp_tp), torch.load(dcp_tp / "loaded" / mesh / "loaded.pt", weights_only=False)
    assert_same_tensors({k: got[k] for k in ref if "." in k}, {k: v for k, v in ref.items() if "." in k})
    assert got["lr"] == ref["lr"] and got["step"] == 2
    tp = int(mesh.split("x")[1])
    strided = f"(_StridedShard(dim=0, sf={tp}), Shard(dim=0))" if tp > 1 else "(Shard(dim=0), Shard(dim=0))"
    assert got["placements"]["embed.weight"] == strided
    assert _layout(out) == _layout(dcp_tp / "loaded" / mesh / "resaved")


def test_reshard_to_the_same_mesh_is_torchs_layout(dcp_tp):
    assert _layout(dcp_tp / "reshard" / "2x2") == _layout(dcp_tp / "tp")


def test_reshard_from_a_reshard(dcp_tp, ckpt, tmp_path):
    """ckpt's own 1x4 output still records the tensor-parallel splits, not FSDP's (dp is 1): back on 2x2 every tensor split
    by tp is laid out as torch lays it out, those FSDP alone shards stay whole (they load all the same). Its 4x1 output
    (tp 1) fits FSDP alone with experts.w1 on dim 1 and tensor parallel alone on 1x4: read as the latter, and said so."""
    res = ckpt("reshard", dcp_tp / "reshard" / "1x4", tmp_path / "back", "--world-size", 4, "--tp", 2)
    assert res.code == 0 and "dp size is 1" in res.err, res.err
    ours, theirs = _layout(tmp_path / "back")[0], _layout(dcp_tp / "tp")[0]
    differ = {k.rsplit(".", 1)[0] if k.startswith("optim") else k for k in theirs if ours[k] != theirs[k]}
    fsdp_alone = {"norm.weight", "norm.bias", "block.down.bias", "experts.w1"}  # experts.w1: FSDP on dim 1
    assert differ == {f"{top}.{name}" for name in fsdp_alone for top in ("model", "optim.state")}
    assert all(len(ours[f"model.{n}"]) == 1 for n in fsdp_alone - {"experts.w1"})
    res = ckpt("reshard", dcp_tp / "reshard" / "4x1", tmp_path / "tp1", "--world-size", 4, "--tp", 2, "--dry-run")
    assert res.code == 0 and "fit a 4x1 mesh too; read as 1x4" in res.out, res.out + res.err


def test_reshard_refusals_and_notes(dcp_tp, ckpt, tmp_path):
    res = ckpt("reshard", dcp_tp / "fsdp", tmp_path / "a", "--world-size", 4, "--tp", 2)
    assert res.code == 2 and "does not say" in res.err and "FSDP's alone on 4 ranks" in res.err, res.err
    res = ckpt("reshard", dcp_tp / "tp", tmp_path / "b", "--world-size", 4, "--tp", 3)
    assert res.code == 2 and "does not divide" in res.err
    res = ckpt("reshard", dcp_tp / "tp", tmp_path / "c", "--tp", 2)
    assert res.code == 2 and "--world-size" in res.err
    res = ckpt("convert", dcp_tp / "tp", tmp_path / "d", "--to", "deepspeed", "--world-size", 4, "--tp", 2)
    assert res.code == 2 and "--tp applies to dcp targets" in res.err
    res = ckpt("reshard", dcp_tp / "tp", tmp_path / "e", "--world-size", 2, "--dry-run")
    assert res.code == 0 and "FSDP2 + tensor parallel on a 2x2 (dp, tp) mesh" in res.out and "--tp T" in res.out
    res = ckpt("reshard", dcp_tp / "fsdp", tmp_path / "f", "--world-size", 2, "--tp", 1, "--dry-run")
    assert res.code == 0 and "FSDP2 Shard(0) on 2 ranks" in res.out
    assert ckpt("merge", dcp_tp / "tp", tmp_path / "all.pt", "--all", "--quiet").code == 0  # one file: nothing says how to split
    res = ckpt("convert", tmp_path / "all.pt", tmp_path / "g", "--to", "dcp", "--world-size", 4, "--tp", 2)
    assert res.code == 2 and "does not say" in res.err and "Traceback" not in res.err, res.err
    assert not any((tmp_path / n).exists() for n in "abcdefg")


def test_python_api(dcp_tp, tmp_path):
    import ckpt_cli

    report = ckpt_cli.reshard(dcp_tp / "tp", tmp_path / "api", world_size=8, tp=2, dry_run=True)
    assert len(report.files) == 9 and any("on a 4x2 (dp, tp) mesh" in n for n in report.notes)
