"""The small model both training producers use: a tied embedding/head, a frozen Linear, a buffer, and
parameter sizes that do not divide by 2 or 3 (so ZeRO and FSDP2 partitions are uneven)."""

from __future__ import annotations

import torch
from torch import nn


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
        x = (self.embed(ids) * self.scale).to(self.block[0].weight.dtype)  # bf16 engines cast params, not buffers
        x = x + self.block(x) + self.frozen(x).sum(-1, keepdim=True)
        return self.head(x)
