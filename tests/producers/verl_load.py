"""Resume a verl actor from a checkpoint folder with verl's own FSDPCheckpointManager, at whatever world size
torchrun gives, and check what it loaded against the run that saved it.

    torchrun --nproc-per-node W verl_load.py STRATEGY ACTOR RUN [STRATEGY ACTOR RUN ...]

Each triple is loaded in turn in the one launch. STRATEGY is fsdp1 or fsdp2; ACTOR a folder of
model/optim/extra_state_world_size_W_rank_R.pt files (ckpt's reshard of a verl_actor.py save); RUN the verl_actor.py
output for that strategy (its base_model beside it, reference.pt and optim_reference.pt in it). The actor, optimizer
and schedule are built exactly as verl_actor.py builds them, then `FSDPCheckpointManager.load_checkpoint(ACTOR)` loads
this rank's three files. Checked, bit for bit, on rank 0:

    the whole model (verl's get_fsdp_full_state_dict)            == RUN/reference.pt
    the optimizer by parameter name (get_optimizer_state_dict)   == RUN/optim_reference.pt (exp_avg, exp_avg_sq, step)
    the LR schedule                                              resumed at step 2

Then one more training step runs (a finite loss on every rank). A mismatch exits 1 naming the tensor.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from verl_actor import LR, SEQ, STEPS, build_actor, cpu_shims, full_optimizer_state, tokenizer


def fail(message: str) -> None:
    print(f"rank {dist.get_rank()}: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def compare(what: str, got: dict, want: dict) -> None:
    if got.keys() != want.keys():
        fail(f"{what}: keys differ: {sorted(got.keys() ^ want.keys())[:5]}")
    for name, value in want.items():
        if isinstance(value, dict):
            compare(f"{what}.{name}", got[name], value)
        elif isinstance(value, torch.Tensor):
            mine = got[name]
            if mine.dtype != value.dtype or mine.shape != value.shape or not torch.equal(mine, value):
                fail(f"{what}.{name}: {mine.dtype}{list(mine.shape)} differs from the saved run's {value.dtype}{list(value.shape)}")


def main(jobs: list[str]) -> None:
    dist.init_process_group("gloo")
    cpu_shims()
    for i in range(0, len(jobs), 3):
        load(jobs[i], Path(jobs[i + 1]), Path(jobs[i + 2]))
    sys.stdout.flush()
    os._exit(0)  # without tearing down gloo (see fsdp2.py)


def load(strategy: str, actor: Path, run: Path) -> None:
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import get_fsdp_full_state_dict
    from verl.utils.torch_functional import get_constant_schedule_with_warmup
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    torch.manual_seed(1)  # unlike the saving run: every loaded value must come from the files
    module = build_actor(strategy, run.parent / "base_model")
    optimizer = build_optimizer(module.parameters(), FSDPOptimizerConfig(lr=LR, total_training_steps=STEPS))
    lr_scheduler = get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=0)
    contents = ["model", "optimizer", "extra"]
    manager = FSDPCheckpointManager(
        model=module,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        processing_class=tokenizer(),
        checkpoint_config=CheckpointConfig(save_contents=contents, load_contents=contents),
    )
    manager.load_checkpoint(local_path=str(actor))

    weights = get_fsdp_full_state_dict(module, offload_to_cpu=False, rank0_only=True)
    optim = full_optimizer_state(module, optimizer)
    if dist.get_rank() == 0:
        compare("model", {k: v.detach().float() for k, v in weights.items()}, torch.load(run / "reference.pt"))
        want = torch.load(run / "optim_reference.pt", weights_only=False)
        compare("optimizer.state", optim["state"], want["state"])
        if optim["param_groups"] != want["param_groups"]:
            fail(f"param_groups {optim['param_groups']} differ from the saved run's {want['param_groups']}")
        if lr_scheduler.last_epoch != STEPS:
            fail(f"the LR schedule resumed at step {lr_scheduler.last_epoch}, not {STEPS}")

    module.train()
    ids = torch.arange(4, 4 + SEQ).reshape(1, SEQ)
    optimizer.zero_grad()
    loss = module(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    if not torch.isfinite(loss):
        fail(f"the step after loading gave a loss of {loss.item()}")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"loaded {strategy} {actor.name} on {dist.get_world_size()} ranks: model, optimizer and schedule equal the run's", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
