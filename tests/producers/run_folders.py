"""Run folders as the frameworks write them: transformers Trainer, accelerate and Lightning, each through its
own save path, on the CPU (gloo, DS_ACCELERATOR=cpu). A tiny Llama (tiny_llama.py), 4 steps, a save every 2 steps.

Runs (NAME): trainer-ds2, trainer-ds3, trainer-fsdp2, accelerate-fsdp2, accelerate-fsdp1-local,
accelerate-fsdp1-nodcp, accelerate-ds, lightning-ds2, lightning-ds3, lightning-fsdp (under torchrun, 2 processes, all
in one launch), and trainer-plain, lightning-plain (one plain process, no torchrun). accelerate-fsdp1-local (FSDP1,
LOCAL_STATE_DICT) and accelerate-fsdp1-nodcp (FSDP1, SHARDED_STATE_DICT without DCP) write per-rank .bin files of the
model (and, nodcp, of the optimizer) of ShardedTensors, which no tool here consolidates and accelerate's own
load_state cannot read back (its torch.load(weights_only=True) refuses ShardedTensor): they are saved, never resumed.

    torchrun --nproc-per-node 2 run_folders.py save BASE NAME...     (plain runs: python run_folders.py save ...)
        Writes each run root as the framework leaves it under BASE/runs/NAME, and (rank 0) what the run held
        at each save under BASE/saved/NAME/step-N.pt (see write_state).
    torchrun --nproc-per-node W run_folders.py resume NAME:CHECKPOINT:OUT...      (plain runs: python ...)
        Resumes NAME from CHECKPOINT (one checkpoint folder) with the framework's own resume path at world
        size W (Trainer resume_from_checkpoint, accelerate load_state, Lightning fit(ckpt_path=...)); writes what
        it loaded to OUT/loaded.pt (write_state's layout); OUT/run is the resumed run's own scratch root.
    python run_folders.py consolidate NAME:CHECKPOINT:OUT...
        The framework's own consolidation of CHECKPOINT into OUT/raw (zero_to_fp32.py shipped in the
        checkpoint, `accelerate merge-weights`, Lightning's convert_zero_checkpoint_to_fp32_state_dict and
        consolidate_checkpoint); the weights it wrote, as they are named there, in OUT/reference.safetensors.

Where a framework refuses the CPU in its own checks, the smallest override gets past the check and nothing
else; every save and load goes through the framework's own code:
  - accelerate (and Trainer, which runs on it) selects DeepSpeed or FSDP only for accelerator process
    groups: PartialState is configured here (backend gloo; distributed_type MULTI_GPU for FSDP, since
    AcceleratorState only turns an fsdp_plugin on for GPU-like types), and Trainer is told to use it
    (accelerator_config use_configured_state). With Trainer's own CPU path (use_cpu) neither DeepSpeed nor
    FSDP is ever engaged, and its DeepSpeed path without a backend runs every rank as a world of 1.
  - not a CPU matter: accelerate's per-rank torch.save of FSDP's sharded state dicts (use_dcp=False) is an
    argument of save_fsdp_model/save_fsdp_optimizer (and their load twins) that save_state and load_state never
    pass; accelerate_use_dcp rebinds the names they call (accelerate-fsdp1-nodcp).
  - Lightning's DeepSpeedStrategy refuses non-CUDA accelerators and device index None (CPUDeepSpeedStrategy);
    its FSDPStrategy is refused for accelerator="cpu" by an exact type check, and FSDP1 needs device_id=cpu
    to run on the CPU (CPUFSDPStrategy).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tiny_llama import config as tiny_config

STEPS, SAVE_EVERY, LR = 4, 2, 1e-2


class Tokens(torch.utils.data.Dataset):
    """64 sequences of 8 token ids, the same for every run; labels are the inputs (causal LM loss)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config())


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def engine_kind(name: str) -> str:
    """How the run holds its weights: 'deepspeed' (ZeRO partitions), 'fsdp' (FSDP1 or FSDP2) or 'plain'."""
    return "deepspeed" if "-ds" in name else "fsdp" if "fsdp" in name else "plain"


