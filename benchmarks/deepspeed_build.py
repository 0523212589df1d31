"""Build a DeepSpeed ZeRO fp32 checkpoint of about SIZE_GB on disk (run under torchrun, DS_ACCELERATOR=cpu).

    torchrun --nproc-per-node 2 benchmarks/deepspeed_build.py OUT SIZE_GB [STAGE]

STAGE is 2 (default) or 3. On disk a ZeRO-2 fp32 checkpoint takes 16 bytes per parameter (4 in the
model states, 12 in the optimizer files: fp32 master weights and Adam's two moments); a ZeRO-3 one
12 (its model states hold no weights). Layers are 4096-wide linears.
"""

from __future__ import annotations

import sys

import deepspeed
import torch
from torch import nn

BYTES_PER_PARAM = {2: 16, 3: 12}


def train_and_save(out: str, model: nn.Module, width: int, stage: int, steps: int, lr: float) -> None:
    """`steps` AdamW steps of `model` under DeepSpeed ZeRO `stage` (gloo, CPU), then save_checkpoint(out)."""
    deepspeed.init_distributed(dist_backend="gloo")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    for _ in range(steps):
        engine.backward(engine(torch.randn(1, width)).sum())
        engine.step()
    engine.save_checkpoint(out)


def main(out: str, size_gb: float, stage: int) -> None:
    if stage not in BYTES_PER_PARAM:
        raise SystemExit(f"ZeRO stage must be 2 or 3, not {stage}")
    width = 4096
    layers = max(1, round(size_gb * 1e9 / BYTES_PER_PARAM[stage] / (width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    train_and_save(out, model, width, stage, steps=1, lr=1e-4)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2)
