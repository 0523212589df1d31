"""A torchtitan (0.3.0) Qwen3 MoE run on the CPU, under torchrun (gloo), saved by torchtitan's own CheckpointManager.

    torchrun --nproc-per-node 2 torchtitan_qwen3_moe.py OUT

A tiny Qwen3 MoE (dim 64, 2 layers, both MoE as torchtitan's `_build_qwen3_moe_layers` makes every layer; 4 heads
over 2 kv heads, head_dim 16, q/k RMSNorm, vocab 128, theta 1000000, untied output; 4 routed experts of hidden dim
32, top-2, softmax scores renormalized over the top 2 (`route_norm`), route_scale 1, no shared experts) is built from
torchtitan's own config helpers exactly as `qwen3_configs["debugmodel_moe"]` is made, parallelized by
`parallelize_qwen3` and trained 2 steps by torchtitan_run.py (FSDP2 `fully_shard` over both ranks, float32
parameters, no expert parallelism: the experts' [E, ...] parameters are sharded on E; torchtitan's AdamW container, LR
scheduler, cross-entropy loss, gradient clipping) with the MoE load-balancing hook the qwen3 ModelSpec registers after
the optimizer (`register_moe_load_balancing_hook`: aux-loss-free, it moves each layer's `expert_bias_E` by
load_balance_coeff 1e-3 per step; the bias only picks experts, the gate values stay the softmax's; pass
--no-load-balance as a second argument for load_balance_coeff=None: no bias buffer, no hook). Written (the layout:
torchtitan_run.py):

    OUT/step-2              the DCP checkpoint an interval save writes (CheckpointManager.save(2)): the model's
                            keys at the top level (fused wqkv split into qkv_linear.wq/wk/wv by torchtitan's hook;
                            experts as `layers.N.moe.routed_experts.inner_experts.w1_EFD|w3_EFD` [E, F, D] and
                            `w2_EDF` [E, D, F], router `layers.N.moe.router.gate.weight` [E, D], the persistent
                            buffer `layers.N.moe.expert_bias_E` [E] unless --no-load-balance), the optimizer's
                            state, `lr_scheduler`, the dataloader's per-rank state and `train_state`
    OUT/hf_export           the last-step export with `last_save_in_hf` (CheckpointManager.save(2, last_step=True)):
                            Qwen3StateDictAdapter.to_hf names, every expert split out
                            (`model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj.weight`, router
                            `model.layers.N.mlp.gate.weight`; `expert_bias_E` is dropped, as Hugging Face's
                            Qwen3-MoE router has no bias: where it is non-zero, the release routes some tokens to
                            other experts than torchtitan does); no config.json
    OUT/reference.pt        (rank 0) every model tensor of the state dict in torchtitan names, full and float32
    OUT/logits.pt           (rank 0) {"ids", "logits"}: the trained model's eval logits for ids 1..16, as torchtitan
                            computes them: its GroupedExperts cast inputs and weights to bfloat16 whatever the
                            parameter dtype, so a float32 Hugging Face run differs by ~5e-4 (logits ~0.9)
    OUT/logits_fp32.pt      (rank 0) the same, with GroupedExperts.forward's grouped GEMMs run in float32 (its
                            bfloat16 casts removed, nothing else changed): what a float32 release must reproduce
                            to ~1e-6
    OUT/model_args.json     the sizes and routing settings a Hugging Face Qwen3MoeConfig needs

CPU shims: those of torchtitan_run.py (device mesh on "cpu", SDPA attention instead of FlexAttention, the triton
stub, SUM reduction for gloo, the "partial_dtensor" spmd backend). The experts need none: with EP=1 the token
dispatcher only reorders locally, and GroupedExperts' `torch._grouped_mm` (bfloat16) has a CPU kernel in torch 2.13
(forward and backward; it wants 16-byte aligned strides, which D=64 and F=32 give). The load-balancing hook
all-reduces the token counts over the loss mesh with gloo.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan_run import VOCAB, run, start

if TYPE_CHECKING:
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.qwen3.model import Qwen3Model

DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, MAX_SEQ_LEN = 64, 2, 4, 2, 16, 32
NUM_EXPERTS, TOP_K, MOE_HIDDEN_DIM = 4, 2, 32
ROPE_THETA = 1000000.0


def model_config(load_balance: bool = True) -> Qwen3Model.Config:
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, ScaledDotProductAttention
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    # As qwen3_configs["debugmodel_moe"] / ["30B-A3B"] are made (untied output, fused qkv), at a tiny size.
    config = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=N_LAYERS,
            dim=DIM,
            n_heads=N_HEADS,
            n_kv_heads=N_KV_HEADS,
            head_dim=HEAD_DIM,
            moe_hidden_dim=MOE_HIDDEN_DIM,
            num_experts=NUM_EXPERTS,
            top_k=TOP_K,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=MAX_SEQ_LEN, theta=ROPE_THETA),
            moe_comm_backend="standard",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if not load_balance:
            layer.moe.load_balance_coeff = None
    return config


def grouped_experts_float32(self: GroupedExperts, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """GroupedExperts.forward without its bfloat16 casts: the same grouped GEMMs, in the parameters' float32."""
    w1_EFD, w2_EDF, w3_EFD = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h_RF = F.silu(torch._grouped_mm(x_RD, w1_EFD.transpose(-2, -1), offs=offsets_E))
    h_RF = h_RF * torch._grouped_mm(x_RD, w3_EFD.transpose(-2, -1), offs=offsets_E)
    return torch._grouped_mm(h_RF, w2_EDF.transpose(-2, -1), offs=offsets_E)


