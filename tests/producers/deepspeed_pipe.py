"""Real DeepSpeed pipeline parallelism (deepspeed.pipe.PipelineModule, 2 stages) under ZeRO-1 on the CPU (gloo), under torchrun.

    torchrun --nproc-per-node W deepspeed_pipe.py save OUT CONFIG...          CONFIG = stage1-{fp32,bf16}
    torchrun --nproc-per-node W deepspeed_pipe.py load SRC:CONFIG:OUT...
    torchrun --nproc-per-node W deepspeed_pipe.py save OUT CONFIG... + load SRC:CONFIG:OUT...   (both, one launch)

The model: Linear(8, 16), four residual blocks (LayerNorm, Linear(16, 16), a persistent buffer), Linear(16, 4), cut into
2 stages by parameter count (`partition_method="parameters"`); W ranks are 2 stages x W/2 data-parallel ranks.
save: train 2 batches (2 micro-batches of 2) with AdamW, save with engine.save_checkpoint and write OUT/CONFIG/reference.pt:
what the run held, every stage's parameters under the PipelineModule's names (fp32 master weight, exp_avg, exp_avg_sq,
step, gathered from DeepSpeed's live ZeRO-1 optimizer over each stage's data-parallel group).
load: a fresh engine at this world size loads SRC with a plain engine.load_checkpoint, writes OUT/loaded.pt in the same
layout, then trains one more batch (the loaded run works).
"""

from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from ds_held import run, zero_state
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(width), nn.Linear(width, width)
        self.register_buffer("scale", torch.full((width,), 1.0 + index / 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x)) * self.scale.to(x.dtype)


def engine_for(name: str):
    precision = name.split("-")[1]
    torch.manual_seed(0)
    layers = [LayerSpec(nn.Linear, 8, 16), *(LayerSpec(Block, 16, i) for i in range(4)), LayerSpec(nn.Linear, 16, 4)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="parameters")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, torch.bfloat16 if precision == "bf16" else torch.float32


def train(engine, dtype: torch.dtype, batches: range) -> None:
    for batch in batches:
        g = torch.Generator().manual_seed(1000 + batch * 10 + engine.grid.data_parallel_id)
        data = [(torch.randn(2, 8, generator=g).to(dtype), torch.randn(2, 4, generator=g).to(dtype)) for _ in range(2)]
        engine.train_batch(data_iter=iter(data))


def held(engine) -> dict:
    """This stage's parameters as the run holds them (ds_held.zero_state: each summed over the stage's data-parallel
    group), every rank's view gathered, by the PipelineModule's names."""
    return zero_state(engine)


def save(out: str, *names: str) -> None:
    for name in names:
        engine, dtype = engine_for(name)
        train(engine, dtype, range(2))
        engine.save_checkpoint(os.path.join(out, name))
        reference = held(engine)
        if dist.get_rank() == 0:
            torch.save({"world": dist.get_world_size(), "params": reference}, os.path.join(out, name, "reference.pt"))
        dist.barrier()


def load(*tasks: str) -> None:
    for task in tasks:
        src, name, out = task.split(":")
        engine, dtype = engine_for(name)
        engine.load_checkpoint(src)
        loaded = held(engine)
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            torch.save({"world": dist.get_world_size(), "params": loaded, "steps": engine.global_steps}, os.path.join(out, "loaded.pt"))
        train(engine, dtype, range(2, 3))  # the loaded run takes a step
        dist.barrier()


if __name__ == "__main__":
    run({"save": save, "load": load})
