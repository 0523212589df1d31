"""What a DeepSpeed run holds, gathered the same way by every producer that checks ckpt against it, and the producers'
command line (`save OUT CONFIG... + load SRC:CONFIG:OUT...`, commands separated by '+', one torchrun launch)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import deepspeed
import torch
import torch.distributed as dist


def zero_state(engine, name_of: Callable[[str], str] = str) -> dict:
    """Every trainable parameter's fp32 master weight, exp_avg, exp_avg_sq and step from DeepSpeed's live ZeRO-1/2 (or
    BF16_Optimizer) optimizer: each summed over the parameter's own data-parallel group (an expert's: its
    expert-data-parallel group; a pipeline stage's: the stage's) from the fragment mappings (tensor_fragment.py), as
    safe_get_full_fp32_param does. Named by `name_of` (an expert's global name, say) and gathered from every rank."""
    from deepspeed.utils import safe_get_full_fp32_param

    opt = engine.optimizer
    bf16_optimizer = hasattr(opt, "fp32_groups_flat_partition")
    flats = opt.fp32_groups_flat_partition if bf16_optimizer else opt.single_partition_of_fp32_groups
    group_of = {id(p): i for i, group in enumerate(opt.bf16_groups if bf16_optimizer else opt.bit16_groups) for p in group}
    mine = {}
    for name, param in engine.module.named_parameters():
        state = {"fp32": safe_get_full_fp32_param(param).detach().clone().float()}
        flat = flats[group_of[id(param)]]
        for key in ("exp_avg", "exp_avg_sq"):
            buffer = torch.zeros(param.numel(), dtype=torch.float32)
            if param._hp_mapping is not None:
                lp, hp = param._hp_mapping.lp_fragment_address, param._hp_mapping.hp_fragment_address
                buffer.narrow(0, lp.start, lp.numel).copy_(opt.optimizer.state[flat][key].narrow(0, hp.start, hp.numel))
            dist.all_reduce(buffer, group=param._dp_group)
            state[key] = buffer.reshape(param.shape)
        state["step"] = opt.optimizer.state[flat]["step"].detach().clone()
        mine[name_of(name)] = state
    return gathered(mine)


def gathered(mine: dict) -> dict:
    """Every rank's {name: {key: tensor}} joined; a name several ranks hold (replicas) must be equal on all of them."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for view in everyone:
        for name, state in view.items():
            if name in out:
                assert all(torch.equal(out[name][k], v) for k, v in state.items()), name
            out[name] = state
    return out


def run(commands: dict[str, Callable[..., None]]) -> None:
    """The command line: `save OUT CONFIG... + load TASK...` under torchrun (gloo), then a clean exit."""
    deepspeed.init_distributed(dist_backend="gloo")
    command: list[str] = []
    for arg in [*sys.argv[1:], "+"]:
        if arg != "+":
            command.append(arg)
            continue
        commands[command[0]](*command[1:])
        command = []
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
