"""Per-rank torch.save of DTensor shards (verl's and SkyRL's model/optim/extra_state_world_size_W_rank_R.pt): real FSDP2,
FSDP1, HSDP and FSDP2 + tensor-parallel saves on 2 and 4 processes (tests/producers/dtensor_saves.py). Exports equal the
saving run's full_tensor() bit for bit; broken or crafted rank files fail with one line."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_fails, assert_same_tensors
from safetensors.torch import load_file

from ckpt_cli.formats.dtensor import layout as lay

CONFIGS = [("w2", "fsdp2"), ("w2", "fsdp1"), ("w4", "fsdp2"), ("w4", "hsdp"), ("w4", "tp")]


@pytest.fixture(scope="module")
def saves(request):
    """The fixture for one world size, started only when a test needs it."""
    return lambda world: request.getfixturevalue(f"dtensor_saves_{world[1]}")


def source(saves, world: str, config: str) -> tuple[Path, dict]:
    root = saves(world)
    return root / config, torch.load(root / "references" / f"{config}.pt", weights_only=True)


# ---- the layout arithmetic against torch's own ----------------------------------------------------------------


def _torch_placement(p: lay.Placement):
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    return {"shard": lambda: Shard(p.dim), "strided": lambda: _StridedShard(p.dim, split_factor=p.split_factor)}.get(p.kind, Replicate)()


def test_layout_matches_dtensor_sharding():
    """For random shapes, meshes and placements (Shard, _StridedShard, Replicate), every coordinate's boxes hold exactly the
    elements torch's own split gives it (Shard/_StridedShard._split_tensor, as distribute_tensor shards), and the local shape
    and first offset equal torch's _compute_local_shape_and_global_offset."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    rng = random.Random(13)
    for _ in range(400):
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        kinds = [rng.choice(["shard", "strided", "replicate"]) for _ in mesh]
        placements = tuple(lay.Placement(k, rng.randrange(len(shape)), rng.randint(1, 4) if k == "strided" else 1) for k in kinds)
        torch_placements = [_torch_placement(p) for p in placements]
        for coord in itertools.product(*(range(n) for n in mesh)):
            assert lay.problem(shape, mesh, coord, placements, 64) is None
            want = torch.arange(math.prod(shape)).reshape(shape)
            for mesh_dim, p in enumerate(torch_placements):
                if placements[mesh_dim].shards:
                    want = p._split_tensor(want, mesh[mesh_dim], with_padding=False, contiguous=True)[0][coord[mesh_dim]]
            runs = lay.index_runs(shape, mesh, coord, placements)
            got = torch.full(lay.local_shape(runs), -1, dtype=torch.long)
            full = torch.arange(math.prod(shape)).reshape(shape)
            for offsets, sizes, local in lay.boxes(runs):
                got[tuple(slice(a, a + n) for a, n in zip(local, sizes))] = full[tuple(slice(a, a + n) for a, n in zip(offsets, sizes))]
            assert torch.equal(got, want), (shape, mesh, coord, placements)
            local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), torch_placements)
            assert lay.local_shape(runs) == tuple(local_shape)
            if got.numel():
                assert tuple(offset) == tuple(runs[d][0][0] for d in range(len(shape)))


def test_stand_ins_cannot_be_changed_by_a_pickle():
    """A BUILD on an allow-listed DTensor class or marker is refused; the classes keep no attribute a pickle tried to set."""
    from ckpt_cli.core.pickles.safe_dtensor import DTENSOR_GLOBALS, ShardRec
    from ckpt_cli.core.pickles.safe_pickle import safe_loads
    from ckpt_cli.errors import DataError

    for glob in (b"torch.distributed.tensor.placement_types\nShard", b"torch.distributed.tensor\nDTensor"):
        with pytest.raises(DataError):
            safe_loads(b"\x80\x02c" + glob + b"\n}X\x03\x00\x00\x00dimK\x05sb.", "crafted", DTENSOR_GLOBALS)
    assert "dim" not in ShardRec.__dict__


