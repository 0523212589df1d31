"""DeepSpeed pipeline parallelism: checkpoints saved by real DeepSpeed with deepspeed.pipe.PipelineModule (2 stages,
ZeRO-1 in each, fp32 and bf16; CPU, gloo, torchrun; tests/producers/deepspeed_pipe.py, fixture ds_pipe). Every stage's
parameters read as the run held them, the weights exported under the PipelineModule's names, and a reshard of the
data-parallel size loaded by DeepSpeed at the new world size with the same state (docs/formats.md §2.14)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DS_PIPE, assert_fails
from safetensors.torch import load_file

from ckpt_cli.core.reading import SourceFiles, read_elements
from ckpt_cli.ops.source import open_checkpoint

SAVES = [(w, c) for w in (2, 4) for c in DS_PIPE]
RESHARDS = [(c, s, d) for c in DS_PIPE for s, d in ((2, 4), (4, 2))]


def logical(ckpt, name):
    t = ckpt.tensors[name]
    return read_elements(t, 0, t.numel, SourceFiles()).reshape(t.shape)


def held(folder):
    return torch.load(folder / "reference.pt", weights_only=False)["params"]


@pytest.mark.parametrize("world,config", SAVES)
def test_every_stage_reads_as_the_run_held_it(ds_pipe, world, config):
    """fp32 master weight, exp_avg, exp_avg_sq and step of every parameter of both stages, bit for bit; the world size is
    stages x data-parallel ranks."""
    src = ds_pipe / f"w{world}" / config
    ckpt = open_checkpoint(src)
    reference = held(src)
    assert ckpt.world_size == world and ckpt.details["pipeline_stages"] == 2 and ckpt.details["data_parallel_size"] == world // 2
    assert {n for n in reference} == {n for n, t in ckpt.tensors.items() if t.role == "model" and not n.endswith(".scale")}
    for name, state in reference.items():
        for key, value in state.items():
            ours = logical(ckpt, name if key == "fp32" else f"optimizer.state.{name}.{key}")
            assert ours.dtype == value.dtype and torch.equal(ours, value.reshape(ours.shape)), (name, key)


def test_merge_writes_the_models_names(ckpt, ds_pipe, tmp_path):
    """The weights export: every parameter under the PipelineModule's name (its fp32 master) and every buffer."""
    src = ds_pipe / "w2" / "stage1-bf16"
    assert ckpt("merge", src, tmp_path / "w.safetensors").code == 0
    got = load_file(tmp_path / "w.safetensors")
    reference = held(src)
    assert sorted(got) == sorted([*reference, *(f"{i}.scale" for i in range(1, 5))])
    assert all(torch.equal(got[n], s["fp32"]) for n, s in reference.items())
    assert torch.equal(got["3.scale"], torch.full((16,), 1.2))


@pytest.mark.parametrize("config,src,dst", RESHARDS)
def test_reshard_loads_in_deepspeed_with_the_same_state(ds_pipe, config, src, dst):
    """DeepSpeed at the new world size (2 stages x the new data-parallel size) loads ckpt's reshard with a plain
    load_checkpoint and holds every parameter's fp32 master, exp_avg, exp_avg_sq and step as the run held them, then trains."""
    reference = held(ds_pipe / f"w{src}" / config)
    loaded = torch.load(ds_pipe / "loaded" / f"{config}-{src}to{dst}" / "loaded.pt", weights_only=False)
    assert loaded["world"] == dst and loaded["steps"] == 2 and sorted(loaded["params"]) == sorted(reference)
    for name, state in reference.items():
        for key, value in state.items():
            assert torch.equal(loaded["params"][name][key], value), (name, key)


@pytest.mark.parametrize("victim", ["layer_03-model_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt", "mp_rank_01_model_states.pt"])
def test_verify_names_a_damaged_file(ckpt, ds_pipe, tmp_path, victim):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(ds_pipe / "w4" / "stage1-fp32", run)
    assert ckpt("verify", "--deep", run).code == 0
    path = run / "global_step2" / victim
    os.truncate(path, path.stat().st_size - 100)
    assert_fails(ckpt("verify", run), victim)


def test_refusals(ckpt, ds_pipe, tmp_path):
    import shutil

    src = ds_pipe / "w2" / "stage1-fp32"
    res = ckpt("reshard", src, tmp_path / "out", "--world-size", 3)
    assert res.code == 2 and "not a multiple of the 2 pipeline stages" in res.err and not (tmp_path / "out").exists()
    run = tmp_path / "run"
    shutil.copytree(src, run)
    (run / "global_step2" / "mp_rank_01_model_states.pt").unlink()
    assert_fails(ckpt("inspect", run), "mp_rank_01_model_states.pt", "stage 1")


def test_training_state_moves_to_dcp_and_plain_deepspeed(ckpt, ds_pipe, tmp_path):
    """The joined stages are one training state: to DCP (FSDP2 layout) and to a plain ZeRO-2 save of the same names,
    each equal to the source by parameter name (weights and Adam state, bit for bit)."""
    src = ds_pipe / "w4" / "stage1-fp32"
    for target, extra in (("dcp", ()), ("deepspeed", ("--zero-stage", "2"))):
        out = tmp_path / target
        res = ckpt("convert", src, out, "--to", target, "--world-size", 2, *extra)
        assert res.code == 0, res.err
        res = ckpt("diff", src, out)
        assert res.code == 0 and "equal (bit-exact)" in res.out, res.out + res.err


@pytest.mark.parametrize(
    "victim,needle",
    [
        ("layer_02-model_states.pt", "layer 2 holds parameters"),
        ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "pipeline stage 1 has no ZeRO optimizer file"),
    ],
)
def test_verify_names_a_missing_file(ckpt, ds_pipe, tmp_path, victim, needle):
    """DeepSpeed's load_state_dir opens every layer's file and each stage its ZeRO files: a missing one fails verify."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(ds_pipe / "w2" / "stage1-fp32", run)
    (run / "global_step2" / victim).unlink()
    assert_fails(ckpt("verify", run), victim, needle)