# ---- what a run holds, full (unsharded), by parameter name ------------------------------------------


def full_state(kind: str, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Full fp32 weights and AdamW moments by parameter name, and the param groups' lr; a collective."""
    while type(optimizer).__module__.startswith("accelerate."):  # AcceleratedOptimizer wraps the real one
        optimizer = optimizer.optimizer
    gather = {"deepspeed": deepspeed_full_state, "fsdp": fsdp_full_state, "plain": plain_full_state}[kind]
    weights, moments = gather(model, optimizer)
    return {"weights": weights, "optimizer": moments, "lr": [group["lr"] for group in optimizer.param_groups]}


def deepspeed_full_state(model: torch.nn.Module, optimizer: Any) -> tuple[dict, dict]:
    """ZeRO-1/2/3 fp32 master weights and moments, gathered with DeepSpeed's public API."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        # ZeRO-1/2 link each parameter to its slice of the optimizer state once, after the first step; a
        # param group whose state did not exist yet then stays unlinked ("exp_avg not found in optimizer
        # state fragment", seen for Trainer's no-decay group). Link again, from the state as it is now.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    weights, moments = {}, {}
    for name, param in model.named_parameters():
        weights[name] = safe_get_full_fp32_param(param).detach().clone().cpu()
        moments[name] = {key: safe_get_full_optimizer_state(param, key).detach().clone().cpu() for key in ("exp_avg", "exp_avg_sq")}
    return weights, moments


def fsdp_full_state(model: torch.nn.Module, optimizer: Any) -> tuple[dict, dict]:
    """FSDP1 or FSDP2: torch's full (unsharded) state dicts, by FQN."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    full = lambda v: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().cpu()  # noqa: E731
    return {name: full(v) for name, v in msd.items()}, {
        name: {k: full(v) for k, v in state.items()} for name, state in osd["state"].items()
    }


def plain_full_state(model: torch.nn.Module, optimizer: Any) -> tuple[dict, dict]:
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return weights, {name: {k: v.detach().clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}


def write_state(path: Path, kind: str, model: torch.nn.Module, optimizer: Any, step: int, scheduler: Any) -> None:
    """{weights: {name: fp32}, optimizer: {name: {exp_avg, exp_avg_sq[, step]}}, lr: [per group], step: the
    framework's global step, scheduler: the LR scheduler's state_dict(), world: the process count} with torch.save,
    on rank 0."""
    state = full_state(kind, model, optimizer)
    state["step"] = int(step)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["world"] = world()  # the processes it ran on
    if rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    if dist.is_initialized():
        dist.barrier()


# ---- transformers Trainer ------------------------------------------------------------------------


def configure_accelerate(kind: str) -> None:
    """A fresh accelerate PartialState on the gloo group for DeepSpeed or FSDP on the CPU (module docstring)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # else TrainingArguments/Accelerator turn DeepSpeed on
    if kind == "plain":
        return
    if kind == "deepspeed":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    if kind == "fsdp":
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def trainer_deepspeed_config(name: str) -> dict | None:
    """ZeRO-2 with the Trainer's own AdamW and LR schedule (scheduler.pt); ZeRO-3 with DeepSpeed's optimizer and
    WarmupLR from the config (the schedule then lives in DeepSpeed's model states, no scheduler.pt)."""
    if name == "trainer-ds2":
        return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}}
    if name == "trainer-ds3":
        return {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto", "torch_adam": True},
            },
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        }
    return None


def trainer_args(name: str, output_dir: Path) -> Any:
    from transformers import TrainingArguments

    plain = name == "trainer-plain"
    extra: dict[str, Any] = {"use_cpu": True} if plain else {"accelerator_config": {"use_configured_state": True}}
    if name == "trainer-fsdp2":
        extra["fsdp"] = True
        extra["fsdp_config"] = {
            "version": 2,
            "state_dict_type": "SHARDED_STATE_DICT",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        }
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        per_device_train_batch_size=2,
        learning_rate=LR,
        weight_decay=0.1,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=3,
        logging_steps=1,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        deepspeed=trainer_deepspeed_config(name),
        **extra,
    )


