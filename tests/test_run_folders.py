"""ckpt on run folders as the frameworks write them (Trainer, accelerate, Lightning; tests/producers/run_folders.py):
inspect from the run root and from the checkpoint, verify --deep and its failure on any truncated component, weights
exports equal to each framework's own consolidation, reshard to 3 processes resumed by each framework, `ckpt ls`,
and the right level named when pointed too low."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    RUN_FOLDERS,
    RUN_FOLDERS_TWO_PROCESS,
    Evil,
    ckpt_quiet,
    resume_run_folders,
    run_folder_checkpoint,
    run_folder_saved,
)
from safetensors.torch import load_file
from test_run_folders_producers import assert_same

PARAMS = 19_616  # the tiny Llama's parameters (tests/producers/tiny_llama.py)


def framework(name: str) -> str:
    return name.split("-")[0]


@pytest.mark.parametrize("name", RUN_FOLDERS)
def test_inspect_from_the_root_and_from_the_checkpoint(ckpt, run_folders, name):
    root, checkpoint = run_folders[name], run_folder_checkpoint(run_folders[name])
    saved = run_folder_saved(root)
    from_root = json.loads(ckpt("inspect", root, "--json").out)
    direct = json.loads(ckpt("inspect", checkpoint, "--json").out)
    assert from_root["path"] == direct["path"] == str(checkpoint)
    assert any("using" in n and "the newest" in n for n in from_root["notes"]), from_root["notes"]
    for doc in (from_root, direct):
        state = doc["training_state"]
        assert doc["details"]["framework"] == state["framework"]["name"] == framework(name)
        assert doc["num_params"] == PARAMS
        model = [t for t in doc["tensors"] if t["role"] == "model"]
        optimizer = [t["name"] for t in doc["tensors"] if t["role"] == "optimizer"]
        assert len(model) == 21 and not any(k in t["name"] for t in model for k in ("exp_avg", "optimizer", "callbacks"))
        assert len([n for n in optimizer if n.endswith("exp_avg_sq")]) == 21, optimizer
        assert state["optimizer"]["kind"] == "Adam/AdamW"
        if name != "accelerate-fsdp2":  # accelerate FSDP records no step (its folders count saves)
            assert doc["step"] == 4
        if framework(name) in ("trainer", "accelerate"):
            assert state["rng"]["ranks"] == (1 if name == "trainer-plain" else 2)
        if framework(name) == "accelerate" or name in ("trainer-ds2", "trainer-fsdp2", "trainer-plain"):  # a scheduler file
            assert state["lr_scheduler"]["file"].startswith("scheduler.")
            assert state["lr_scheduler"]["last_epoch"] == saved["scheduler"]["last_epoch"]
        if framework(name) == "trainer":
            assert state["framework"]["global_step"] == 4 and state["framework"]["max_steps"] == 4


def component_files(checkpoint: Path) -> list[Path]:
    return [checkpoint] if checkpoint.is_file() else sorted(p for p in checkpoint.rglob("*") if p.is_file())


@pytest.mark.parametrize("name", RUN_FOLDERS)
def test_verify_deep_passes_and_fails_on_any_truncated_component(ckpt, run_folders, tmp_path, name):
    checkpoint = run_folder_checkpoint(run_folders[name])
    copy = tmp_path / checkpoint.name
    (shutil.copytree if checkpoint.is_dir() else shutil.copy)(checkpoint, copy)
    ok = ckpt("verify", "--deep", copy)
    assert ok.code == 0 and ok.out.startswith("OK"), ok.out + ok.err
    missed = []
    for f in component_files(copy):
        original = f.read_bytes()
        f.write_bytes(original[: len(original) // 2])
        res = ckpt("verify", "--deep", copy)
        text = res.out + res.err
        if res.code != 1 or "Traceback" in text or (f.name not in text and f != copy):
            missed.append((str(f.relative_to(copy.parent)), res.code, text[-300:]))
        f.write_bytes(original)
    assert not missed, missed
    assert len(component_files(copy)) >= 3 or name == "lightning-plain"


@pytest.mark.parametrize("name", RUN_FOLDERS)
def test_weights_export_equals_the_frameworks_own_consolidation(run_folders, run_folders_consolidated, tmp_path, name):
    """`merge ROOT` (the newest checkpoint) holds exactly the model weights, by the names the framework's own tool
    writes (zero_to_fp32.py, accelerate merge-weights, Lightning's converters), bit for bit: never optimizer state."""
    out = tmp_path / "model.safetensors"
    ckpt_quiet("merge", run_folders[name], out)
    got, want = load_file(out), run_folders_consolidated[name]
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_hf_export_of_a_trainer_checkpoint_loads_in_transformers(run_folders, run_folders_consolidated, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt_quiet("convert", run_folders["trainer-fsdp2"], tmp_path / "hf", "--to", "hf", "--weights-only")
    (tmp_path / "hf" / "config.json").write_text((run_folder_checkpoint(run_folders["trainer-plain"]) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for key, want in run_folders_consolidated["trainer-fsdp2"].items():
        assert torch.equal(model.state_dict()[key], want), key
    ckpt_quiet("convert", run_folders["trainer-plain"], tmp_path / "plain", "--to", "hf", "--weights-only")
    assert (tmp_path / "plain" / "config.json").is_file() and (tmp_path / "plain" / "generation_config.json").is_file()


@pytest.fixture(scope="module")
def resumed_at_three(run_folders, tmp_path_factory) -> tuple[dict[str, Path], dict[str, dict]]:
    """Every 2-process run resharded to 3 by `ckpt reshard ROOT` (the newest checkpoint), then resumed by its
    framework's own resume path on 3 processes, all in one launch."""
    out = tmp_path_factory.mktemp("resharded")
    resharded = {}
    for name in RUN_FOLDERS_TWO_PROCESS:
        resharded[name] = out / name
        ckpt_quiet("reshard", run_folders[name], resharded[name], "--world-size", 3)
    return resharded, resume_run_folders(3, resharded, tmp_path_factory.mktemp("resumed3"))


@pytest.mark.parametrize("name", RUN_FOLDERS_TWO_PROCESS)
def test_reshard_to_three_resumes_in_the_framework(run_folders, resumed_at_three, name):
    resharded, loaded = resumed_at_three[0][name], resumed_at_three[1][name]
    saved = run_folder_saved(run_folders[name])
    assert saved["world"] == 2 and loaded["world"] == 3
    assert loaded["step"] == 4
    assert_same({k: v for k, v in saved.items() if k != "world"}, {k: v for k, v in loaded.items() if k != "world"}, name)
    carried = {"trainer": ["trainer_state.json", "rng_state_2.pth"], "accelerate": ["scheduler.bin", "random_states_2.pkl"]}
    carried["lightning"] = ["meta.pt"] if name == "lightning-fsdp" else ["latest"]
    assert all((resharded / f).is_file() for f in carried[framework(name)]), sorted(p.name for p in resharded.iterdir())


def test_reshard_names_what_it_does_with_companions(ckpt, run_folders, tmp_path):
    checkpoint = run_folder_checkpoint(run_folders["trainer-ds2"])
    res = ckpt("reshard", checkpoint, tmp_path / "wrap", "--world-size", 3)
    assert res.code == 0, res.err
    assert "not carried: training_args.bin" in res.err and "rng_state_R.pth (2 ranks -> 3): rule 'wrap'" in res.err
    assert (tmp_path / "wrap" / "rng_state_2.pth").read_bytes() == (checkpoint / "rng_state_0.pth").read_bytes()
    assert (tmp_path / "wrap" / "trainer_state.json").read_bytes() == (checkpoint / "trainer_state.json").read_bytes()
    assert ckpt("reshard", checkpoint, tmp_path / "first", "--world-size", 3, "--per-rank-state", "first").code == 0
    assert (tmp_path / "first" / "rng_state_1.pth").read_bytes() == (checkpoint / "rng_state_0.pth").read_bytes()
    assert ckpt("reshard", checkpoint, tmp_path / "drop", "--world-size", 3, "--per-rank-state", "drop").code == 0
    assert not list((tmp_path / "drop").glob("rng_state*"))
    assert ckpt("reshard", checkpoint, tmp_path / "args", "--world-size", 1, "--trust-pickle").code == 0
    assert (tmp_path / "args" / "training_args.bin").is_file() and not (tmp_path / "args" / "rng_state_1.pth").exists()
    # the Trainer reads rng_state.pth in a one-process run and rng_state_R.pth otherwise (trainer.py _load_rng_state)
    assert [p.name for p in (tmp_path / "args").glob("rng_state*")] == ["rng_state.pth"]
    assert ckpt("reshard", tmp_path / "args", tmp_path / "back", "--world-size", 2).code == 0
    assert sorted(p.name for p in (tmp_path / "back").glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    plain = ckpt("reshard", run_folders["trainer-plain"], tmp_path / "plain", "--world-size", 3)
    assert plain.code == 2 and "nothing to reshard" in plain.err and not (tmp_path / "plain").exists()


def test_ls_lists_every_checkpoint_and_marks_the_newest_complete(ckpt, run_folders, tmp_path):
    res = ckpt("ls", run_folders["lightning-fsdp"], "--json")
    rows = json.loads(res.out)["checkpoints"]
    assert res.code == 0 and len(rows) == 3 and all(r["complete"] and r["framework"] == "lightning" for r in rows)
    assert [r["path"] for r in rows if r["newest"]] == ["lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt"]
    assert {r["step"] for r in rows} == {2, 4} and all(r["world_size"] == 2 and r["format"] == "dcp" for r in rows)
    root = tmp_path / "run"
    shutil.copytree(run_folders["trainer-ds2"], root)
    optim = root / "checkpoint-4" / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    rows = json.loads(ckpt("ls", root, "--json").out)["checkpoints"]
    assert [(r["path"], r["complete"], r["newest"]) for r in rows] == [("checkpoint-2", True, True), ("checkpoint-4", False, False)]
    assert "zero_pp_rank_1" in rows[1]["problem"]
    text = ckpt("ls", root).out
    assert "* checkpoint-2" in text and "INCOMPLETE" in text
    doc = json.loads(ckpt("inspect", root, "--json").out)
    assert doc["path"] == str(root / "checkpoint-2") and any("skipped 'checkpoint-4'" in n for n in doc["notes"])
    (root / "checkpoint-2" / "rng_state_1.pth").unlink()
    assert ckpt("ls", root).code == 1
    assert ckpt("verify", root).code == 1


def test_pointed_too_low_names_the_checkpoint_to_use(ckpt, run_folders):
    checkpoint = run_folder_checkpoint(run_folders["trainer-ds2"])
    res = ckpt("inspect", checkpoint / "global_step4", "--json")
    assert res.code == 0 and any(f"point at {checkpoint}" in n for n in json.loads(res.out)["notes"])
    fsdp = run_folder_checkpoint(run_folders["accelerate-fsdp2"])
    for inside in (fsdp / "pytorch_model_fsdp_0" / ".metadata", checkpoint / "trainer_state.json"):
        res = ckpt("inspect", inside)
        assert res.code == 2 and "point at that folder" in res.err and "Traceback" not in res.err
        assert str(fsdp if "fsdp" in str(inside) else checkpoint) in res.err
    res = ckpt("inspect", fsdp / "pytorch_model_fsdp_0", "--json")
    assert res.code == 0 and any(f"point at {fsdp}" in n for n in json.loads(res.out)["notes"])


def test_companions_are_checked_before_they_are_copied(ckpt, run_folders, tmp_path):
    """A companion is copied as it is, so a pickle the allow list rejects (even under an unknown name) or a FIFO
    fails verify and stops a reshard; nothing runs and nothing is written."""
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(run_folder_checkpoint(run_folders["trainer-fsdp2"]), copy)
    marker = tmp_path / "ran"
    for name in ("scheduler.pt", "notes.bin"):
        torch.save({"payload": Evil(marker)}, copy / name)
        res = ckpt("verify", copy)
        assert res.code == 1 and name in res.out and "posix.system" in res.out + res.err, res.out
        res = ckpt("reshard", copy, tmp_path / "out", "--world-size", 3)
        assert res.code == 1 and not (tmp_path / "out").exists()
        assert any(name in n for n in json.loads(ckpt("inspect", copy, "--json").out)["notes"])
        (copy / name).unlink()
    os.mkfifo(copy / "rng_state_0.pth.tmp")
    res = ckpt("verify", copy)
    assert res.code == 1 and "not a regular file" in res.out
    assert not marker.exists()


def test_torchtitan_step_folders(ckpt, fsdp2_saves, tmp_path):
    """torchtitan saves DCP into ROOT/checkpoint/step-N (here real dcp.save output in torchtitan's folder names)."""
    root = tmp_path / "outputs"
    for step in (10, 20):
        shutil.copytree(fsdp2_saves[2] / "ckpt", root / "checkpoint" / f"step-{step}")
    doc = json.loads(ckpt("inspect", root, "--json").out)
    assert doc["path"] == str(root / "checkpoint" / "step-20") and doc["details"]["framework"] == "torchtitan"
    rows = json.loads(ckpt("ls", root, "--json").out)["checkpoints"]
    assert [(r["path"], r["framework"], r["newest"]) for r in rows] == [
        ("checkpoint/step-10", "torchtitan", False),
        ("checkpoint/step-20", "torchtitan", True),
    ]
    assert ckpt("reshard", root, tmp_path / "w3", "--world-size", 3).code == 0
    assert sorted(p.name for p in (tmp_path / "w3").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


def test_pointed_too_high_names_the_runs(ckpt, run_folders):
    """A folder holding several runs: which is newest is the user's call; the error names them, ls lists all."""
    top = run_folders["trainer-ds2"].parent
    res = ckpt("inspect", top)
    assert res.code == 2 and "runs (" in res.err and str(top / "accelerate-ds") in res.err, res.err
    rows = json.loads(ckpt("ls", top, "--json").out)["checkpoints"]
    newest = sorted(r["path"] for r in rows if r["newest"])
    assert "trainer-ds2/checkpoint-4" in newest and "accelerate-ds/checkpoints/checkpoint_1" in newest
    refused = [r for r in rows if r["path"].startswith("accelerate-fsdp1-")]  # listed as unsupported, not incomplete
    assert len(refused) == 4 and all(r["unsupported"] for r in refused)
    assert all(r["complete"] for r in rows if r not in refused) and len(rows) >= 16


def test_hf_export_carries_the_tokenizer_and_names_the_rest(ckpt, run_folders, tmp_path):
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(run_folder_checkpoint(run_folders["trainer-plain"]), copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "merges.txt"):
        (copy / name).write_text("{}")
    res = ckpt("convert", copy, tmp_path / "hf", "--to", "hf", "--weights-only")
    assert res.code == 0, res.err
    written = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "merges.txt"} <= set(written)
    assert "not carried" in res.err and "trainer_state.json" in res.err and "optimizer.pt" not in written


def test_verl_global_step_folders_are_one_run(ckpt, dtensor_saves_2, tmp_path):
    """verl saves each step's rank files in ROOT/global_step_N/actor: the steps of one run, newest chosen."""
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        shutil.copytree(dtensor_saves_2 / "fsdp2", root / f"global_step_{step}" / "actor")
    res = ckpt("inspect", root, "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out)["path"] == str(root / "global_step_20" / "actor")
    rows = json.loads(ckpt("ls", root, "--json").out)["checkpoints"]
    assert [(r["path"], r["step"], r["newest"]) for r in rows] == [("global_step_10/actor", 10, False), ("global_step_20/actor", 20, True)]


@pytest.mark.parametrize("name,layout", [("accelerate-fsdp1-local", "LOCAL_STATE_DICT"), ("accelerate-fsdp1-nodcp", "use_dcp=False")])
def test_accelerate_fsdp1_per_rank_files_are_refused_by_name(ckpt, run_folders, tmp_path, name, layout):
    """accelerate's FSDP1 per-rank files (LOCAL_STATE_DICT: flat-parameter shards without the parameters' shapes;
    use_dcp=False: ShardedTensor pickles) are refused as unsupported (exit 2) and named, never called damaged; ls lists
    them as UNSUPPORTED."""
    root = run_folders[name]
    checkpoint = run_folder_checkpoint(root)
    for args in (["inspect", checkpoint], ["verify", checkpoint], ["inspect", root], ["convert", root, tmp_path / "out", "--to", "hf"]):
        res = ckpt(*args)
        text = res.out + res.err
        assert res.code == 2 and layout in text and "pytorch_model_fsdp" in text, (args, text)
        assert "damaged" not in text and "Traceback" not in text
    assert not (tmp_path / "out").exists()
    rows = json.loads(ckpt("ls", root, "--json").out)["checkpoints"]
    assert len(rows) == 2 and all(r["unsupported"] and not r["complete"] for r in rows)
