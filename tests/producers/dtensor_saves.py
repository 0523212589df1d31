"""Per-rank DTensor torch.save files (verl's and SkyRL's layout) and DCP saved with safetensors serialization,
from real FSDP1/FSDP2 (+ tensor parallel) runs on the CPU under torchrun (gloo).

    torchrun --nproc-per-node W dtensor_saves.py save OUT CONFIG...

Each CONFIG trains a small model 2 steps with AdamW and saves into OUT/CONFIG; the full tensors it saved
(`full_tensor()` of every DTensor, the plain tensors as they are) go to OUT/references/CONFIG.pt on rank 0.

Per-rank files, as verl's FSDPCheckpointManager.save_checkpoint writes them (torch.save of model.state_dict(),
optimizer.state_dict() and {lr_scheduler, rng} on every rank, and fsdp_config.json on rank 0):
  fsdp2      fully_shard on a 1-D mesh: Shard(0); the buffers (a 0-d and a 1-D one) and an ignored parameter
             stay plain tensors, the same on every rank
  skyrl      fsdp2 saved as SkyRL's FSDPStrategy saves without an optimizer: {} in the optim files, its extra state keys
  fsdp1      FullyShardedDataParallel(device_mesh=...) under SHARDED_STATE_DICT, bfloat16: DTensor Shard(0)
             weights; the optimizer state is FSDP1's flat-parameter shards (plain tensors); its reference holds
             the optimizer state by parameter index as get_optimizer_state_dict(full_state_dict=True) unflattens it
  hsdp       (W=4) fully_shard on a 2x2 (replicate, shard) mesh: (Replicate(), Shard(0))
  tp         (W=4) parallelize_module (Colwise/Rowwise) on "tp" then fully_shard on "dp" of a 2x2 mesh:
             (_StridedShard(0, sf=2), Shard(0)), (Shard(0), Shard(1)), (Shard(0), Replicate())
DCP with safetensors serialization (reference: what dcp.load of the same checkpoint returns; if torch's own
reader cannot load it, the full tensors saved, and the reader's error under "torch_load_error"):
  dcp-st     dcp.save({model, optim, step}) with FileSystemWriter(serialization_format=SAFETENSORS)
  dcp-hf     dcp.save(model) with HuggingFaceStorageWriter(save_distributed=True), two files per rank
  dcp-hfc    the same with enable_consolidation=True: OUT/dcp-hfc/sharded/ + the consolidated files
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 30)
        self.down = nn.Linear(30, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Sizes that do not divide by 4 (37 rows; 5 rows: one rank of 4 holds none), a 0-d and a 1-D buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.norm = nn.LayerNorm(12)
        self.block = Block()
        self.head = nn.Linear(12, 5)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 12))
        self.register_buffer("scale", torch.tensor(0.75))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 6, dtype=torch.float32) / 6)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(ids)) * self.gate * self.scale + self.inv_freq.sum()
        return self.head(x + self.block(x)).mean(dim=1)


def full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def train(model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype = torch.float32) -> None:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
        ids, target = torch.randint(0, 37, (4, 6), generator=g), torch.randn(4, 5, generator=g).to(dtype)
        nn.functional.mse_loss(model(ids), target).backward()
        opt.step()
        opt.zero_grad()


def build_fsdp2(mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params={model.gate})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def build_tp() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model.block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def save_rank_files(out: str, model: nn.Module, opt: torch.optim.Optimizer, version: int, skyrl: bool = False) -> None:
    """What verl's FSDPCheckpointManager.save_checkpoint writes (verl/utils/checkpoint/fsdp_checkpoint_manager.py); `skyrl`:
    what SkyRL's FSDPStrategy.save_checkpoint writes without an optimizer (skyrl_train/distributed/fsdp_strategy.py)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save({} if skyrl else opt.state_dict(), os.path.join(out, f"optim_world_size_{world}_rank_{rank}.pt"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}  # verl's get_rng_state on the CPU
    extra = {"lr_scheduler": scheduler.state_dict(), "rng": rng}
    if skyrl:
        extra.update(client_state={"global_step": STEPS}, tag=None, fsdp_strategy="fsdp2", world_size=world, rank=rank)
    torch.save(extra, os.path.join(out, f"extra_state_world_size_{world}_rank_{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out, "fsdp_config.json"), "w") as f:
            config = {"fsdp_strategy": "fsdp2", "world_size": world} if skyrl else {"FSDP_version": version, "world_size": world}
            json.dump(config, f, indent=4)


def reference(model_sd: dict, optim_sd: dict | None) -> dict:
    out = {"model": {k: full(v) for k, v in model_sd.items()}}
    if optim_sd is not None:
        out["optim"] = {f"state.{i}.{k}": full(v) for i, state in optim_sd["state"].items() for k, v in state.items()}
    return out


def write_reference(root: str, config: str, ref: dict) -> None:
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(root, "references"), exist_ok=True)
        torch.save(ref, os.path.join(root, "references", f"{config}.pt"))


def save_fsdp2(root: str, config: str) -> None:
    world = dist.get_world_size()
    model, opt = build_fsdp2((2, world // 2), ("replicate", "shard")) if config == "hsdp" else build_fsdp2((world,), ("fsdp",))
    train(model, opt)
    save_rank_files(os.path.join(root, config), model, opt, 2, skyrl=config == "skyrl")
    write_reference(root, config, reference(model.state_dict(), None if config == "skyrl" else opt.state_dict()))


def save_tp(root: str, config: str) -> None:
    model, opt = build_tp()
    train(model, opt)
    save_rank_files(os.path.join(root, config), model, opt, 2)
    write_reference(root, config, reference(model.state_dict(), opt.state_dict()))


def save_fsdp1(root: str, config: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    model = FSDP(Net().to(torch.bfloat16), device_mesh=mesh, device_id=torch.device("cpu"), use_orig_params=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, torch.bfloat16)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()):
        save_rank_files(os.path.join(root, config), model, opt, 1)
        model_sd = model.state_dict()
    ref = reference(model_sd, None)
    # The optimizer by parameter (torch's own unflattening of the flat state), keyed by index in model.parameters()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    whole = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    params = [k for k, v in model_sd.items() if isinstance(v, DTensor)]
    ref["optim"] = {f"state.{params.index(fqn)}.{k}": v for fqn, state in whole["state"].items() for k, v in state.items()}
    write_reference(root, config, ref)


def save_dcp(root: str, config: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build_fsdp2((dist.get_world_size(),), ("fsdp",))
    train(model, opt)
    msd, osd = get_state_dict(model, opt)
    saved = {k: full(v) for k, v in msd.items()}
    out = os.path.join(root, config)
    if config == "dcp-st":
        dcp.save(
            {"model": msd, "optim": osd, "step": STEPS},
            storage_writer=FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS),
        )
        saved = {f"model.{k}": v for k, v in saved.items()}
        saved.update({f"optim.state.{fqn}.{k}": full(v) for fqn, st in osd["state"].items() for k, v in st.items()})
        target = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}}
        reader = FileSystemReader(out)
    else:
        mapping = {name: 1 if name.startswith(("embed", "norm")) else 2 for name in msd}
        writer = HuggingFaceStorageWriter(
            out, fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=config == "dcp-hfc"
        )
        dcp.save(msd, storage_writer=writer)
        target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in saved.items()}  # full tensors on every rank
        reader = HuggingFaceStorageReader(out)
    ref: dict = {"model": saved}
    try:
        dcp.load(target, storage_reader=reader)
        loaded = target["model"] if config == "dcp-st" else target
        ref["loaded"] = {(f"model.{k}" if config == "dcp-st" else k): full(v) for k, v in loaded.items()}
    except BaseException as exc:  # CheckpointException is a BaseException; FileSystemReader torch.load()s every item
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        ref["torch_load_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}"
    write_reference(root, config, ref)


SAVERS = {
    "fsdp2": save_fsdp2,
    "skyrl": save_fsdp2,
    "hsdp": save_fsdp2,
    "tp": save_tp,
    "fsdp1": save_fsdp1,
    "dcp-st": save_dcp,
    "dcp-hf": save_dcp,
    "dcp-hfc": save_dcp,
}


def save(root: str, *configs: str) -> None:
    for config in configs:
        SAVERS[config](root, config)
        dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    {"save": save}[sys.argv[1]](*sys.argv[2:])
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as fsdp2.py: gloo's threads occasionally abort at interpreter exit on a loaded 2-core machine