# ---- real saves ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world,config", CONFIGS)
def test_inspect_lists_every_tensor_by_logical_name(ckpt, saves, world, config):
    folder, ref = source(saves, world, config)
    res = ckpt("inspect", folder, "--json")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    assert doc["format"] == "dtensor" and doc["world_size"] == int(world[1])
    model = {t["name"]: t["shape"] for t in doc["tensors"] if t["role"] == "model"}
    assert model == {k: list(v.shape) for k, v in ref["model"].items()}
    assert model["scale"] == [] and model["inv_freq"] == [6]  # buffers: plain tensors, read once
    optimizer = {t["name"]: t["shape"] for t in doc["tensors"] if t["role"] == "optimizer"}
    # FSDP1's optimizer.state_dict() holds flat-parameter shards: read per parameter, as FSDP2 keys them
    assert optimizer == {f"optimizer.{k}": list(v.shape) for k, v in ref["optim"].items()}
    assert doc["training_state"]["optimizer"]["param_groups"] == 1
    assert ("FlatParameters" in " ".join(doc["notes"])) == (config == "fsdp1")
    ranks = int(world[1])
    assert {t["name"] for t in doc["tensors"] if t["name"].startswith("rng.")} == {f"rng.{r}.cpu" for r in range(ranks)}
    assert ckpt("verify", folder, "--deep").code == 0


@pytest.mark.parametrize("world,config", CONFIGS)
def test_merge_and_hf_export_equal_full_tensor(ckpt, saves, world, config, tmp_path):
    folder, ref = source(saves, world, config)
    assert ckpt("merge", folder, tmp_path / "m.safetensors", "--quiet").code == 0
    assert_same_tensors(load_file(tmp_path / "m.safetensors"), ref["model"])
    assert ckpt("convert", folder, tmp_path / "hf", "--to", "hf", "--quiet").code == 0
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model-00001-of-00001.safetensors", "pt") as f:
        assert_same_tensors({k: f.get_tensor(k) for k in f.keys()}, ref["model"])
    # --all keeps the optimizer: every moment equals the run's full_tensor() (FSDP1: torch's own unflattening)
    assert ckpt("merge", folder, tmp_path / "all.pt", "--all", "--quiet").code == 0
    state = torch.load(tmp_path / "all.pt", weights_only=False)["optimizer"]["state"]
    got = {f"state.{i}.{k}": v for i, s in state.items() for k, v in s.items()}
    assert_same_tensors(got, ref["optim"])


def test_skyrl_layout(ckpt, saves, tmp_path):
    """SkyRL's FSDPStrategy: {} in the optimizer files (no optimizer), client_state/tag/rank in the extra state, fsdp_config.json
    with fsdp_strategy; folder step_N as its trainer names it."""
    folder, ref = source(saves, "w2", "skyrl")
    step_folder = tmp_path / "step_7" / "policy"
    shutil.copytree(folder, step_folder)
    doc = json.loads(ckpt("inspect", step_folder, "--json").out)
    assert doc["step"] == 7 and doc["details"]["fsdp_strategy"] == "fsdp2" and not doc["training_state"]["optimizer"]
    assert {t["name"] for t in doc["tensors"] if t["role"] == "model"} == set(ref["model"])
    assert ckpt("merge", step_folder, tmp_path / "m.safetensors", "--quiet").code == 0
    assert_same_tensors(load_file(tmp_path / "m.safetensors"), ref["model"])


def test_tp_layout_is_strided_and_two_dimensional(ckpt, saves):
    """FSDP2 over tensor parallel: colwise weights are (_StridedShard(0, sf=2), Shard(0)): each rank's rows are one tp block's
    dp chunk; rowwise weights (Shard(0), Shard(1)) are 2-D boxes; a rowwise bias (Shard(0), Replicate()) is read once per dp shard."""
    folder, _ = source(saves, "w4", "tp")
    rows = {t["name"]: t["pieces"] for t in json.loads(ckpt("inspect", folder, "--json").out)["tensors"]}
    assert rows["block.up.weight"] == 4 and rows["block.down.weight"] == 4 and rows["block.down.bias"] == 2 and rows["head.bias"] == 2


