"""Real DeepSpeed MoE (expert parallel, deepspeed.moe.layer.MoE) under ZeRO-1/2 on the CPU (gloo), under torchrun.

    torchrun --nproc-per-node W deepspeed_moe.py save OUT CONFIG...    CONFIG = stage{0,1,2}-{fp32,bf16,bf16acc32}-ep{E}[-dbe][-mixed]
    torchrun --nproc-per-node W deepspeed_moe.py load SRC:CONFIG:OUT...
    torchrun --nproc-per-node W deepspeed_moe.py save OUT CONFIG... + load SRC:CONFIG:OUT...   (both, one launch)

CONFIG: the ZeRO stage (0: no ZeRO, DeepSpeed then writes expp_rank_* optimizer files), the precision (bf16acc32:
BF16_Optimizer), the expert-parallel size E of the MoE layers (`moe`: 4 experts at E, `moe2`: 2 experts at min(E, 2)),
-dbe for DeepSpeed's use_data_before_expert_parallelism topology, -mixed for `moe2` at expert-parallel size 1. With two
expert group sizes each process orders the param groups by its own string hashing; see as_hashed.

save: train 3 steps with AdamW (two named param groups, split by split_params_into_different_moe_groups_for_optimizer),
save with engine.save_checkpoint and write OUT/CONFIG/reference.pt: what the run held, gathered from DeepSpeed's live
optimizer (fp32 master weight, exp_avg, exp_avg_sq and step of every trainable parameter, every expert under its
global name, as _save_moe_checkpoint names expert files; at stage 0 the parameter itself and the torch optimizer's
per-parameter state).
load: a fresh engine at this world size loads SRC with a plain engine.load_checkpoint, writes OUT/loaded.pt in the
same layout (plus the client state it got), then trains one step (the loaded run works).
"""

from __future__ import annotations

import os
import re

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups
from ds_held import gathered, run, zero_state
from torch import nn

STEPS = 3
EXPERT = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")


class MoENet(nn.Module):
    """Embedding, a dense block, two MoE layers (4 experts at expert-parallel size `ep`, 2 experts at `ep2`), a
    buffer, a head; sizes that do not divide by 2 or 4 so partitions are uneven."""

    def __init__(self, ep: int, ep2: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.block = nn.Linear(12, 12)
        expert = nn.Sequential(nn.Linear(12, 7), nn.ReLU(), nn.Linear(7, 12))
        self.moe = MoE(hidden_size=12, expert=expert, num_experts=4, ep_size=ep, k=1, min_capacity=4, use_rts=False)
        self.moe2 = MoE(hidden_size=12, expert=nn.Linear(12, 12), num_experts=2, ep_size=ep2, k=1, min_capacity=4, use_rts=False)
        self.head = nn.Linear(12, 37)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 12))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (self.embed(ids) * self.scale).to(self.block.weight.dtype)
        x = x + self.block(x)
        out, aux, _ = self.moe(x)
        x = x + out
        out2, aux2, _ = self.moe2(x)
        return self.head(x + out2), aux + aux2


def parse(name: str) -> tuple[int, str, int, bool, bool]:
    parts = name.split("-")
    return int(parts[0][5:]), parts[1], int(parts[2][2:]), "dbe" in parts[3:], "mixed" in parts[3:]


def config(stage: int, precision: str, dbe: bool) -> dict:
    extra = {"data_types": {"grad_accum_dtype": "fp32"}} if precision == "bf16acc32" else {}  # BF16_Optimizer
    return {
        **extra,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": precision.startswith("bf16")},
        "zero_allow_untested_optimizer": True,
        "use_data_before_expert_parallelism": dbe,
        "steps_per_print": 1000,
    }


