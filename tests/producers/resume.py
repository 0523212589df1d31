"""One model, trained by real DeepSpeed ZeRO or by real FSDP2, to prove that a run resumes exactly
after ckpt moves it (same or other framework, same or other world size). Under torchrun, gloo, CPU.

    torchrun --nproc-per-node W resume.py TASK...

    ds:STAGE:CONFIG.json:OUT[:LOAD]   DeepSpeed ZeRO. Fresh: train steps 0-2, save OUT/at3, train 3-5.
                                      With LOAD: load_checkpoint(LOAD) (plain), save OUT/loaded at once,
                                      write the client dataloader state each rank got, train 3-5.
                                      Always: save OUT/final, OUT/losses.json (steps 3-5).
    fsdp:OUT[:LOAD]                   FSDP2 + AdamW, the same recipe. Fresh: train 0-2, dcp.save
                                      OUT/at3 (get_state_dict layout + lr_scheduler, step, dataloader,
                                      a per-rank dataloader position and RNG state), OUT/at3.pt, and
                                      OUT/at3-torchtitan (torchtitan's key layout), train
                                      3-5. With LOAD: dcp.load + set_state_dict, OUT/loaded.pt, each
                                      rank's dataloader and RNG state, train 3-5.
                                      Always: OUT/final.pt (full state), OUT/losses.json.

Every rank trains on the same batches at every world size, so runs at different world sizes take
the same steps up to the rounding of gradient averaging. The model has a tied weight, a frozen
parameter, a buffer, two param groups and a torch LR schedule that both frameworks save.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from net import Net
from torch import nn

STEPS, TOTAL = 3, 6
RNG_SEED = 1234


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    return model, opt


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(1000 + step))


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def write_json(path: str, value: object) -> None:
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(value, f)


# ---- DeepSpeed ---------------------------------------------------------------------------------


def deepspeed_task(stage: str, config_path: str, out: str, load: str | None = None) -> None:
    import deepspeed

    with open(config_path) as f:
        config = json.load(f)
    assert config["zero_optimization"]["stage"] == int(stage)
    model, opt = model_and_optimizer()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=schedule, config=config)
    if load:
        _, client = engine.load_checkpoint(load)
        assert engine.global_steps == STEPS, engine.global_steps
        with open(os.path.join(out, f"loaded-dataloader-rank{dist.get_rank()}.json"), "w") as f:
            json.dump(client.get("dataloader"), f)
        with open(os.path.join(out, f"loaded-seen-by-rank{dist.get_rank()}.json"), "w") as f:
            json.dump(client.get("seen_by_rank"), f)
        engine.save_checkpoint(os.path.join(out, "loaded"), client_state={"dataloader": client.get("dataloader")})
    losses = []
    for step in range(engine.global_steps, TOTAL):
        if step == STEPS and not load:
            client = {"dataloader": {"offset": STEPS * 2}, "seen_by_rank": dist.get_rank()}  # stage 3: each rank's own
            engine.save_checkpoint(os.path.join(out, "at3"), client_state=client)
        loss = loss_of(engine(batch(step)), batch(step))
        engine.backward(loss)
        engine.step()
        if step >= STEPS:
            losses.append(loss.item())
    engine.save_checkpoint(os.path.join(out, "final"), client_state={"dataloader": {"offset": TOTAL * 2}})
    write_json(os.path.join(out, "losses.json"), losses)


# ---- FSDP2 -------------------------------------------------------------------------------------


def fsdp_build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    from torch.distributed.fsdp import fully_shard

    model, _ = model_and_optimizer()
    fully_shard(model.block)
    fully_shard(model)  # embed and the tied head stay in one unit
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    return model, opt, schedule(opt)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """Unsharded weights and Adam state by FQN, param-group lrs (from rank 0 of the gather)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    full = lambda v: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()  # noqa: E731
    out: dict[str, object] = {f"model.{k}": full(v) for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            out[f"optim.{fqn}.{key}"] = full(value)
    out["lr"] = [g["lr"] for g in osd["param_groups"]]
    return out


def save_full(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    state = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(state, path)


def save_torchtitan_layout(model: nn.Module, opt: torch.optim.Optimizer, sched: object, path: str) -> None:
    """The same state as torchtitan's CheckpointManager saves it: model keys at the top level, the optimizer
    flattened per parameter (flatten_optimizer_state_dict=True) under "optimizer", step under "train_state"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    state = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state["lr_scheduler"] = sched.state_dict()  # type: ignore[attr-defined]
    state["train_state"] = {"step": STEPS}
    dcp.save(state, checkpoint_id=path)


def fsdp_task(out: str, load: str | None = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, sched = fsdp_build()
    rank = dist.get_rank()
    start = 0
    if load:
        msd, osd = get_state_dict(model, opt)
        saved = dcp.FileSystemReader(load).read_metadata().state_dict_metadata
        state: dict[str, object] = {"model": msd, "optim": osd, "lr_scheduler": sched.state_dict(), "step": -1}
        if "dataloader.offset" in saved:
            state["dataloader"] = {"offset": -1}
        if f"dataloader.dp_rank_{rank}.position" in saved:
            state.setdefault("dataloader", {})[f"dp_rank_{rank}"] = {"position": -1}  # type: ignore[index]
        if f"rng.rank_{rank}" in saved:
            state["rng"] = {f"rank_{rank}": torch.zeros_like(torch.get_rng_state())}
        dcp.load(state, checkpoint_id=load)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["lr_scheduler"])  # type: ignore[arg-type]
        start = int(state["step"])  # type: ignore[call-overload]
        assert start == STEPS, state["step"]
        with open(os.path.join(out, f"loaded-dataloader-rank{rank}.json"), "w") as f:
            json.dump(state.get("dataloader"), f)
        if "rng" in state:  # which rank's generator state this rank got
            got = state["rng"][f"rank_{rank}"]  # type: ignore[index]
            seeds = [k for k in range(8) if torch.equal(got, torch.Generator().manual_seed(RNG_SEED + k).get_state())]
            with open(os.path.join(out, f"loaded-rng-rank{rank}.json"), "w") as f:
                json.dump(seeds, f)
        save_full(os.path.join(out, "loaded.pt"), model, opt)
    losses = []
    for step in range(start, TOTAL):
        if step == STEPS and not load:
            msd, osd = get_state_dict(model, opt)
            state = {
                "model": msd,
                "optim": osd,
                "lr_scheduler": sched.state_dict(),
                "step": STEPS,
                "dataloader": {"offset": STEPS * 2, f"dp_rank_{rank}": {"position": 100 * rank + STEPS}},
                "rng": {f"rank_{rank}": torch.Generator().manual_seed(RNG_SEED + rank).get_state()},  # per-rank RNG
            }
            dcp.save(state, checkpoint_id=os.path.join(out, "at3"))
            save_torchtitan_layout(model, opt, sched, os.path.join(out, "at3-torchtitan"))
            save_full(os.path.join(out, "at3.pt"), model, opt)
        loss = loss_of(model(batch(step)), batch(step))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step >= STEPS:
            losses.append(loss.item())
    save_full(os.path.join(out, "final.pt"), model, opt)
    write_json(os.path.join(out, "losses.json"), losses)


if __name__ == "__main__":
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for task in sys.argv[1:]:
        kind, *args = task.split(":")
        os.makedirs(args[2] if kind == "ds" else args[0], exist_ok=True)
        if kind == "ds":
            deepspeed_task(*args)
        else:
            fsdp_task(*args)
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)
