"""Megatron-Core `torch_dist` checkpoints saved by Megatron's own `dist_checkpointing.save`, on the CPU (gloo).

    torchrun --nproc-per-node 2 megatron_save.py OUT

Megatron's GPTModel (local layer spec: RMSNorm, SwiGLU, rotary, grouped-query attention with 4 heads in 2 groups,
no biases, untied output layer) is built with tensor parallel size 2, and its `sharded_state_dict()` saved:

    OUT/stacked     float32; layers stacked under one key each (`decoder.layers.*`, layer = dim 0), as Megatron
                    saves homogeneous layers; Adam state by Megatron's FP32Optimizer.sharded_state_dict, an
                    `rng_state` ShardedObject per tensor-parallel rank, and in common.pt the iteration, the
                    checkpoint version and the run's args (argparse.Namespace), as Megatron-LM saves them
    OUT/per_layer   bfloat16; one key per layer (`decoder.layers.0.*`: metadata non_homogeneous_layers)
    OUT/qwen        float32, Qwen2-style: the stacked model with biases on linear_qkv (add_qkv_bias)
    OUT/moe         float32, Mixtral-style: every MLP an MoE layer of 4 SequentialMLP experts (SwiGLU, 48 wide),
                    top-2 softmax router, the allgather token dispatcher; experts stacked under
                    `decoder.layers.mlp.experts.experts.*` [layer, expert, ...]

OUT/reference.pt (rank 0): for each, what Megatron's own `load_plain_tensors` returns (every tensor at its full
global shape) and the model's logits for fixed token ids (vocab-parallel logits gathered), to check an exported
Hugging Face model against.

Megatron's torch_dist save path calls two CUDA functions that have no CPU meaning: `torch.cuda.synchronize()`
after staging tensors to host memory and `torch.cuda.current_device()` as the device of a one-element failure
flag it broadcasts. On a CPU-only torch both raise, so they are replaced here by a no-op and "cpu"; everything
written is Megatron's. Megatron's MoE layers also make a `torch.cuda.Stream` (for overlapped shared experts, unused
here: a None stands in), and its router's gating GEMM tests a Transformer Engine function that is left undefined
when Transformer Engine is not installed: it is set to None, so the router takes its own torch.mm path. The
forward pass forks Megatron's CUDA RNG tracker around attention dropout (identity in eval mode); the fork is a
no-op here.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

TP = 2
SEQ = 16
IDS = (torch.arange(SEQ) * 7 % 128).reshape(1, SEQ)


def cpu_shims() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = lambda *a, **k: None
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.te_general_gemm = None  # unset without Transformer Engine (the module's own fallback tests for None)


MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "moe_token_dispatcher_type": "allgather"}


def build(dtype: torch.dtype, moe: bool = False, qkv_bias: bool = False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        **(MOE if moe else {}),
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        tensor_model_parallel_size=TP,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm", **({"num_experts": 4, "moe_grouped_gemm": False} if moe else {})),
        vocab_size=128,
        max_sequence_length=32,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    # Random values everywhere (norm weights around 1); a tensor-parallel shard differs per rank, a replicated
    # parameter (the norms) is the same on every rank, as training keeps it.
    rank = dist.get_rank()
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(100 * i + (rank if getattr(p, "tensor_model_parallel", False) else 0))
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.ndim == 1 else 0.0))
    return model


def logits(model) -> torch.Tensor:
    """Eval forward of fixed ids; the vocab-parallel logits of both ranks joined."""
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model.eval()
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]  # Megatron's default mask is made on cuda
    with torch.no_grad():
        local = model(IDS, torch.arange(SEQ).reshape(1, SEQ), attention_mask=mask).float()
    parts = [torch.empty_like(local) for _ in range(TP)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)


def adam_state(model) -> dict:
    """One Adam step, then Megatron's FP32Optimizer.sharded_state_dict (its __init__ puts a scale tensor on cuda)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    for i, p in enumerate(model.parameters()):
        g = torch.Generator().manual_seed(7 + 100 * i + (rank if getattr(p, "tensor_model_parallel", False) else 0))
        p.grad = torch.randn(p.shape, generator=g)
    adam.step()
    opt = FP32Optimizer.__new__(FP32Optimizer)
    opt.optimizer, opt.config, opt.init_state_fn, opt.is_stub_optimizer = adam, OptimizerConfig(), None, False
    return opt.sharded_state_dict(model.sharded_state_dict())


def run_args() -> argparse.Namespace:
    """What Megatron-LM keeps under `args` in common.pt (a few of its fields, enums and dtypes included)."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=16,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        padded_vocab_size=128,
        tensor_model_parallel_size=TP,
        params_dtype=torch.float32,
        attention_backend=AttnBackend.auto,
        train_iters=100,
    )


def rng_state(rank: int):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}
    return ShardedObject("rng_state", [state], (1, TP), (0, rank), replica_id=0)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    cpu_shims()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = dist.get_rank()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    reference = {}
    for name, dtype in (("stacked", torch.float32), ("per_layer", torch.bfloat16), ("qwen", torch.float32), ("moe", torch.float32)):
        model = build(dtype, moe=name == "moe", qkv_bias=name == "qwen")
        if name == "stacked":
            optimizer = adam_state(model)
            state = {"model": model.sharded_state_dict(), "optimizer": optimizer, "iteration": 7, "checkpoint_version": 3.0}
            state |= {"args": run_args(), "rng_state": rng_state(rank)}
        elif name == "per_layer":
            state = {"model": model.sharded_state_dict(metadata={"non_homogeneous_layers": True})}
        else:
            state = {"model": model.sharded_state_dict()}
        folder = out / name
        if rank == 0:
            folder.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(state, str(folder))
        full = dist_checkpointing.load_plain_tensors(str(folder))
        reference[name] = {"plain": full, "logits": logits(model), "ids": IDS}
        if name == "stacked":  # each rank's rng_state ShardedObject, as Megatron's load returns it
            request = {"rng_state": rng_state(rank)}
            request["rng_state"].data = None
            loaded = [None] * TP
            dist.all_gather_object(loaded, dist_checkpointing.load(request, str(folder))["rng_state"])
            reference[name]["rng_state"] = loaded
    if rank == 0:
        torch.save(reference, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # Megatron's writer starts a multiprocessing Manager (spawn): the module is imported again
    main(Path(sys.argv[1]))
