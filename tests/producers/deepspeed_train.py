"""Real DeepSpeed ZeRO runs on the CPU (DS_ACCELERATOR=cpu, gloo), under torchrun.

    torchrun --nproc-per-node W deepspeed_train.py save OUT CONFIG...   CONFIG = stage{1,2,3}-{fp32,bf16},
                                                                        or stage1-bf16acc32 (BF16_Optimizer)
    torchrun --nproc-per-node M deepspeed_train.py resume SRC:CONFIG:OUT...

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
from net import Net
from torch import nn

STEPS = 3


def config(stage: int, precision: str) -> dict:
    extra = {"data_types": {"grad_accum_dtype": "fp32"}} if precision == "bf16acc32" else {}
    return {
        **extra,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "round_robin_gradients": precision.endswith("rr")},
        "bf16": {"enabled": precision.startswith("bf16")},  # fp32rr: fp32 with round_robin_gradients
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


def train(engine, steps: range, same_batch: bool = False) -> None:
    """Each rank's batch depends on its rank, or (same_batch) not: then every world size takes the same step."""
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step * 10 + (0 if same_batch else dist.get_rank()))
        ids = torch.randint(0, 37, (2, 5), generator=g)
        logits = engine(ids).to(dtype)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()


def save(out: str, *names: str) -> None:
    for name in names:
        if name == "llama":
            save_llama(out)
            continue
        stage, precision = int(name[5]), name.split("-")[1]
        engine = engine_for(stage, precision)
        train(engine, range(STEPS))
        engine.save_checkpoint(os.path.join(out, name), client_state={"dataloader": {"offset": STEPS * 2 * dist.get_world_size()}})
        save_reference(engine, os.path.join(out, name, "reference.pt"))
        dist.barrier()


def resume(*tasks: str) -> None:
    """Each task SRC:CONFIG:OUT: load with a plain load_checkpoint, save again at once, train 2 more steps
    on batches that are the same on every rank, record the fp32 weights."""
    for task in tasks:
        resume_one(*task.split(":"))


def resume_one(src: str, name: str, out: str) -> None:
    stage, precision = int(name[5]), name.split("-")[1]
    engine = engine_for(stage, precision)
    _, client = engine.load_checkpoint(src)
    engine.save_checkpoint(os.path.join(out, "resaved"), client_state={"dataloader": client["dataloader"]})
    train(engine, range(STEPS, STEPS + 2), same_batch=True)
    save_reference(engine, os.path.join(out, "after.pt"))
    engine.save_checkpoint(os.path.join(out, "after"))
    dist.barrier()


def save_reference(engine, path: str) -> None:
    """DeepSpeed's own view of the fp32 master weights, gathered with its public API (its optimizer-state
    twin, safe_get_full_optimizer_state, raises for params with no fragment on a rank at stage 1/2)."""
    from deepspeed.utils import safe_get_full_fp32_param

    ref = {name: safe_get_full_fp32_param(param) for name, param in engine.module.named_parameters() if param.requires_grad}
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone().cpu() for k, v in ref.items() if v is not None}, path)


def save_llama(out: str) -> None:
    """A tiny transformers Llama trained under DeepSpeed ZeRO-2, as a release script would find it."""
    from tiny_llama import config as tiny_config
    from transformers import LlamaForCausalLM

    config = tiny_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(os.path.join(out, "llama"))
    if dist.get_rank() == 0:
        config.save_pretrained(os.path.join(out, "llama_config"))


if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend="gloo")
    {"save": save, "resume": resume}[sys.argv[1]](*sys.argv[2:])
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
