"""FSDP2 + tensor parallel on a 2-D (dp, tp) device mesh, saved with torch.distributed.checkpoint, on the CPU (gloo).

    torchrun --nproc-per-node 4 dcp_tp.py save OUT CONFIG...   train, dcp.save OUT/CONFIG, OUT/references/CONFIG.pt
    torchrun --nproc-per-node W dcp_tp.py load TASK...         each TASK is CKPT:DPxTP:OUT: build the model on a DP x TP
                                                               mesh (DP * TP == W), dcp.load + set_state_dict, write
                                                               what it holds (full tensors, as the reference) to
                                                               OUT/loaded.pt and save it again with dcp.save to
                                                               OUT/resaved (the layout torch itself saves on that mesh)

Configs (4 processes):
  tp      parallelize_module on mesh["tp"] (ColwiseParallel / RowwiseParallel, the embeddings and a grouped-experts
          module too), then fully_shard on mesh["dp"] of a 2x2 ("dp", "tp") mesh. The saved DTensors carry
          (_StridedShard(0, sf=2), Shard(0)) for colwise weights and biases and the row-split embedding,
          (Shard(0), Shard(1)) for rowwise weights and the column-split embedding, (Shard(0), Replicate()) for
          rowwise biases, (Shard(0),) on the dp mesh for the LayerNorm (not parallelized), and for the experts
          (Shard(1), Shard(0)) (fully_shard's shard_placement_fn, as torchtitan shards experts) and
          (_StridedShard(0, sf=2), Shard(0)). Sizes shard unevenly (37 rows over 2 x 2; one rank of the head's 3 rows holds none).
  fsdp    the same model, fully_shard alone on a 1-D mesh of 4 (no tensor parallel)

The state saved is get_state_dict(model, optimizer) as {"model", "optim", "step"}; the reference holds every
weight and AdamW moment as full_tensor() (rank 0), keyed model.FQN and optim.state.FQN.KEY, and the lrs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

STEPS = 2


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class Experts(nn.Module):
    """Grouped experts as 3-D weights [experts, in, out] (every token through every expert, averaged)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 12, 8) * 0.2)
        self.w2 = nn.Parameter(torch.randn(4, 8, 12) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = full(self.w1), full(self.w2)
        h = torch.einsum("bsd,edh->bseh", x, w1).relu()
        return torch.einsum("bseh,ehd->bsd", h, w2) / w1.shape[0]


class ExpertParallel(ParallelStyle):
    """Each tp rank holds whole experts: the 3-D weights Shard(0) on the tp mesh."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, partition)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 22)
        self.down = nn.Linear(22, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.pos = nn.Embedding(6, 12)
        self.norm = nn.LayerNorm(12)
        self.block = Block()
        self.experts = Experts()
        self.head = nn.Linear(12, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        x = self.norm(x)
        x = x + self.block(x)
        x = x + self.experts(x)
        return self.head(x).mean(dim=1)


PLAN = {
    "embed": RowwiseParallel(input_layouts=Replicate()),
    "pos": ColwiseParallel(output_layouts=Replicate()),
    "block.up": ColwiseParallel(),
    "block.down": RowwiseParallel(),
    "experts": ExpertParallel(),
    "head": ColwiseParallel(output_layouts=Replicate()),
}


def experts_dim1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim == 3 and param.shape[1] == 12 else None  # experts.w1: FSDP shards its dim 1


def build(dp: int, tp: int | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model on a (dp, tp) mesh (tp None: fully_shard alone on a 1-D mesh of dp ranks)."""
    torch.manual_seed(0)
    model = Net()
    if tp is None:
        fully_shard(model, mesh=init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",)))
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], PLAN)
        fully_shard(model.experts, mesh=mesh["dp"], shard_placement_fn=experts_dim1)
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
        ids, target = torch.randint(0, 37, (4, 6), generator=g), torch.randn(4, 3, generator=g)
        nn.functional.mse_loss(model(ids), target).backward()
        opt.step()
        opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every weight and optimizer value as a full tensor, keyed like the DCP checkpoint; the placements saved."""
    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": full(v).detach().clone() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            out[f"optim.state.{fqn}.{key}"] = full(value).detach().clone()
    out["lr"] = [g["lr"] for g in osd["param_groups"]]
    out["placements"] = {k: str(v.placements) for k, v in msd.items() if isinstance(v, DTensor)}
    return out


def save(root: str, *configs: str) -> None:
    world = dist.get_world_size()
    for config in configs:
        model, opt = build(world, None) if config == "fsdp" else build(2, world // 2)
        train(model, opt)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": STEPS}, checkpoint_id=os.path.join(root, config))
        ref = full_state(model, opt)
        if dist.get_rank() == 0:
            os.makedirs(os.path.join(root, "references"), exist_ok=True)
            torch.save(ref, os.path.join(root, "references", f"{config}.pt"))
        dist.barrier()


def load(*tasks: str) -> None:
    for task in tasks:
        ckpt, mesh, out = task.rsplit(":", 2)
        dp, tp = (int(n) for n in mesh.split("x"))
        assert dp * tp == dist.get_world_size(), task
        model, opt = build(dp, tp)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": -1}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = full_state(model, opt)
        got["step"] = state["step"]
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": state["step"]}, checkpoint_id=os.path.join(out, "resaved"))
        if dist.get_rank() == 0:
            torch.save(got, os.path.join(out, "loaded.pt"))
        dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    {"save": save, "load": load}[sys.argv[1]](*sys.argv[2:])
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as fsdp2.py: gloo's threads occasionally abort at interpreter exit on a loaded 2-core machine
