"""Build a DCP checkpoint of a requested size with real FSDP2 + AdamW (run under torchrun, gloo, CPU).

    torchrun --nproc-per-node 2 benchmarks/fsdp2_build.py OUT SIZE_GB

Weights are a third of the bytes, Adam's two moments the rest; layers are 4096-wide linears.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard


def main(out: str, size_gb: float) -> None:
    dist.init_process_group("gloo")
    width = 4096
    layers = max(1, round(size_gb * 1e9 / 3 / (width * width * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=True) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