# ---- damage and crafted files ---------------------------------------------------------------------------------


def copy_of(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / folder.name
    shutil.copytree(folder, dst)
    return dst


@pytest.mark.parametrize("kind", ["model", "optim", "extra_state"])
def test_truncated_rank_file_fails_verify(ckpt, saves, tmp_path, kind):
    folder = copy_of(source(saves, "w2", "fsdp2")[0], tmp_path)
    victim = folder / f"{kind}_world_size_2_rank_1.pt"
    os.truncate(victim, victim.stat().st_size - 64)
    assert_fails(ckpt("verify", folder, "--deep"), victim.name)


def test_flipped_byte_fails_deep_verify(ckpt, saves, tmp_path):
    from ckpt_cli.core.pickles import zipio

    folder = copy_of(source(saves, "w2", "fsdp2")[0], tmp_path)
    victim = folder / "model_world_size_2_rank_1.pt"
    with open(victim, "rb") as f:
        record = max((r for r in zipio.read_records(f, str(victim)).values() if r.name.startswith("data/")), key=lambda r: r.size)
    data = bytearray(victim.read_bytes())
    data[record.data_offset + 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert ckpt("verify", folder).code == 0  # structure only: the CRCs are read by --deep
    assert_fails(ckpt("verify", folder, "--deep"), "CRC32")


def test_missing_rank_and_single_rank_file(ckpt, saves, tmp_path):
    folder = copy_of(source(saves, "w2", "fsdp2")[0], tmp_path)
    res = ckpt("inspect", folder / "model_world_size_2_rank_0.pt")
    assert res.code == 2 and f"one file of the dtensor checkpoint {folder}" in res.err
    (folder / "model_world_size_2_rank_1.pt").unlink()
    assert_fails(ckpt("inspect", folder), "model_world_size_2_rank_1.pt: missing")
    assert_fails(ckpt("merge", folder, tmp_path / "out.safetensors"), "missing")


def rewrite(folder: Path, rank: int, change) -> None:
    """Load one real model rank file with torch, let `change` edit its state dict, save it back with torch.save."""
    path = folder / f"model_world_size_2_rank_{rank}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = torch.load(path, weights_only=False)
        change(state)
        torch.save(state, path)


def with_spec(value, placements=None, coordinate=None, mesh_sizes=None, shape=None, local=None):
    """A DTensor like `value` with a crafted spec: placements, mesh coordinate, mesh shape, global shape, local tensor."""
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = copy.copy(value._spec)
    spec.mesh = copy.copy(spec.mesh)
    if placements is not None:
        spec.placements = tuple(placements)
        spec.shard_order = DTensorSpec.compute_default_shard_order(spec.placements)
    if coordinate is not None:
        spec.mesh._coordinate_on_dim = tuple(coordinate)
    if mesh_sizes is not None:
        spec.mesh._layout = _MeshLayout.from_sizes_strides(tuple(mesh_sizes))
    if shape is not None:
        spec.tensor_meta = TensorMeta(torch.Size(shape), spec.tensor_meta.stride, spec.tensor_meta.dtype)
    return DTensor(value._local_tensor if local is None else local, spec, requires_grad=False)


def _crafts():
    from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

    def one(name, **kw):
        return lambda state: state.__setitem__(name, with_spec(state[name], **kw))

    return {
        "shard dim out of range": ([(0, one("embed.weight", placements=[Shard(2)]))], "on a tensor of 2 dimensions"),
        "negative coordinate": ([(1, one("embed.weight", coordinate=[-1]))], "outside the mesh"),
        "mesh larger than the files": ([(r, one("head.bias", mesh_sizes=[4])) for r in (0, 1)], "a mesh of shape [4] for 2 rank files"),
        "mesh sizes disagree": ([(1, one("head.bias", mesh_sizes=[1]))], "rank 0's on [2]"),
        "a shard nobody holds": ([(1, one("norm.bias", coordinate=[0]))], "no rank file holds the shard at mesh coordinate [1]"),
        "shapes that do not tile": ([(r, one("head.weight", shape=[9, 12])) for r in (0, 1)], "give"),
        "global shapes disagree": ([(1, one("head.weight", shape=[6, 12]))], "rank 0 has it as"),
        "partial": ([(r, one("norm.weight", placements=[Partial()])) for r in (0, 1)], "partial sum"),
        "split factor": ([(r, one("norm.weight", placements=[_StridedShard(0, split_factor=99)])) for r in (0, 1)], "split factor"),
    }


@pytest.mark.parametrize("case", list(_crafts()))
def test_crafted_placements_fail_in_one_line(ckpt, saves, tmp_path, case):
    changes, needle = _crafts()[case]
    folder = copy_of(source(saves, "w2", "fsdp2")[0], tmp_path)
    for rank, change in changes:
        rewrite(folder, rank, change)
    for command in (("inspect", folder), ("verify", folder, "--deep"), ("merge", folder, tmp_path / "x.safetensors")):
        assert_fails(ckpt(*command), needle)


def test_plain_tensors_that_differ_between_ranks(ckpt, saves, tmp_path):
    """A buffer FSDP does not keep in sync is read from rank 0 (as dcp.save keeps one copy) and named in a note; a tensor that is
    a DTensor on one rank and plain on another is an error."""
    folder, ref = source(saves, "w2", "fsdp2")
    folder = copy_of(folder, tmp_path)
    rewrite(folder, 1, lambda state: state.__setitem__("inv_freq", state["inv_freq"] + 1))
    res = ckpt("inspect", folder)
    assert res.code == 0 and "differ between ranks, read from rank 0" in res.out + res.err and "inv_freq" in res.out + res.err
    assert ckpt("merge", folder, tmp_path / "m.safetensors", "--quiet").code == 0
    assert torch.equal(load_file(tmp_path / "m.safetensors")["inv_freq"], ref["model"]["inv_freq"])
    rewrite(folder, 1, lambda state: state.__setitem__("norm.bias", state["norm.bias"].to_local()))
    assert_fails(ckpt("inspect", folder), "'norm.bias' is a DTensor on some ranks and a plain tensor on others")


def test_world_size_disagreements_fail_in_one_line(ckpt, saves, tmp_path):
    folder = copy_of(source(saves, "w2", "fsdp2")[0], tmp_path)
    for kind in ("model", "optim", "extra_state"):
        (folder / f"{kind}_world_size_2_rank_1.pt").unlink()
        (folder / f"{kind}_world_size_2_rank_0.pt").rename(folder / f"{kind}_world_size_1_rank_0.pt")
    assert_fails(ckpt("inspect", folder), "fsdp_config.json: says world_size 2")
    (folder / "fsdp_config.json").unlink()
    assert_fails(ckpt("inspect", folder), "a mesh of shape [2] for 1 rank files")
    shutil.copy(folder / "model_world_size_1_rank_0.pt", folder / "model_world_size_2_rank_0.pt")
    assert_fails(ckpt("inspect", folder), "world sizes 1, 2")


def test_swapped_rank_files_fail_in_one_line(ckpt, saves, tmp_path):
    folder = copy_of(source(saves, "w2", "fsdp2")[0], tmp_path)
    rank0, rank1 = (folder / f"model_world_size_2_rank_{r}.pt" for r in (0, 1))
    rank0.rename(tmp_path / "r0")
    rank1.rename(rank0)
    (tmp_path / "r0").rename(rank1)
    assert_fails(ckpt("inspect", folder), "saved by rank 1, in the file of rank 0")


def test_sharded_tensor_refused_in_words_without_torch_distributed(ckpt, saves, tmp_path):
    """A pickled ShardedTensor (FSDP1 without a device mesh) is refused by name; reading never imports torch.distributed."""
    import subprocess
    import sys
    import zipfile

    folder = copy_of(source(saves, "w2", "fsdp2")[0], tmp_path)
    probe = "import sys, ckpt_cli; ckpt_cli.inspect(sys.argv[1]); print(sorted(m for m in sys.modules if 'torch.distributed' in m))"
    out = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    victim = folder / "model_world_size_2_rank_0.pt"
    with zipfile.ZipFile(victim) as z:
        members = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in members if n.endswith("/data.pkl"))
    old = b"ctorch.distributed.tensor\nDTensor\n"
    assert old in members[pkl]
    members[pkl] = members[pkl].replace(old, b"ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n")
    with zipfile.ZipFile(victim, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    assert_fails(ckpt("inspect", folder), "ShardedTensor")


@pytest.mark.parametrize("world,config", [("w2", "dcp-hf"), ("w4", "hsdp"), ("w4", "tp")])
def test_reshard_that_cannot_be_done_says_what_to_do_and_the_advice_works(ckpt, saves, tmp_path, world, config):
    """Not "is one file; use ckpt split" (these are folders of per-rank files): what ckpt cannot write (DCP's
    Hugging Face layout; per-rank files on a 2-D mesh), and the conversion it suggests, which must then succeed."""
    folder = saves(world) / config
    res = ckpt("reshard", folder, tmp_path / "out", "--world-size", 1)
    assert res.code == 2 and "one file" not in res.err and "Traceback" not in res.err, res.err
    said = {
        "dcp-hf": "ckpt cannot reshard a dcp-hf checkpoint",
        "hsdp": "lies on a 2-D mesh [2, 2] (HSDP or tensor parallel)",
        "tp": "'gate' lies on a sub-mesh",  # FSDP-only parameters of a dp x tp run: on the dp sub-mesh
    }[config]
    assert said in res.err and "--to dcp --world-size N" in res.err, res.err
    assert not (tmp_path / "out").exists()
    res = ckpt("convert", folder, tmp_path / "dcp", "--to", "dcp", "--world-size", 1, "-q")
    assert res.code == 0 and (tmp_path / "dcp" / ".metadata").is_file(), res.err


@pytest.mark.parametrize("config", ["fsdp2", "fsdp1", "skyrl"])
@pytest.mark.parametrize("new", [1, 3])
def test_reshard_writes_every_rank_as_torch_would_save_it(ckpt, dtensor_saves_2, tmp_path, config, new):
    """2 -> 1 and 2 -> 3 ranks: each new rank file, loaded by torch, holds DTensors whose local shards are torch.chunk's
    piece of the saving run's full tensor (FSDP1 on one rank: plain tensors, as its NO_SHARD state dict); FSDP1's flat
    optimizer state is each rank's padded piece of the FlatParameter; the merged result equals the run's; SkyRL's extra
    state says the new rank and world size. (verl's own checkpoint manager loading them: tests/test_verl.py.)"""
    from torch.distributed.tensor import DTensor

    folder = dtensor_saves_2 / config
    ref = torch.load(dtensor_saves_2 / "references" / f"{config}.pt", weights_only=True)
    dest = tmp_path / "out"
    res = ckpt("reshard", folder, dest, "--world-size", new)
    assert res.code == 0, res.err
    assert json.loads((dest / "fsdp_config.json").read_text())["world_size"] == new
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "pickling/unpickling of the DeviceMesh occurred before the PGs were created"
        saved = torch.load(folder / "model_world_size_2_rank_0.pt", weights_only=False)
        files = [torch.load(dest / f"model_world_size_{new}_rank_{r}.pt", weights_only=False) for r in range(new)]
        extras = [torch.load(dest / f"extra_state_world_size_{new}_rank_{r}.pt", weights_only=False) for r in range(new)]
    for r, model in enumerate(files):
        assert model.keys() == ref["model"].keys()
        for name, value in model.items():
            if config == "fsdp1" and new == 1 or not isinstance(saved[name], DTensor):
                assert not isinstance(value, DTensor) and torch.equal(value, ref["model"][name]), name
                continue
            assert isinstance(value, DTensor) and value.device_mesh.mesh.tolist() == list(range(new)), name
            assert tuple(value.device_mesh.get_coordinate()) == (r,) and value.placements == saved[name].placements
            start, count = lay.chunk(len(ref["model"][name]), new, r)
            assert torch.equal(value.to_local(), ref["model"][name][start : start + count]), name
    if config == "skyrl":
        assert [(e["rank"], e["world_size"]) for e in extras] == [(r, new) for r in range(new)]
    assert ckpt("verify", dest, "--deep").code == 0
    if config != "skyrl":
        assert ckpt("merge", dest, tmp_path / "all.pt", "--all", "--quiet").code == 0
        merged = torch.load(tmp_path / "all.pt", weights_only=False)
        assert_same_tensors({k: merged[k] for k in ref["model"]}, ref["model"])
        got = {f"state.{i}.{k}": v for i, s in merged["optimizer"]["state"].items() for k, v in s.items()}
        if config == "fsdp1" and new == 1:  # one rank, buffers among the plain tensors: the FlatParameter is read as saved
            count = len({k.split(".")[1] for k in ref["optim"]})
            flat = torch.cat([ref["optim"][f"state.{i}.exp_avg"].flatten() for i in range(count)])
            assert list(got) == ["state.0.step", "state.0.exp_avg", "state.0.exp_avg_sq"] and torch.equal(got["state.0.exp_avg"], flat)
        else:
            assert_same_tensors(got, ref["optim"])


def test_reshard_refuses_views_and_a_one_rank_fsdp1_save_going_up(ckpt, dtensor_saves_2, tmp_path):
    folder = dtensor_saves_2 / "fsdp1"
    res = ckpt("reshard", folder, tmp_path / "x", "--world-size", 3, "--dtype", "fp32")
    assert res.code == 2 and "copies every tensor as it is" in res.err, res.err
    assert ckpt("reshard", folder, tmp_path / "one", "--world-size", 1, "-q").code == 0
    res = ckpt("reshard", tmp_path / "one", tmp_path / "up", "--world-size", 2)
    assert res.code == 2 and "hold no DTensor" in res.err and "Traceback" not in res.err, res.err
    assert not (tmp_path / "x").exists() and not (tmp_path / "up").exists()


def test_the_writer_copies_only_plain_attributes_of_a_saved_mesh_and_spec(dtensor_saves_2):
    """What rank 0's DeviceMesh and DTensorSpec hold beyond what ckpt rewrites is copied into every new file; a crafted
    attribute holding anything but plain values (a stand-in record, which the pickler could not write back), a shard
    order that is not ShardOrderEntry tuples is refused by name before anything is written."""
    from ckpt_cli import api
    from ckpt_cli.core.pickles.safe_dtensor import ShardOrderRec
    from ckpt_cli.formats.dtensor.writer import mesh_of, mesh_problem

    ckpt = api.open(dtensor_saves_2 / "fsdp2").raw
    name, spec = next(iter(ckpt.source.specs.items()))
    assert mesh_problem(spec, name) is None
    mesh, record = spec.record.__dict__["mesh"], spec.record
    for target, key, value in [
        (mesh, "_thread_id", ShardOrderRec()),
        (record, "use_strided_shard_as_shard_order", ShardOrderRec()),
        (record, "shard_order", [1, 2]),
        (record, "shard_order", (ShardOrderRec(),)),
    ]:
        saved = target.__dict__[key]
        target.__dict__[key] = value
        try:
            problem = mesh_problem(spec, name)
            assert problem is not None and f"'{name}'" in problem and f"'{key}'" in problem, problem
        finally:
            target.__dict__[key] = saved
    assert mesh_problem(spec, name) is None and len({mesh_of(s) for s in ckpt.source.specs.values()}) == 1
