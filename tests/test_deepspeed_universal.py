"""DeepSpeed universal checkpoints (ds_to_universal's output) as a source: made by DeepSpeed's own ds_to_universal
from real ZeRO saves, read by ckpt (inspect, verify --deep, merge) and resharded to native DeepSpeed, which loads
the result at 1 and 3 ranks with a plain load_checkpoint and saves the same training state again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_fails, ckpt_quiet, torchrun
from test_deepspeed import assert_resaved_state, zero_to_fp32

from ckpt_cli.core.pickles import zipio

# round_robin_gradients: ds_to_universal scrambles the parameters (docs/formats.md §3); BF16_Optimizer: not a ZeRO layout it reads
CONFIGS = ["stage1-fp32", "stage2-bf16", "stage3-fp32"]
WORLDS = (1, 3)


def run_ds_to_universal(tag_folder: Path, out: Path) -> None:
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_folder)]
    cmd += ["--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def universal(ds_saves, tmp_path_factory) -> dict[str, Path]:
    """config -> a folder holding only `latest_universal` and the universal tag folder, made from the 2-rank save."""
    root = tmp_path_factory.mktemp("universal")
    out = {}
    for config in CONFIGS:
        out[config] = root / config
        run_ds_to_universal(ds_saves[2] / config / "global_step3", out[config] / "global_step3_universal")
    return out


@pytest.fixture(scope="module")
def universal_resumed(universal, tmp_path_factory) -> Path:
    """Each universal checkpoint resharded by ckpt to native DeepSpeed at 1 and 3 ranks, loaded there by a plain
    load_checkpoint and saved again at once (one torchrun launch per world size)."""
    root = tmp_path_factory.mktemp("universal_resumed")
    for world in WORLDS:
        tasks = []
        for config in CONFIGS:
            native = root / f"{config}-to{world}"
            ckpt_quiet("reshard", universal[config], native, "--world-size", world)
            tasks.append(f"{native}:{config}:{root / 'resumed' / f'{config}-{world}'}")
        torchrun(world, "deepspeed_train.py", "resume", *tasks, timeout=900)
    return root / "resumed"


@pytest.mark.parametrize("config", CONFIGS)
def test_inspect_and_verify(ckpt, universal, config):
    res = ckpt("inspect", universal[config], "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["format"] == "deepspeed-universal" and report["tag"] == "global_step3_universal" and report["step"] == 3
    assert report["details"]["zero_stage"] == int(config[5]) and report["details"]["saved_world_size"] == 2
    roles = {t["role"] for t in report["tensors"]}
    assert roles == {"model", "optimizer"}  # no training-dtype copies: those live in the model states, not zero/
    assert report["training_state"]["optimizer"] and report["training_state"]["lr_scheduler"]
    assert ckpt("verify", universal[config], "--deep").code == 0


@pytest.mark.parametrize("config", CONFIGS)
def test_merge_equals_each_fp32_file_and_the_native_merge(ckpt, ds_saves, universal, tmp_path, config):
    """The merged weights are each trained parameter's fp32.pt, and equal the merge of the native checkpoint the
    universal one was made from (itself zero_to_fp32's, tests/test_deepspeed.py): frozen parameters, buffers and the
    tied alias as the model states hold them, not as ds_to_universal's float copies (stage 3 has none of the frozen)."""
    assert ckpt("merge", universal[config], tmp_path / "u.pt", "-q").code == 0
    assert ckpt("merge", ds_saves[2] / config, tmp_path / "n.pt", "-q").code == 0
    ours, native = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("u", "n"))
    assert ours.keys() == native.keys()
    for name, tensor in native.items():
        assert tensor.dtype == ours[name].dtype and torch.equal(tensor, ours[name]), name
    trained = set(zero_to_fp32(ds_saves[2] / config)) - {"head.weight", "scale", "frozen.weight", "frozen.bias"}  # by the optimizer
    zero = universal[config] / "global_step3_universal" / "zero"
    for name in sorted(trained):
        saved = torch.load(zero / name / "fp32.pt", weights_only=True)
        saved = saved["param"] if isinstance(saved, dict) else saved
        assert torch.equal(ours[name].flatten(), saved.flatten()), name


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_reshard_to_native_loads_in_deepspeed(ds_saves, universal_resumed, config, world):
    """DeepSpeed at the new world size loads ckpt's native checkpoint (no load_universal flag); its re-save holds the
    fp32 master weights, exp_avg, exp_avg_sq and step of the original run bit for bit, its LR scheduler, global steps
    and client state."""
    assert_resaved_state(ds_saves[2] / config, universal_resumed / f"{config}-{world}" / "resaved", world)


def test_native_save_folder_with_a_universal_tag(ckpt, ds_saves, tmp_path):
    """ds_to_universal writes latest_universal beside the native run's `latest`: the folder reads as native DeepSpeed
    (what a plain load_checkpoint loads), and --format deepspeed-universal reads the universal one."""
    run = tmp_path / "run"
    shutil.copytree(ds_saves[2] / "stage2-bf16", run)
    run_ds_to_universal(run / "global_step3", run / "global_step3_universal")
    assert (run / "latest_universal").read_text() == "global_step3_universal"
    assert json.loads(ckpt("inspect", run, "--json").out)["format"] == "deepspeed"
    res = ckpt("inspect", run, "--tag", "global_step3_universal")
    assert res.code == 2 and "--format deepspeed-universal" in res.err
    res = ckpt("inspect", run, "--format", "deepspeed-universal", "--json")  # latest_universal names the tag
    assert res.code == 0 and json.loads(res.out)["tag"] == "global_step3_universal", res.err


def test_broken_universal_checkpoints_fail_in_one_line(ckpt, universal, tmp_path):
    src = tmp_path / "u"
    shutil.copytree(universal["stage2-bf16"], src)
    tag = src / "global_step3_universal"
    for param in ("block.0.weight", "head.weight"):  # a trained parameter's, and the tied alias's unused float copy
        fp32 = tag / "zero" / param / "fp32.pt"
        with open(fp32, "rb") as f:
            offset = zipio.read_records(f, str(fp32))["data/0"].data_offset  # a byte of the stored tensor
        data = bytearray(fp32.read_bytes())
        data[offset] ^= 0xFF
        fp32.write_bytes(bytes(data))
        assert ckpt("verify", src).code == 0  # sizes and headers agree
        assert_fails(ckpt("verify", src, "--deep"), str(fp32))
        shutil.rmtree(src)
        shutil.copytree(universal["stage2-bf16"], src)

    moment = tag / "zero" / "block.0.weight" / "exp_avg_sq.pt"
    moment.unlink()
    assert_fails(ckpt("inspect", src), str(moment.parent), "exp_avg.pt without exp_avg_sq.pt")
    assert not (tmp_path / "m.safetensors").exists()

    shutil.rmtree(moment.parent)
    assert_fails(ckpt("merge", src, tmp_path / "m.safetensors"), moment.parent.name, "incomplete conversion")
    assert not (tmp_path / "m.safetensors").exists()

    (src / "latest_universal").write_text("../../etc")
    res = ckpt("inspect", src)
    assert res.code == 1 and "not a plain file name" in res.err and "Traceback" not in res.err
