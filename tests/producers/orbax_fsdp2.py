"""FSDP2 loads a DCP checkpoint that ckpt made from an Orbax train state (tests/test_orbax_write.py), under torchrun (gloo):

    torchrun --nproc-per-node N orbax_fsdp2.py load CKPT REF     REF: Orbax's own restore of the source
                                                               (tests/producers/orbax_restore.py --how adamw)
    torchrun --nproc-per-node N orbax_fsdp2.py save OUT         a run's DCP: the same model after two AdamW steps

The torch model holds the parameters of tests/producers/orbax_train_state.py under the same names and shapes (JAX
kernels as they are: a toy model of plain parameters, not Linear layers), the embedding in bfloat16 as its own FSDP2
group; torch.optim.AdamW. `load`: dcp.load + set_state_dict, then every weight, exp_avg (= mu), exp_avg_sq (= nu) and
step (= count) is compared bit for bit with Orbax's arrays, the step with the save's step, then one more step runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

SHAPES = {
    "embed.embedding": ((64, 32), torch.bfloat16),
    "decoder.layers_0.attn.wq": ((32, 32), torch.float32),
    "decoder.layers_0.attn.wo": ((32, 32), torch.float32),
    "decoder.layers_0.mlp.wi": ((32, 128), torch.float32),
    "decoder.layers_0.mlp.wo": ((128, 32), torch.float32),
    "decoder.layers_0.norm.scale": ((32,), torch.float32),
    "decoder.final_norm.scale": ((32,), torch.float32),
    "head.kernel": ((32, 96), torch.float32),
    "head.bias": ((96,), torch.float32),
}


class Node(nn.Module):
    pass


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    root = Node()
    for name, (shape, dtype) in SHAPES.items():
        *mods, leaf = name.split(".")
        module = root
        for part in mods:
            if not hasattr(module, part):
                module.add_module(part, Node())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.randn(shape).to(dtype)))
    fully_shard(root.embed)  # FSDP2 gathers one dtype per group
    fully_shard(root)
    return root, torch.optim.AdamW(root.parameters(), lr=1e-3)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every weight and Adam state, gathered whole, by the Orbax name it should equal."""
    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        out[f"params.{name}"] = full(param.data)
    for param, st in opt.state.items():
        name = names[id(param)]
        out[f"opt_state.0.mu.{name}"] = full(st["exp_avg"])
        out[f"opt_state.0.nu.{name}"] = full(st["exp_avg_sq"])
        out[f"step:{name}"] = full(st["step"])
    return out


def load(ckpt: str, ref: str) -> None:
    model, opt = build()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": -1}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = state_of(model, opt)
    index = json.loads((Path(ref) / "index.json").read_text())
    want = {n: np.load(Path(ref) / f"{n}.npy") for n in index}
    problems = []
    count = int(want["opt_state.0.count"])
    for name, tensor in got.items():
        if name.startswith("step:"):
            if tensor.dtype != torch.float32 or float(tensor) != count:
                problems.append(f"{name} is {tensor.dtype} {float(tensor)}, Orbax's count is {count}")
            continue
        if name not in want:
            problems.append(f"{name}: not in Orbax's restore")
        elif not np.array_equal(as_bytes(tensor), want[name].reshape(-1).view(np.uint8)):
            problems.append(f"{name} differs from Orbax's array")
    arrays = {n for n in want if n.startswith(("params.", "opt_state.0.mu.", "opt_state.0.nu."))}
    if arrays != {n for n in got if not n.startswith("step:")}:
        problems.append(f"loaded {len(got)} tensors, not Orbax's {len(arrays)} weights and moments")
    if state["step"] != int(want["step"]):
        problems.append(f"step {state['step']}, Orbax's is {int(want['step'])}")
    for param in model.parameters():  # one more step trains from there
        param.grad = torch.full_like(param, 0.01)
    opt.step()
    if problems:
        raise SystemExit(f"rank {dist.get_rank()}: " + "; ".join(problems[:5]))
    if dist.get_rank() == 0:
        print(f"ORBAX-LOAD-OK {len(got)}")


def save(out: str) -> None:
    """A run's own DCP: two AdamW steps with constant gradients, get_state_dict layout, step 2."""
    model, opt = build()
    for _ in range(2):
        for param in model.parameters():
            param.grad = torch.full_like(param, 0.01)
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=out)
    got = state_of(model, opt)
    if dist.get_rank() == 0:
        Path(out + "_ref").mkdir(parents=True, exist_ok=True)
        torch.save({k: v.clone() for k, v in got.items()}, out + "_ref/state.pt")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    {"load": load, "save": save}[sys.argv[1]](*sys.argv[2:])
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
