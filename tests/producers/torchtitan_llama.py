"""A torchtitan (0.3.0) Llama 3 run on the CPU, under torchrun (gloo), saved by torchtitan's own CheckpointManager.

    torchrun --nproc-per-node 2 torchtitan_llama.py OUT

A tiny Llama 3 (dim 64, 2 layers, 4 heads over 2 kv heads, vocab 128, llama3 rope scaling, theta 500000) is built
from torchtitan's own config helpers, parallelized by `parallelize_llama` (FSDP2 `fully_shard` over both ranks,
float32 parameters), and trained 2 steps on random tokens with torchtitan's AdamW container, LR scheduler,
cross-entropy loss and gradient clipping. Written:

    OUT/step-2              the DCP checkpoint an interval save writes (CheckpointManager.save(2)): the model's
                            keys at the top level (fused wqkv split into wq/wk/wv by torchtitan's state_dict hook),
                            `optimizer.state.<fqn>.exp_avg|exp_avg_sq|step` and `optimizer.param_groups.<fqn>.<key>`
                            (optimizer fqns name the fused `qkv_linear.wqkv.weight`), `lr_scheduler`, the
                            dataloader's per-rank pickled state (`dataloader.dp_rank_N`) and `train_state`
    OUT/hf_export           the last-step export with `last_save_in_hf` (CheckpointManager.save(2, last_step=True)):
                            the adapter's `to_hf` names and q/k permutation, written by DCP's HuggingFaceStorageWriter
                            (one consolidated safetensors file, its index, and the per-rank files under sharded/);
                            torchtitan writes no config.json
    OUT/reference.pt        (rank 0) every model tensor of the state dict in torchtitan names, full and float32
    OUT/logits.pt           (rank 0) {"ids", "logits"}: the trained model's eval logits for ids 1..16
    OUT/model_args.json     the sizes a Hugging Face LlamaConfig needs

CPU shims (torchtitan assumes an accelerator): the device mesh is built on "cpu" instead of "cuda"; attention is
torchtitan's own ScaledDotProductAttention (causal; what its graph_trainer tests use) instead of FlexAttention,
which has no backward on the CPU (attention has no weights: the saved layout is the same); and where triton is not
installed, the MoE expert-parallel triton kernels module that torchtitan imports unconditionally is replaced by a
stub (a dense Llama never calls it); torchtitan sets FSDP's gradient divide factor to 1.0 (it divides by the
global token count itself), which FSDP reduces with PREMUL_SUM, absent from gloo, so FSDP is told to SUM and divide
by that factor instead (the same numbers). The default `spmd_backend="spmd_types"` needs a newer torch's fully_shard
(torch 2.13's wants DTensor parameters with dp_mesh_dims), so the run uses "partial_dtensor" (plain FSDP2).
"""

from __future__ import annotations

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
    from torchtitan.models.llama3.model import Llama3Model

DIM, N_LAYERS, N_HEADS, N_KV_HEADS, VOCAB, MULTIPLE_OF, MAX_SEQ_LEN = 64, 2, 4, 2, 128, 16, 32
ROPE_THETA = 500000.0
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


def model_config() -> Llama3Model.Config:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, ScaledDotProductAttention, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.model import Llama3Model

    # As llama3_configs["8B"] is made (untied output, fused qkv), at a tiny size.
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=N_LAYERS,
            dim=DIM,
            n_heads=N_HEADS,
            n_kv_heads=N_KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=MULTIPLE_OF),
            rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=MAX_SEQ_LEN, theta=ROPE_THETA, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def model_args(config: Llama3Model.Config) -> dict:
    attention = config.layers[0].attention
    rope = attention.rope
    return {
        "dim": config.dim,
        "n_layers": len(config.layers),
        "n_heads": attention.n_heads,
        "n_kv_heads": attention.n_kv_heads,
        "head_dim": attention.head_dim or config.dim // attention.n_heads,
        "hidden_dim": config.layers[0].feed_forward.w1.out_features,
        "vocab_size": config.vocab_size,
        "max_seq_len": rope.max_seq_len,
        "rope_theta": rope.theta,
        "rope_scaling": {
            "type": rope.scaling,
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        },
        "norm_eps": config.norm.eps,
        "tie_word_embeddings": config.enable_weight_tying,
        "world_size": dist.get_world_size(),
        "steps": STEPS,
    }


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    cpu_shims()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    rank = dist.get_rank()
    training = TrainingConfig(seq_len=SEQ, local_batch_size=BATCH, steps=STEPS, mixed_precision_param="float32")
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    dist_utils.set_determinism(parallel_dims, torch.device("cpu"), DebugConfig(seed=0), distinct_seed_mesh_dims=["pp"])

    config = model_config()
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)  # what update_from_config does
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(
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
    # DTensor has no offset-based RNG on the CPU: each rank draws its shard from its own generator, so under the one
    # seed set_determinism gives every rank, both halves of each dim-0 sharded tensor would be equal (twin heads,
    # twin experts): a seed per rank makes every row its own.
    torch.manual_seed(rank)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    optimizers = default_adamw(lr=1e-2, implementation="foreach").build(model_parts=[model])
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
            sd_adapter=Llama3StateDictAdapter(config, None),
        )

    manager(folder=str(out)).save(STEPS)
    manager(folder=str(out / "hf"), last_save_model_only=True, last_save_in_hf=True, export_dtype="float32").save(STEPS, last_step=True)

    reference = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    model.eval()
    positions = torch.arange(SEQ).reshape(1, SEQ)
    with torch.no_grad():
        logits = model(IDS, positions=positions)
    dist.barrier()
    if rank == 0:
        shutil.move(out / "hf" / f"step-{STEPS}", out / "hf_export")
        (out / "hf").rmdir()
        torch.save(reference, out / "reference.pt")
        torch.save({"ids": IDS, "logits": full(logits).float()}, out / "logits.pt")
        (out / "model_args.json").write_text(json.dumps(model_args(config), indent=2) + "\n")
    dist.barrier()
    # Leave without tearing down gloo (see fsdp2.py).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
