"""Real FSDP2 (fully_shard) + torch.distributed.checkpoint runs on the CPU, under torchrun (gloo).

    torchrun --nproc-per-node W fsdp2.py save OUT [llama]   train 3 steps, dcp.save, write references
                                                            (llama: also a tiny transformers Llama)
    torchrun --nproc-per-node M fsdp2.py check TASK...      each TASK is load:CKPT:REF (model + AdamW
                                                            with set_state_dict, one more step) or
                                                            finetune:CKPT:WEIGHTS.safetensors (model only)

The model's parameter sizes do not divide by 2, 3 or 4; the state holds AdamW moments, an int step,
a dataloader dict and an RNG state. References are full (unsharded) tensors gathered on rank 0.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(12, 29), nn.LayerNorm(29), nn.Linear(29, 12)) for _ in range(2)])
        self.head = nn.Linear(12, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).mean(dim=1)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank and world size
    return torch.randint(0, 37, (4, 6), generator=g), torch.randn(4, 5, generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    ids, target = batch(step)
    loss = nn.functional.mse_loss(model(ids), target)
    loss.backward()
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Unsharded params and Adam state, keyed like get_state_dict."""
    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v.full_tensor().clone() for k, v in msd.items()}  # at W=1 full_tensor() aliases the param
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            out[f"optim.state.{fqn}.{key}"] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
    out["lr"] = [g["lr"] for g in osd["param_groups"]]
    return out


def save_llama(out: str) -> None:
    """A tiny transformers Llama trained under FSDP2, saved the way a training script saves it."""
    from tiny_llama import config as tiny_config
    from transformers import LlamaForCausalLM

    config = tiny_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=os.path.join(out, "llama"))
    if dist.get_rank() == 0:
        config.save_pretrained(os.path.join(out, "llama_config"))


def save(out: str, *extra: str) -> None:
    model, opt = build()
    for step in range(STEPS):
        train_step(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    torch.manual_seed(1234)
    state = {"model": msd, "optim": osd, "step": STEPS, "dataloader": {"epoch": 0, "offset": STEPS * 4}, "rng": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=os.path.join(out, "ckpt"))
    before = full_state(model, opt)
    train_step(model, opt, STEPS)
    after = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save({"before": before, "after": after}, os.path.join(out, "reference.pt"))
    if "llama" in extra:
        save_llama(out)


def check(*tasks: str) -> None:
    for task in tasks:
        kind, ckpt, reference = task.split(":")
        {"load": load, "finetune": finetune}[kind](ckpt, reference)


def finetune(ckpt: str, weights: str) -> None:
    """Start from released weights: load only the model from a DCP checkpoint into FSDP2."""
    from safetensors.torch import load_file

    model, _ = build()
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    want = load_file(weights)
    for name, param in get_model_state_dict(model).items():
        if not torch.equal(param.full_tensor(), want[name]):
            raise SystemExit(f"rank {dist.get_rank()}: {name} differs from {weights}")
    if dist.get_rank() == 0:
        print("FINETUNE-OK")


def load(ckpt: str, reference: str) -> None:
    model, opt = build()
    msd, osd = get_state_dict(model, opt)
    state = {
        "model": msd,
        "optim": osd,
        "step": -1,
        "dataloader": {"epoch": -1, "offset": -1},
        "rng": torch.zeros_like(torch.get_rng_state()),
    }
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ref = torch.load(reference, weights_only=True)
    problems = []
    now = full_state(model, opt)
    for key, want in ref["before"].items():
        got = now[key]
        same = got == want if key == "lr" else (got.dtype == want.dtype and torch.equal(got, want))
        if not same:
            problems.append(f"{key} differs after load")
    if state["step"] != STEPS or state["dataloader"] != {"epoch": 0, "offset": STEPS * 4}:
        problems.append(f"step/dataloader wrong: {state['step']} {state['dataloader']}")
    torch.manual_seed(1234)
    if not torch.equal(state["rng"], torch.get_rng_state()):
        problems.append("rng state differs")
    train_step(model, opt, STEPS)
    after = full_state(model, opt)
    for key, want in ref["after"].items():
        if key == "lr":
            continue
        # Gradient averaging sums in another order at another world size: equal to float32 rounding.
        if not torch.allclose(after[key], want, rtol=1e-5, atol=1e-6):
            problems.append(f"{key} differs after one more step (max {float((after[key] - want).abs().max()):.3g})")
    if problems:
        raise SystemExit(f"rank {dist.get_rank()}: " + "; ".join(problems))
    if dist.get_rank() == 0:
        print("LOAD-OK")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    {"save": save, "check": check}[sys.argv[1]](*sys.argv[2:])
    dist.barrier()
    # Leave without tearing down gloo: its threads occasionally abort at interpreter exit on a
    # loaded 2-core machine ("terminate called without an active exception") after all work is done.
    sys.stdout.flush()
    os._exit(0)
