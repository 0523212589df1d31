"""The torchtitan (0.3.0) run the torchtitan_*.py producers share: on the CPU, under torchrun (gloo), saved by
torchtitan's own CheckpointManager.

    def main(out: Path) -> None:
        start()  # the process group and the CPU shims, before anything imports torchtitan
        from torchtitan.models.llama3 import parallelize_llama
        ...
        run(out, model_config(), set_sharding=..., parallelize=parallelize_llama, sd_adapter=..., model_args=model_args)

Each producer builds its tiny model's config with torchtitan's own config helpers and hands it to `run` with its
model's pieces. `run` builds the mesh (no parallelism but data parallel: FSDP over every rank), sets torchtitan's
determinism (seed 0), sets the config's sharding as update_from_config does, builds the model on the meta device,
parallelizes it with the model's parallelize function (FSDP2 `fully_shard` over every rank, float32 parameters, no
expert parallelism), initializes it with a seed per rank (below), and trains it 2 steps on random tokens (2 sequences
of 16 per rank) with torchtitan's AdamW container (lr 1e-2), LR scheduler (1 warmup step), cross-entropy loss and
gradient clipping, as Trainer.train_step does without gradient accumulation or pipelining; `post_optimizer_build`, where
given, is what the model's ModelSpec registers after the optimizer is built (the MoE load-balancing hook). Written:

    OUT/step-2              the DCP checkpoint an interval save writes (CheckpointManager.save(2)): the model's
                            keys at the top level (as the model's state_dict hooks name them),
                            `optimizer.state.<fqn>.exp_avg|exp_avg_sq|step` and `optimizer.param_groups.<fqn>.<key>`,
                            `lr_scheduler`, the dataloader's per-rank pickled state (`dataloader.dp_rank_N`) and
                            `train_state`
    OUT/hf_export           the last-step export with `last_save_in_hf` (CheckpointManager.save(2, last_step=True),
                            export_dtype float32): the state-dict adapter's `to_hf` names and layout, written by DCP's
                            HuggingFaceStorageWriter (one consolidated safetensors file, its index, and the per-rank
                            files under sharded/); torchtitan writes no config.json
    OUT/reference.pt        (rank 0) every model tensor of the state dict in torchtitan names, full and float32
    OUT/logits.pt           (rank 0) {"ids", "logits"}: the trained model's eval logits for ids 1..16
    OUT/<extra>.pt          (rank 0) the same for each `extra_logits` entry: the model run again inside its context
    OUT/model_args.json     the producer's model_args(config), then the world size and the step count

CPU shims (torchtitan assumes an accelerator): the device mesh is built on "cpu" instead of "cuda"; attention is
torchtitan's own ScaledDotProductAttention (causal; what its graph_trainer tests use) instead of FlexAttention,
which has no backward on the CPU (each producer's model_config swaps it in; attention has no weights: the saved
layout is the same); and where triton is not installed, the MoE expert-parallel triton kernels module that torchtitan
imports unconditionally is replaced by a stub (no run here calls it: expert parallelism is off); torchtitan sets
FSDP's gradient divide factor to 1.0 (it divides by the global token count itself), which FSDP reduces with
PREMUL_SUM, absent from gloo, so FSDP is told to SUM and divide by that factor instead (the same numbers). The default
`spmd_backend="spmd_types"` needs a newer torch's fully_shard (torch 2.13's wants DTensor parameters with
dp_mesh_dims), so the run uses "partial_dtensor" (plain FSDP2).

A seed per rank: DTensor has no offset-based RNG on the CPU, so each rank draws its shard from its own generator;
under the one seed set_determinism gives every rank, both halves of each dim-0 sharded tensor would be equal (twin
heads; in the MoE models experts 2, 3 copies of experts 0, 1, and the router's rows likewise, so that every token
would pick a pair of twins with equal gates). `torch.manual_seed(rank)` before init_weights makes every row its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset

if TYPE_CHECKING:
    from torchtitan.components.checkpoint import CheckpointManager

VOCAB = 128
SEQ, BATCH, STEPS = 16, 2, 2
IDS = torch.arange(1, SEQ + 1).reshape(1, SEQ)


def cpu_shims() -> None:
    if importlib.util.find_spec("triton") is None:
        name = "torchtitan.distributed.minimal_async_ep.kernels"

        def missing(attr: str) -> Callable[..., NoReturn]:
            if attr.startswith("__"):
                raise AttributeError(attr)

            def kernel(*args: object, **kwargs: object) -> NoReturn:
                raise RuntimeError(f"{name}.{attr} needs triton")

            return kernel

        stub = types.ModuleType(name)
        stub.__getattr__ = missing  # type: ignore[method-assign]
        sys.modules[name] = stub
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"


def start() -> None:
    """The gloo process group and the CPU shims: before anything imports torchtitan."""
    dist.init_process_group("gloo")
    cpu_shims()


class RandomTokens(IterableDataset, Stateful):
    """Random token documents of SEQ + 1 tokens, yielded as torchtitan's text datasets yield them."""

    def __init__(self, rank: int) -> None:
        self.rank, self.sample_idx = rank, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(1000 * (self.rank + 1) + self.sample_idx)
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            self.sample_idx += 1
            yield {"input": tokens[:-1], "positions": torch.arange(SEQ)}, tokens[1:]

    def state_dict(self) -> dict:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict) -> None:
        self.sample_idx = state_dict["sample_idx"]