def engine_for(name: str, hashed: bool = True):
    """hashed: order MoE groups per rank as a save under per-process hash seeds does (see as_hashed)."""
    stage, precision, ep, dbe, mixed = parse(name)
    for cache in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, groups._EXPERT_DATA_PARALLEL_GROUP):
        cache.clear()  # DeepSpeed keeps expert groups by name for the process; each config builds its own, as a fresh run
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS.clear()
    torch.manual_seed(0)
    ep2 = 1 if mixed else min(ep, 2)
    model = MoENet(ep, ep2)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    param_groups = [{"name": "decay", "params": decay, "weight_decay": 0.1}, {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]
    split = split_params_into_different_moe_groups_for_optimizer(param_groups)
    if ep2 != ep:
        split = as_hashed(split, descending=hashed and dist.get_rank() % 2 == 1)
    opt = torch.optim.AdamW(split, lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, precision, dbe))
    return engine


def as_hashed(split: list[dict], descending: bool) -> list[dict]:
    """The MoE groups in the order a process's string hashing gives them: split_params_into_different_moe_groups_for_optimizer
    iterates a set of expert group names, so with two expert-parallel sizes each process orders each block of MoE groups by
    its own PYTHONHASHSEED. Made deterministic here: a save orders them ascending on even ranks and descending on odd
    ranks; a load ascending everywhere (as under one PYTHONHASHSEED giving rank 0's order)."""
    dense = [g for g in split if not g.get("moe")]
    blocks = [[g for g in split if g.get("moe") and g["weight_decay"] == wd] for wd in (0.1, 0.0)]
    return dense + [g for block in blocks for g in sorted(block, key=lambda g: g["name"], reverse=descending)]


def train(engine, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step * 10 + dist.get_rank())
        ids = torch.randint(0, 37, (2, 8), generator=g)
        logits, aux = engine(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()) + 0.01 * aux.float()
        engine.backward(loss)
        engine.step()


def global_name(engine, name: str) -> str:
    """A local expert parameter's name with its global expert id (as _save_moe_checkpoint names it)."""
    m = EXPERT.match(name)
    if not m:
        return name
    module = engine.module.get_submodule(m.group(1)[: -len(".deepspeed_moe.experts.deepspeed_experts.")])
    ep_rank = groups._get_expert_parallel_rank(module.expert_group_name)
    return f"{m.group(1)}{ep_rank * module.num_local_experts + int(m.group(2))}{m.group(3)}"


def held(engine) -> dict:
    """What the run holds, full tensors by global parameter name: fp32 master weights, exp_avg, exp_avg_sq, step
    (ds_held.zero_state: each expert summed over its expert-data-parallel group)."""
    return zero_state(engine, lambda name: global_name(engine, name))


def held_without_zero(engine) -> dict:
    """Stage 0 (no ZeRO, fp32): each parameter as the run held it and the torch optimizer's state of it (exp_avg,
    exp_avg_sq and step per parameter), every expert under its global name."""
    opt = engine.optimizer
    mine = {}
    for name, param in engine.module.named_parameters():
        state = {"fp32": param.detach().clone().float(), **{k: v.detach().clone() for k, v in opt.state[param].items()}}
        mine[global_name(engine, name)] = state
    return gathered(mine)


def held_now(engine) -> dict:
    return held(engine) if engine.zero_optimization() else held_without_zero(engine)


def save(out: str, *names: str) -> None:
    for name in names:
        engine = engine_for(name)
        train(engine, range(STEPS))
        engine.save_checkpoint(os.path.join(out, name), client_state={"dataloader": {"offset": STEPS * 2 * dist.get_world_size()}})
        reference = held_now(engine)
        if dist.get_rank() == 0:
            torch.save({"world": dist.get_world_size(), "params": reference}, os.path.join(out, name, "reference.pt"))
        dist.barrier()


def load(*tasks: str) -> None:
    for task in tasks:
        src, name, out = task.split(":")
        engine = engine_for(name, hashed=False)  # every process orders its MoE groups as rank 0 of the save did
        _, client = engine.load_checkpoint(src)
        loaded = held_now(engine)
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            torch.save(
                {"world": dist.get_world_size(), "params": loaded, "client": client.get("dataloader")}, os.path.join(out, "loaded.pt")
            )
        train(engine, range(STEPS, STEPS + 1))  # the loaded run takes a step
        dist.barrier()


if __name__ == "__main__":
    run({"save": save, "load": load})
