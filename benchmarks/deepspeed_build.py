"""Build a DeepSpeed ZeRO fp32 checkpoint of about SIZE_GB on disk (run under torchrun, DS_ACCELERATOR=cpu).

    torchrun --nproc-per-node 2 benchmarks/deepspeed_build.py OUT SIZE_GB [STAGE]

STAGE is 2 (default), 3, or moe: ZeRO-2 with deepspeed.moe.layer.MoE layers of 8 experts at expert-parallel
size 2. On disk a ZeRO-2 fp32 checkpoint takes 16 bytes per parameter (4 in the model states or the expert
files, 12 in the optimizer files: fp32 master weights and Adam's two moments); a ZeRO-3 one 12 (its model
states hold no weights). Layers are 4096-wide linears; an expert is a 1024-wide one.
"""

from __future__ import annotations

import sys
from typing import Any

import deepspeed
import torch
from torch import nn

BYTES_PER_PARAM = {2: 16, 3: 12}
MOE_WIDTH, MOE_EXPERTS, MOE_EP = 1024, 8, 2


class MoEStack(nn.Module):
    """MoE layers (each 8 experts Linear(1024, 1024) at ep_size 2, top-1 routing) and their load-balancing loss."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        expert = nn.Linear(MOE_WIDTH, MOE_WIDTH)
        self.layers = nn.ModuleList(
            MoE(hidden_size=MOE_WIDTH, expert=expert, num_experts=MOE_EXPERTS, ep_size=MOE_EP, k=1, min_capacity=4) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(())
        for layer in self.layers:
            out, aux, _ = layer(x)
            x, total = x + out, total + aux
        return x.sum() + total


def train_and_save(
    out: str, model: nn.Module, width: int, stage: int, steps: int, lr: float, tokens: int = 1, zero: dict[str, Any] | None = None
) -> None:
    """`steps` AdamW steps of `model` under DeepSpeed ZeRO `stage` (gloo, CPU), then save_checkpoint(out); `zero`: more
    zero_optimization settings."""
    deepspeed.init_distributed(dist_backend="gloo")
    params: Any = model.parameters()
    if any(getattr(p, "allreduce", True) is False for p in model.parameters()):  # MoE experts: their own param groups
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer([{"name": "params", "params": list(model.parameters())}])
    opt = torch.optim.AdamW(params, lr=lr)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, **(zero or {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    for _ in range(steps):
        engine.backward(engine(torch.randn(1, tokens, width)).sum())
        engine.step()
    engine.save_checkpoint(out)


def main(out: str, size_gb: float, stage: int, moe: bool = False) -> None:
    if stage not in BYTES_PER_PARAM:
        raise SystemExit(f"ZeRO stage must be 2 or 3, not {stage}")
    if moe:
        layers = max(1, round(size_gb * 1e9 / BYTES_PER_PARAM[2] / (MOE_EXPERTS * MOE_WIDTH * MOE_WIDTH)))
        train_and_save(out, MoEStack(layers), MOE_WIDTH, 2, steps=1, lr=1e-4, tokens=16)
        return
    width = 4096
    layers = max(1, round(size_gb * 1e9 / BYTES_PER_PARAM[stage] / (width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    train_and_save(out, model, width, stage, steps=1, lr=1e-4)


if __name__ == "__main__":
    kind = sys.argv[3] if len(sys.argv) > 3 else "2"
    main(sys.argv[1], float(sys.argv[2]), 2 if kind == "moe" else int(kind), moe=kind == "moe")
