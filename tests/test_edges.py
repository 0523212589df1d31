"""The edges a new user or an attacker reaches first: options outside the documented set, a file inside a
checkpoint given as the checkpoint, a destination inside its source. Each case is one row and fails on its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckpt_cli
from ckpt_cli.errors import UsageError

BAD_DTYPES = ["int8", "uint8", "bool", "float8_e4m3fn", "float64", "int64", "nonsense", ""]


@pytest.mark.parametrize("dtype", BAD_DTYPES)
@pytest.mark.parametrize("command", ["merge", "convert", "split"])
def test_dtype_outside_the_documented_set_is_refused(ckpt, mixed_files, tmp_path, dtype, command):
    dest = tmp_path / ("out.safetensors" if command == "merge" else "out")
    args = {"merge": [], "convert": ["--to", "hf"], "split": []}[command]
    res = ckpt(command, mixed_files["hf"], dest, *args, "--dtype", dtype)
    assert res.code == 2 and "Traceback" not in res.err, res.err
    assert "keep, fp32, bf16, fp16" in res.err
    assert not dest.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", ["keep", "fp32", "bf16", "fp16", "float32", "BF16"])
def test_documented_dtypes_are_taken(ckpt, mixed_files, tmp_path, dtype):
    assert ckpt("merge", mixed_files["hf"], tmp_path / "out.safetensors", "--dtype", dtype).code == 0


def test_api_dtype_outside_the_set_raises_usage_error(mixed_files, tmp_path):
    with pytest.raises(UsageError, match="keep, fp32, bf16, fp16"):
        ckpt_cli.merge(mixed_files["hf"], tmp_path / "out.safetensors", dtype="int8")
    assert not (tmp_path / "out.safetensors").exists()


# ---- a file inside a checkpoint, ls, merge --all -------------------------------------------------------------


def _members(fsdp2_saves, ds_saves, tiny_llama) -> dict[str, tuple[Path, Path]]:
    """(a file inside a real checkpoint, the checkpoint folder that holds it)."""
    dcp, ds, hf = fsdp2_saves[2] / "ckpt", ds_saves[2] / "stage2-fp32" / "global_step3", tiny_llama[1] / "sharded"
    return {
        "dcp data file": (dcp / "__0_0.distcp", dcp),
        "dcp metadata": (dcp / ".metadata", dcp),
        "hf shard": (hf / "model-00001-of-00006.safetensors", hf),
        "hf index": (hf / "model.safetensors.index.json", hf),
        "deepspeed model states": (ds / "mp_rank_00_model_states.pt", ds),
        "deepspeed optimizer states": (ds / "zero_pp_rank_1_mp_rank_00_optim_states.pt", ds),
        "deepspeed latest": (ds.parent / "latest", ds.parent),
    }


MEMBERS = ["dcp data file", "dcp metadata", "hf shard", "hf index"]
MEMBERS += ["deepspeed model states", "deepspeed optimizer states", "deepspeed latest"]


@pytest.mark.parametrize("member", MEMBERS)
def test_a_file_inside_a_checkpoint_is_refused_naming_the_checkpoint(ckpt, tmp_path, member, fsdp2_saves, ds_saves, tiny_llama):
    path, holder = _members(fsdp2_saves, ds_saves, tiny_llama)[member]
    assert path.exists(), path
    for args in (["inspect", path], ["verify", path], ["merge", path, tmp_path / "out.safetensors"]):
        res = ckpt(*args)
        assert res.code == 2 and "Traceback" not in res.err, (args, res.err)
        assert "one file of the" in res.err and str(holder) in res.err, res.err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="not a checkpoint by itself"):
        ckpt_cli.open(path)


def test_format_reads_one_shard_alone(ckpt, tiny_llama):
    shard = tiny_llama[1] / "sharded" / "model-00001-of-00006.safetensors"
    assert ckpt("verify", shard, "--format", "safetensors").code == 0


@pytest.mark.parametrize("which", ["dcp", "hf", "deepspeed tag"])
def test_ls_of_a_checkpoint_folder_lists_the_checkpoint_not_its_files(ckpt, which, fsdp2_saves, ds_saves, tiny_llama):
    folders = {"dcp": fsdp2_saves[2] / "ckpt", "hf": tiny_llama[1] / "sharded"}
    folder = folders.get(which) or ds_saves[2] / "stage2-fp32" / "global_step3"
    res = ckpt("ls", folder, "--json")
    assert res.code == 0, res.err
    rows = json.loads(res.out)["checkpoints"]
    assert [(r["path"], r["newest"]) for r in rows] == [(".", True)]


def test_ls_of_a_deepspeed_folder_lists_its_tags(ckpt, ds_saves):
    rows = json.loads(ckpt("ls", ds_saves[2] / "stage2-fp32", "--json").out)["checkpoints"]
    assert [r["path"] for r in rows if r["format"] == "deepspeed"] == ["global_step3"]  # the producer also left reference.pt
    assert not any(r["path"].startswith("global_step3/") for r in rows)


@pytest.mark.parametrize("config", ["stage2-fp32", "stage1-bf16"])
def test_merge_all_of_deepspeed_writes_each_weight_once(ckpt, tmp_path, ds_saves, config):
    dest = tmp_path / "all.pt"
    res = ckpt("merge", ds_saves[2] / config, dest, "--all")
    assert res.code == 0 and "left out" in res.err, res.err
    merged = torch.load(dest, weights_only=True)
    flat = {k for k in merged if isinstance(merged[k], torch.Tensor)}
    assert not any(k.startswith("module.") for k in merged), sorted(merged)
    weights = json.loads(ckpt("inspect", ds_saves[2] / config, "--json").out)
    assert weights["num_params"] == json.loads(ckpt("inspect", dest, "--json").out)["num_params"]
    assert flat  # the weights are there, each once


# ---- a destination inside its source ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command,args",
    [
        ("convert", ["--to", "hf"]),
        ("convert", ["--to", "safetensors"]),
        ("reshard", ["--world-size", "1"]),
        ("merge", []),
        ("split", ["--num-shards", "2"]),
    ],
)
def test_a_destination_inside_the_source_is_refused(ckpt, tmp_path, fsdp2_saves, command, args):
    src = tmp_path / "ckpt"
    shutil.copytree(fsdp2_saves[2] / "ckpt", src)
    before = sorted(p.name for p in src.iterdir())
    dest = src / ("out.safetensors" if command in ("merge",) or args[-1] == "safetensors" else "sub") / "deeper"
    dest = dest.parent if dest.parent.suffix else dest
    res = ckpt(command, src, dest, *args)
    assert res.code == 2 and "inside the source" in res.err, res.err
    assert sorted(p.name for p in src.iterdir()) == before
    res = ckpt(command, src, dest, *args, "--dry-run")
    assert res.code == 0 and "the real run will refuse" in res.out + res.err


def test_a_sibling_of_a_single_file_source_is_fine(ckpt, tmp_path, mixed_files):
    src = tmp_path / "mixed.safetensors"
    shutil.copy(mixed_files["safetensors"], src)
    assert ckpt("merge", src, tmp_path / "copy.pt").code == 0