def model_args(config: Qwen3Model.Config) -> dict:
    layer = config.layers[0]
    attention, moe = layer.attention, layer.moe
    router, experts = moe.router, moe.routed_experts.inner_experts
    return {
        "dim": config.dim,
        "n_layers": len(config.layers),
        "n_heads": attention.n_heads,
        "n_kv_heads": attention.n_kv_heads,
        "head_dim": attention.head_dim,
        "vocab_size": config.vocab_size,
        "max_seq_len": attention.rope.max_seq_len,
        "rope_theta": attention.rope.theta,
        "norm_eps": config.norm.eps,
        "qk_norm_eps": attention.qk_norm.eps,
        "tie_word_embeddings": config.enable_weight_tying,
        "moe_layers": [i for i, block in enumerate(config.layers) if block.moe is not None],
        "dense_hidden_dim": None,  # no dense FFN layer (Qwen3MoeConfig.mlp_only_layers = [])
        "moe_hidden_dim": experts.hidden_dim,
        "num_experts": moe.num_experts,
        "top_k": router.top_k,
        "score_func": router.score_func,
        "route_norm": router.route_norm,
        "route_scale": router.route_scale,
        "num_shared_experts": 0 if moe.shared_experts is None else 1,
        "load_balance_coeff": moe.load_balance_coeff,
    }


def moe_pieces() -> dict[str, Any]:
    """What both MoE producers add to run's arguments: the load-balancing hook their ModelSpecs register as
    post_optimizer_build_fn, and logits_fp32.pt, the eval run again with GroupedExperts.forward in float32."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.models.common.moe import GroupedExperts

    return {
        "post_optimizer_build": register_moe_load_balancing_hook,
        "extra_logits": {"logits_fp32.pt": mock.patch.object(GroupedExperts, "forward", grouped_experts_float32)},
    }


def main(out: Path, load_balance: bool = True) -> None:
    start()
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter, parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    run(
        out,
        model_config(load_balance),
        set_sharding=set_qwen3_sharding_config,
        parallelize=parallelize_qwen3,
        sd_adapter=Qwen3StateDictAdapter,
        model_args=model_args,
        **moe_pieces(),
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), load_balance="--no-load-balance" not in sys.argv[2:])