def trainer_callback(name: str, path_for_step: Any, on: str) -> Any:
    """A TrainerCallback writing write_state at `on` ('on_save' or 'on_train_begin'); .trainer is set after."""
    from transformers import TrainerCallback

    class DumpState(TrainerCallback):
        trainer: Any = None

        def dump(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            t = self.trainer
            write_state(path_for_step(state.global_step), engine_kind(name), t.model, t.optimizer, state.global_step, t.lr_scheduler)

    callback = DumpState()
    setattr(callback, on, callback.dump)
    return callback


def make_trainer(name: str, output_dir: Path, callback: Any) -> Any:
    from transformers import Trainer

    configure_accelerate(engine_kind(name))
    model = llama()
    trainer = Trainer(model=model, args=trainer_args(name, output_dir), train_dataset=Tokens(), callbacks=[callback])
    callback.trainer = trainer
    return trainer


def save_trainer(name: str, base: Path) -> None:
    saved = base / "saved" / name
    make_trainer(name, base / "runs" / name, trainer_callback(name, lambda step: saved / f"step-{step}.pt", "on_save")).train()


def resume_trainer(name: str, checkpoint: Path, out: Path) -> None:
    trainer = make_trainer(name, out / "run", trainer_callback(name, lambda step: out / "loaded.pt", "on_train_begin"))
    trainer.train(resume_from_checkpoint=str(checkpoint))


# ---- accelerate ----------------------------------------------------------------------------------


class TrainState:
    """The loop's own progress, saved by accelerate as custom_checkpoint_0.pkl (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def accelerate_use_dcp(use_dcp: bool) -> None:
    """save_state/load_state with accelerate's use_dcp (module docstring): False writes and reads per-rank .bin files."""
    import functools

    import accelerate.accelerator
    from accelerate.utils import fsdp_utils

    for function in ("save_fsdp_model", "save_fsdp_optimizer", "load_fsdp_model", "load_fsdp_optimizer"):
        setattr(accelerate.accelerator, function, functools.partial(getattr(fsdp_utils, function), use_dcp=use_dcp))


def accelerate_run(name: str, project_dir: Path) -> tuple[Any, ...]:
    """An Accelerator with the FSDP2 (sharded state dict), FSDP1 (local, or sharded without DCP) or DeepSpeed ZeRO-2
    plugin, the model, AdamW, a LinearLR schedule and the dataloader prepared, and a registered TrainState."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin, ProjectConfiguration

    configure_accelerate(engine_kind(name))
    accelerate_use_dcp(name != "accelerate-fsdp1-nodcp")
    if name == "accelerate-ds":
        plugin: dict[str, Any] = {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1)}
    else:
        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=1 if "fsdp1" in name else 2,
            state_dict_type="LOCAL_STATE_DICT" if name == "accelerate-fsdp1-local" else "SHARDED_STATE_DICT",
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            use_orig_params=True if "fsdp1" in name else None,  # FSDP1 flattens them: the optimizer is made first
        )
        plugin = {"fsdp_plugin": fsdp}
    project = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=project, **plugin)
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    return accelerator, model, optimizer, scheduler, loader, state


def accelerate_module(accelerator: Any, model: Any) -> torch.nn.Module:
    return model.module if accelerator.distributed_type.name == "DEEPSPEED" else model


def save_accelerate(name: str, base: Path) -> None:
    accelerator, model, optimizer, scheduler, loader, state = accelerate_run(name, base / "runs" / name)
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state.step += 1
        if state.step % SAVE_EVERY == 0:
            accelerator.save_state()  # BASE/runs/NAME/checkpoints/checkpoint_<i>
            path = base / "saved" / name / f"step-{state.step}.pt"
            write_state(path, engine_kind(name), accelerate_module(accelerator, model), optimizer, state.step, scheduler)
        if state.step == STEPS:
            break


def resume_accelerate(name: str, checkpoint: Path, out: Path) -> None:
    accelerator, model, optimizer, scheduler, _, state = accelerate_run(name, out / "run")
    accelerator.load_state(str(checkpoint))
    write_state(out / "loaded.pt", engine_kind(name), accelerate_module(accelerator, model), optimizer, state.step, scheduler)


# ---- Lightning -----------------------------------------------------------------------------------


def lightning_classes() -> tuple[Any, Any, Any]:
    """The LightningModule and the two CPU strategies (built lazily: importing lightning is slow)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    class LitLlama(pl.LightningModule):
        def __init__(self, lr: float = LR) -> None:
            super().__init__()
            self.save_hyperparameters()  # hparams.yaml in the log folder, "hyper_parameters" in each checkpoint
            self.model = llama()

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> dict[str, Any]:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(Tokens(), batch_size=2)

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """DeepSpeedStrategy without its CUDA-only checks: setup_environment refuses non-CUDA accelerators,
        setup_distributed checks device indices (None on the CPU), and deepspeed.initialize gets device_rank
        from root_device.index (None on the CPU: DeepSpeed compares it with 0). Saving and loading are untouched."""

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
            import argparse

            import deepspeed

            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            return engine, ds_optimizer

    class CPUFSDPStrategy(FSDPStrategy):
        """FSDPStrategy on the CPU: the accelerator connector refuses `type(strategy) is FSDPStrategy` with
        accelerator='cpu', and FSDP1 needs device_id=cpu (Lightning passes root_device.index, None on the
        CPU). The model is wrapped here the way Lightning wraps it; Lightning then keeps the wrapper."""

        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            wrapped = FullyShardedDataParallel(
                model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            return super()._setup_model(wrapped)

    strategies = {"lightning-ds2": lambda: CPUDeepSpeedStrategy(stage=2, process_group_backend="gloo")}
    strategies["lightning-ds3"] = lambda: CPUDeepSpeedStrategy(stage=3, process_group_backend="gloo")
    strategies["lightning-fsdp"] = lambda: CPUFSDPStrategy(state_dict_type="sharded", process_group_backend="gloo")
    strategies["lightning-plain"] = lambda: "auto"
    return LitLlama, strategies, pl


def lightning_callback(name: str, path_for_step: Any, on: str) -> Any:
    """A Callback writing write_state at on_train_batch_end every SAVE_EVERY steps (before ModelCheckpoint,
    which Lightning runs last; the LR scheduler steps after both) or at on_train_start (after the restore,
    then it stops the run)."""
    import lightning.pytorch as pl

    class DumpState(pl.Callback):
        def dump(self, trainer: Any) -> None:
            kind = engine_kind(name)
            model = trainer.strategy.model if kind == "fsdp" else trainer.lightning_module
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            write_state(path_for_step(trainer.global_step), kind, model, trainer.optimizers[0], trainer.global_step, scheduler)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if on == "save" and trainer.global_step % SAVE_EVERY == 0:
                self.dump(trainer)

        def on_train_start(self, trainer: Any, *args: Any) -> None:
            if on == "resume":
                self.dump(trainer)
                trainer.should_stop = True

    return DumpState()


def lightning_trainer(name: str, root: Path, callbacks: list, **kwargs: Any) -> Any:
    _, strategies, pl = lightning_classes()
    return pl.Trainer(
        accelerator="cpu",
        devices=world(),
        strategy=strategies[name](),
        default_root_dir=str(root),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **kwargs,
    )


def save_lightning(name: str, base: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    lit_llama, _, _ = lightning_classes()
    root, saved = base / "runs" / name, base / "saved" / name
    checkpoints = ModelCheckpoint(every_n_train_steps=SAVE_EVERY, save_top_k=-1, save_last=True)
    dump = lightning_callback(name, lambda step: saved / f"step-{step}.pt", "save")
    trainer = lightning_trainer(name, root, [checkpoints, dump], max_steps=STEPS, logger=CSVLogger(str(root)))
    trainer.fit(lit_llama())


def resume_lightning(name: str, checkpoint: Path, out: Path) -> None:
    lit_llama, _, _ = lightning_classes()
    dump = lightning_callback(name, lambda step: out / "loaded.pt", "resume")
    trainer = lightning_trainer(name, out / "run", [dump], max_steps=100, logger=False, enable_checkpointing=False)
    trainer.fit(lit_llama(), ckpt_path=str(checkpoint))


# ---- consolidation -------------------------------------------------------------------------------


def consolidate(name: str, checkpoint: Path, out: Path) -> None:
    """The framework's own consolidation into OUT/raw; its weights, as named there, in OUT/reference.safetensors."""
    from safetensors.torch import load_file, save_file

    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    if name in ("trainer-ds2", "trainer-ds3", "accelerate-ds"):
        run_main(checkpoint / "zero_to_fp32.py", checkpoint, raw, "--safe_serialization")
        weights = load_file(raw / "model.safetensors")
    elif name in ("trainer-fsdp2", "accelerate-fsdp2"):
        run_main("accelerate.commands.accelerate_cli", "merge-weights", checkpoint / "pytorch_model_fsdp_0", raw)
        weights = load_file(raw / "model.safetensors")
    elif name in ("lightning-ds2", "lightning-ds3"):
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(raw / "model.ckpt"))
        weights = torch.load(raw / "model.ckpt", weights_only=False)["state_dict"]
    elif name == "lightning-fsdp":
        run_main("lightning.pytorch.utilities.consolidate_checkpoint", checkpoint, "--output_file", raw / "model.ckpt")
        weights = torch.load(raw / "model.ckpt", weights_only=False)["state_dict"]
    elif name == "trainer-plain":  # nothing to consolidate: the checkpoint holds its weights whole
        weights = load_file(checkpoint / "model.safetensors")
    elif name == "lightning-plain":
        weights = torch.load(checkpoint, weights_only=False)["state_dict"]
    else:
        raise SystemExit(f"no consolidation for {name}")
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "reference.safetensors")


def run_main(target: str | Path, *argv: str | Path) -> None:
    """A command line tool as its own __main__ in this process (as `python SCRIPT ARGS` or `python -m MODULE ARGS`
    run it; one interpreter for all of them saves seconds of imports each): a script path or a module name."""
    import runpy

    saved_argv = sys.argv
    sys.argv = [str(target), *map(str, argv)]
    try:
        if isinstance(target, Path):
            runpy.run_path(str(target), run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code:
            raise SystemExit(f"{target} {' '.join(map(str, argv))} exited {exc.code}") from exc
    finally:
        sys.argv = saved_argv


# ---- entry -----------------------------------------------------------------------------------------

SAVE = {"trainer": save_trainer, "accelerate": save_accelerate, "lightning": save_lightning}
RESUME = {"trainer": resume_trainer, "accelerate": resume_accelerate, "lightning": resume_lightning}


def main(mode: str, *args: str) -> None:
    if mode == "save":
        base = Path(args[0])
        for name in args[1:]:
            SAVE[name.split("-")[0]](name, base)
    elif mode == "resume":
        for task in args:
            name, checkpoint, out = task.split(":")
            RESUME[name.split("-")[0]](name, Path(checkpoint), Path(out))
    elif mode == "consolidate":
        for task in args:
            name, checkpoint, out = task.split(":")
            consolidate(name, Path(checkpoint), Path(out))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:  # under torchrun: one gloo group (and DeepSpeed's comm) for every framework
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    main(*sys.argv[1:])
    if dist.is_initialized():
        dist.barrier()
        # Leave without tearing down gloo (see fsdp2.py): its threads occasionally abort at interpreter exit.
        sys.stdout.flush()
        os._exit(0)
