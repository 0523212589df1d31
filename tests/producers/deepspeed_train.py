"""Real DeepSpeed ZeRO runs on the CPU (DS_ACCELERATOR=cpu, gloo), under torchrun.

    torchrun --nproc-per-node W deepspeed_train.py save OUT CONFIG...   CONFIG = stage{1,2,3}-{fp32,bf16}

For each config: train 3 steps of a model with parameter sizes that do not divide by 2 or 3, a
tied weight, a frozen parameter, a buffer and two param groups (one without weight decay), with
AdamW and a WarmupLR schedule; save with client_state carrying a dataloader offset.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.block = nn.Sequential(nn.Linear(12, 29), nn.LayerNorm(29), nn.Linear(29, 12))
        self.frozen = nn.Linear(12, 7)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(12, 37, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 12))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        x = x + self.block(x) + self.frozen(x).sum(-1, keepdim=True)
        return self.head(x)


def config(stage: int, precision: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
        "steps_per_print": 1000,
    }


def engine_for(stage: int, precision: str):
    torch.manual_seed(0)
    model = Net()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, precision))
    return engine


def train(engine, steps: range) -> None:
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step * 10 + dist.get_rank())
        ids = torch.randint(0, 37, (2, 5), generator=g)
        logits = engine(ids).to(dtype)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()


def save(out: str, *names: str) -> None:
    for name in names:
        stage, precision = int(name[5]), name.split("-")[1]
        engine = engine_for(stage, precision)
        train(engine, range(STEPS))
        engine.save_checkpoint(os.path.join(out, name), client_state={"dataloader": {"offset": STEPS * 2 * dist.get_world_size()}})
        dist.barrier()


if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend="gloo")
    {"save": save}[sys.argv[1]](*sys.argv[2:])
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
