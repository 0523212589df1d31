"""verl actor checkpoints -> a Hugging Face release that loads from its folder alone: real verl 0.9.1 FSDP1 and FSDP2
actors (tests/producers/verl_actor.py: saved by verl's own FSDPCheckpointManager on 2 CPU processes), exported by
ckpt with the config and tokenizer verl keeps in actor/huggingface/, run by transformers against the trained model's
logits (`ckpt parity`), and compared with verl's own model merger bit for bit (it writes bfloat16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file

pytest.importorskip("verl", reason="verl is installed by the README's test command (tests/requirements-nodeps.txt)")

STRATEGIES = ["fsdp1", "fsdp2"]


@pytest.fixture(scope="module")
def verl_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verl")
    torchrun(2, "verl_actor.py", out, timeout=600)
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_actor_export_loads_from_its_folder_alone_with_the_trained_logits(ckpt, verl_runs, tmp_path, strategy):
    actor = verl_runs / strategy / "global_step_2" / "actor"
    release = tmp_path / "release"
    res = ckpt("convert", actor, release, "--to", "hf")
    assert res.code == 0, res.err
    names = {p.name for p in release.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((release / "config.json").read_text())["dtype"] == "float32"  # verl's says bfloat16; the weights are fp32
    res = ckpt("parity", release, "--logits", verl_runs / strategy / "logits.pt", "--json")
    assert res.code == 0 and json.loads(res.out)["max_abs_diff"] <= 1e-5, res.out + res.err
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(release).pad_token == "<pad>"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_export_equals_verls_own_merger(ckpt, verl_runs, tmp_path, strategy):
    actor = verl_runs / strategy / "global_step_2" / "actor"
    assert ckpt("convert", actor, tmp_path / "bf16", "--to", "hf", "--dtype", "bf16").code == 0
    ours = load_file(tmp_path / "bf16" / "model-00001-of-00001.safetensors")
    theirs = load_file(verl_runs / strategy / "merged_hf" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert tensor.dtype == ours[name].dtype == torch.bfloat16 and torch.equal(tensor, ours[name]), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("world", [1, 3])
def test_reshard_resumes_in_verls_own_checkpoint_manager(ckpt, verl_runs, tmp_path, world):
    """2-rank verl FSDP1 and FSDP2 actors resharded to 1 and 3 ranks, then loaded by verl's
    FSDPCheckpointManager.load_checkpoint on that many processes (tests/producers/verl_load.py, both in one launch): the
    whole model, the optimizer state by parameter (FSDP1: its flat state re-laid per FlatParameter) and the LR schedule
    equal the saving run's bit for bit, and it trains on."""
    jobs: list[str | Path] = []
    for strategy in STRATEGIES:
        actor = verl_runs / strategy / "global_step_2" / "actor"
        dest = tmp_path / strategy / "actor"
        res = ckpt("reshard", actor, dest, "--world-size", world)
        assert res.code == 0, res.err
        kinds = ("model", "optim", "extra_state")
        assert {p.name for p in dest.glob("*.pt")} == {f"{k}_world_size_{world}_rank_{r}.pt" for k in kinds for r in range(world)}
        assert json.loads((dest / "fsdp_config.json").read_text()) == {"FSDP_version": int(strategy[-1]), "world_size": world}
        assert (dest / "huggingface" / "tokenizer.json").read_bytes() == (actor / "huggingface" / "tokenizer.json").read_bytes()
        jobs += [strategy, dest, verl_runs / strategy]
    out = torchrun(world, "verl_load.py", *jobs, timeout=600)
    for strategy in STRATEGIES:
        assert f"loaded {strategy} actor on {world} ranks: model, optimizer and schedule equal the run's" in out
