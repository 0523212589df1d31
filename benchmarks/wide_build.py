"""Build a wide checkpoint (thousands of small parameters) with a real producer (run under torchrun, CPU).

    torchrun --nproc-per-node 2 benchmarks/wide_build.py OUT PRODUCER SHAPE

PRODUCER: zero2 or zero3 (DeepSpeed, DS_ACCELERATOR=cpu) or dcp (FSDP2 + torch.distributed.checkpoint).
SHAPE:
  stack  500 blocks of Linear(32, 32) + LayerNorm(32): 2,000 parameters (Llama-3-70B has 723)
  moe    40 layers of 256 experts, each two Linear(8, 8) without bias, and a router per layer:
         20,520 parameters, stored per expert as transformers v4 names MoE models (DeepSeek-V3, Qwen3-MoE)
Both train two AdamW steps, so every parameter has its two moments and a step.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

SHAPES = ("stack", "moe")
PRODUCERS = ("zero2", "zero3", "dcp")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, width, bias=False)
        self.w2 = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class MoELayer(nn.Module):
    """Every expert runs on every token (weighted by the router), so every expert gets a gradient."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(x), dim=-1)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=-1)
        return x + (outputs * weights.unsqueeze(-2)).sum(-1)


def model_of(shape: str) -> tuple[nn.Sequential, int]:
    torch.manual_seed(0)
    if shape == "stack":
        return nn.Sequential(*(Block(32) for _ in range(500))), 32
    return nn.Sequential(*(MoELayer(8, 256) for _ in range(40))), 8


def build_dcp(out: str, model: nn.Sequential, width: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=out)
    dist.destroy_process_group()


def build_deepspeed(out: str, model: nn.Sequential, width: int, stage: int) -> None:
    from deepspeed_build import train_and_save  # benchmarks/: the 1-4 GB DeepSpeed builder

    # ZeRO-3 keeps a gathered parameter that is used again within stage3_max_reuse_distance elements of the trace, and
    # looks that far ahead at every module's release: at 64 elements a parameter that is every remaining module of the
    # model, so 30,000 modules made each step quadratic (the first forward took over 30 minutes here). Tiny, as the
    # parameters are; the saved layout does not depend on it.
    zero = {"stage3_max_reuse_distance": 1000} if stage == 3 else None
    train_and_save(out, model, width, stage, steps=2, lr=1e-3, zero=zero)


def main(out: str, producer: str, shape: str) -> None:
    if producer not in PRODUCERS or shape not in SHAPES:
        raise SystemExit(f"usage: wide_build.py OUT {{{','.join(PRODUCERS)}}} {{{','.join(SHAPES)}}}")
    model, width = model_of(shape)
    if producer == "dcp":
        build_dcp(out, model, width)
    else:
        build_deepspeed(out, model, width, int(producer[-1]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
