"""The run-folder producers themselves: each framework saved what it saves on a GPU, its own resume path loads it
back at the same world size, and its own consolidation gives the weights the run held."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    RUN_FOLDERS,
    RUN_FOLDERS_ONE_PROCESS,
    RUN_FOLDERS_TWO_PROCESS,
    resume_run_folders,
    run_folder_checkpoint,
    run_folder_saved,
)

DS_TAG_2 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
DS_TAG_3 = [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
DCP_2 = [".metadata", "__0_0.distcp", "__1_0.distcp"]
TRAINER_2 = ["trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"]
ACCELERATE_2 = ["custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]

# Files each checkpoint folder holds at step 4 (relative to run_folder_checkpoint; Lightning plain: a file).
EXPECTED = {
    "trainer-ds2": [*TRAINER_2, "scheduler.pt", "model.safetensors", "config.json", "training_args.bin", "latest", "zero_to_fp32.py"]
    + [f"global_step4/{f}" for f in DS_TAG_2],
    "trainer-ds3": [*TRAINER_2, "config.json", "training_args.bin", "latest", "zero_to_fp32.py"] + [f"global_step4/{f}" for f in DS_TAG_3],
    "trainer-fsdp2": [*TRAINER_2, "scheduler.pt"] + [f"{d}/{f}" for d in ("pytorch_model_fsdp_0", "optimizer_0") for f in DCP_2],
    "trainer-plain": ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin"],
    "accelerate-fsdp2": ACCELERATE_2 + [f"{d}/{f}" for d in ("pytorch_model_fsdp_0", "optimizer_0") for f in DCP_2],
    "accelerate-ds": [*ACCELERATE_2, "latest", "zero_to_fp32.py"] + [f"pytorch_model/{f}" for f in DS_TAG_2],
    "lightning-ds2": ["latest", "zero_to_fp32.py"] + [f"checkpoint/{f}" for f in DS_TAG_2],
    "lightning-ds3": ["latest", "zero_to_fp32.py"] + [f"checkpoint/{f}" for f in DS_TAG_3],
    "lightning-fsdp": ["meta.pt", *DCP_2],
    "lightning-plain": [],
}
# Files a checkpoint must not hold (where a framework leaves a file out on purpose).
ABSENT = {
    "trainer-ds3": ["model.safetensors", "scheduler.pt"],  # ZeRO-3 without gather; DeepSpeed's own scheduler
    "trainer-ds2": ["optimizer.pt"],
    "trainer-fsdp2": ["optimizer.pt", "model.safetensors"],
}


@pytest.mark.parametrize("name", RUN_FOLDERS)
def test_run_root_holds_each_save(run_folders, name):
    root = run_folders[name]
    for step in (2, 4):
        checkpoint = run_folder_checkpoint(root, step)
        assert checkpoint.exists(), checkpoint
        expected = [f.replace("global_step4", f"global_step{step}") for f in EXPECTED[name]]
        missing = [f for f in expected if not (checkpoint / f).is_file()]
        assert not missing, (checkpoint, missing, sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else None)
        assert not [f for f in ABSENT.get(name, []) if (checkpoint / f).exists()], checkpoint
        assert run_folder_saved(root, step)["step"] == step
    if name.startswith("lightning"):
        last = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
        assert last.is_dir() == (name != "lightning-plain") and last.exists()
        assert (root / "lightning_logs" / "version_0" / "hparams.yaml").is_file()
    if name.startswith("trainer"):
        state = json.loads((root / "checkpoint-4" / "trainer_state.json").read_text())
        assert state["global_step"] == 4 and state["max_steps"] == 4


def test_the_two_process_runs_ran_on_two_processes(run_folders):
    """Trainer's DeepSpeed path without a gloo backend trains each rank as a world of 1; these did not."""
    for name in RUN_FOLDERS_TWO_PROCESS:
        if name.startswith("trainer"):
            assert (run_folders[name] / "checkpoint-4" / "rng_state_1.pth").is_file(), name
            state = json.loads((run_folders[name] / "checkpoint-4" / "trainer_state.json").read_text())
            assert state["log_history"][0]["epoch"] == pytest.approx(1 / 16), name  # 64 samples / (2 ranks x 2)


def assert_same(a, b, where: str = "") -> None:
    """Equal nested state: tensors bit-equal (dtype, shape, values), everything else ==."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def resumed_same_world(run_folders, tmp_path_factory) -> dict[str, dict]:
    """Every run resumed from its step-4 checkpoint at the world size it saved at (2, or 1 for the plain runs)."""
    out = tmp_path_factory.mktemp("resumed")
    two = {name: run_folder_checkpoint(run_folders[name]) for name in RUN_FOLDERS_TWO_PROCESS}
    one = {name: run_folder_checkpoint(run_folders[name]) for name in RUN_FOLDERS_ONE_PROCESS}
    return {**resume_run_folders(2, two, out / "w2"), **resume_run_folders(1, one, out / "w1")}


@pytest.mark.parametrize("name", RUN_FOLDERS)
def test_resume_at_the_same_world_size_loads_what_was_saved(run_folders, resumed_same_world, name):
    saved, loaded = run_folder_saved(run_folders[name]), resumed_same_world[name]
    assert loaded["step"] == 4
    assert len(saved["weights"]) == 21 and all(len(state) >= 2 for state in saved["optimizer"].values())
    assert_same(saved, loaded, name)
    fresh = run_folder_saved(run_folders[name], 2)  # the two saves differ: the comparison can fail
    assert not torch.equal(fresh["weights"][sorted(fresh["weights"])[0]], saved["weights"][sorted(saved["weights"])[0]])


@pytest.mark.parametrize("name", RUN_FOLDERS)
def test_framework_consolidation_gives_the_weights_the_run_held(run_folders, run_folders_consolidated, name):
    assert_same(run_folder_saved(run_folders[name])["weights"], run_folders_consolidated[name], name)