class TrainState(Stateful):
    """What the Trainer itself saves under "train_state"."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def run(
    out: Path,
    config: Any,
    *,
    set_sharding: Callable[..., None],
    parallelize: Callable[..., torch.nn.Module],
    sd_adapter: type,
    model_args: Callable[[Any], dict],
    post_optimizer_build: Callable[..., None] | None = None,
    extra_logits: dict[str, contextlib.AbstractContextManager] | None = None,
) -> None:
    """Train `config`'s model 2 steps and write OUT (the module docstring); never returns (leaves with os._exit).

    set_sharding(config, enable_sp=..., enable_ep=...) is the model's set_<model>_sharding_config, parallelize its
    parallelize function, sd_adapter its state-dict adapter class, model_args(config) the sizes for model_args.json;
    post_optimizer_build(optimizers, model_parts, parallel_dims) is what its ModelSpec has as post_optimizer_build_fn;
    extra_logits maps a file name to a context the eval model is run again inside."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    rank = dist.get_rank()
    training = TrainingConfig(seq_len=SEQ, local_batch_size=BATCH, steps=STEPS, mixed_precision_param="float32")
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    dist_utils.set_determinism(parallel_dims, torch.device("cpu"), DebugConfig(seed=0), distinct_seed_mesh_dims=["pp"])

    # What the model's Config.update_from_config does (no SP, EP off).
    set_sharding(config, enable_sp=parallelism.enable_sequence_parallel, enable_ep=parallel_dims.ep_enabled)
    with torch.device("meta"):
        model = config.build()
    model = parallelize(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=str(out),
    )
    for module in model.modules():  # gloo has no PREMUL_SUM: sum, then divide by torchtitan's factor (1.0)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(rank)  # a seed per rank (the module docstring): no twin rows in dim-0 sharded tensors
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    optimizers = default_adamw(lr=1e-2, implementation="foreach").build(model_parts=[model])
    if post_optimizer_build is not None:
        post_optimizer_build(optimizers, [model], parallel_dims)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=STEPS)
    loss_fn = CrossEntropyLoss.Config().build()
    batch_mesh = parallel_dims.get_mesh("batch")
    dp_rank = batch_mesh.get_local_rank()
    dataloader = ParallelAwareDataloader(RandomTokens(dp_rank), dp_rank, batch_mesh.size(), batch_size=BATCH)
    train_state = TrainState()
    data = iter(dataloader)
    for _ in range(STEPS):  # Trainer.train_step, without gradient accumulation or pipelining
        train_state.step += 1
        optimizers.zero_grad()
        input_dict, labels = next(data)
        global_valid_tokens = dist_utils.dist_sum_tensor((labels != IGNORE_INDEX).sum(), batch_mesh)
        train_state.ntokens_seen += labels.numel()
        positions = input_dict["positions"]
        pred = model(input_dict["input"], positions=positions)
        loss, _ = loss_fn(pred, labels, global_valid_tokens)
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), training.max_norm, foreach=True)
        optimizers.step()
        lr_schedulers.step()

    def manager(**kwargs: Any) -> CheckpointManager:
        return CheckpointManager.Config(enable=True, interval=STEPS, keep_latest_k=0, **kwargs).build(
            dataloader=dataloader,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states={"train_state": train_state},
            sd_adapter=sd_adapter(config, None),
        )

    manager(folder=str(out)).save(STEPS)
    manager(folder=str(out / "hf"), last_save_model_only=True, last_save_in_hf=True, export_dtype="float32").save(STEPS, last_step=True)

    reference = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    model.eval()
    positions = torch.arange(SEQ).reshape(1, SEQ)
    logits = {}
    with torch.no_grad():
        logits["logits.pt"] = model(IDS, positions=positions)
        for name, context in (extra_logits or {}).items():
            with context:
                logits[name] = model(IDS, positions=positions)
    dist.barrier()
    if rank == 0:
        shutil.move(out / "hf" / f"step-{STEPS}", out / "hf_export")
        (out / "hf").rmdir()
        torch.save(reference, out / "reference.pt")
        for name, value in logits.items():
            torch.save({"ids": IDS, "logits": full(value).float()}, out / name)
        args = {**model_args(config), "world_size": dist.get_world_size(), "steps": STEPS}
        (out / "model_args.json").write_text(json.dumps(args, indent=2) + "\n")
    dist.barrier()
    # Leave without tearing down gloo (see fsdp2.py).
    sys.stdout.flush()
    os._exit(0)
