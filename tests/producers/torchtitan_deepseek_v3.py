"""A torchtitan (0.3.0) DeepSeek-V3 run on the CPU, under torchrun (gloo), saved by torchtitan's own CheckpointManager.

    torchrun --nproc-per-node 2 torchtitan_deepseek_v3.py OUT

A tiny DeepSeek-V3 (dim 64, 3 layers: the first dense (FFN hidden dim 128), the other two MoE, as `n_dense_layers`
makes them; multi-head latent attention over 4 heads with q_lora_rank 0 (a plain `wq`, as the debug model and 16B
have it), kv_lora_rank 32, qk_nope_head_dim 16, qk_rope_head_dim 8, v_head_dim 16; the debug model's YaRN rope
(theta 10000, factor 40, beta_fast 32, beta_slow 1, original_seq_len 4096) and mscale 0.7, which torchtitan folds
twice into the softmax scale only, the rope itself a pure rotation of adjacent (interleaved) pairs by ComplexRoPE;
RMSNorm eps 1e-5 everywhere, kv_norm included; vocab 128, untied output, no MTP layers; 4 routed experts of hidden
dim 32, top-2, no expert groups, and 1 shared expert of hidden dim 32) is built with torchtitan's own
`_build_dsv3_layers` as `deepseekv3_configs["debugmodel"]` is made, at a tiny size, except for the router: the debug
model's softmax scores are ones Hugging Face's DeepseekV3 cannot reproduce (its router is sigmoid only), so this one
scores as the 671B flavour does: sigmoid, the top-2 renormalized (`route_norm`) and scaled by route_scale 2.5. It is
parallelized by `parallelize_deepseekv3`, initialized with a seed per rank and trained 2 steps by torchtitan_run.py
(FSDP2 `fully_shard` over both ranks, float32 parameters, no expert parallelism: the experts' [E, ...] parameters are
sharded on E; torchtitan's AdamW container, LR scheduler, cross-entropy loss, gradient clipping) with the MoE
load-balancing hook the deepseek_v3 ModelSpec registers after the optimizer
(`register_moe_load_balancing_hook`: aux-loss-free, it moves each MoE layer's `expert_bias_E` by load_balance_coeff
per step, here 1e-2, ten times torchtitan's default, so that 2 steps grow a bias that reroutes some eval tokens (2
of 16 in layer 1; dropping it moves the logits by ~8e-3); the bias only picks experts, the gate values stay the
sigmoid's; pass --no-load-balance as a second argument for load_balance_coeff=None: no bias buffer, no hook).
Written (the layout: torchtitan_run.py):

    OUT/step-2              the DCP checkpoint an interval save writes (CheckpointManager.save(2)): the model's
                            keys at the top level (`layers.N.attention.wq|wkv_a|wkv_b|wo.weight`,
                            `layers.N.attention.kv_norm.weight`, `layers.N.attention_norm|ffn_norm.weight`; the dense
                            layer's `layers.0.feed_forward.w1|w2|w3.weight`; in the MoE layers experts as
                            `layers.N.moe.routed_experts.inner_experts.w1_EFD|w3_EFD` [E, F, D] and `w2_EDF` [E, D, F],
                            router `layers.N.moe.router.gate.weight` [E, D], the shared expert
                            `layers.N.moe.shared_experts.w1|w2|w3.weight`, the persistent buffer
                            `layers.N.moe.expert_bias_E` [E] unless --no-load-balance), the optimizer's state,
                            `lr_scheduler`, the dataloader's per-rank state and `train_state`
    OUT/hf_export           the last-step export with `last_save_in_hf` (CheckpointManager.save(2, last_step=True)):
                            DeepSeekV3StateDictAdapter.to_hf names (`model.layers.N.self_attn.q_proj|kv_a_proj_with_mqa|
                            kv_b_proj|o_proj.weight`, `self_attn.kv_a_layernorm.weight`, dense
                            `model.layers.0.mlp.gate_proj|up_proj|down_proj.weight`), every expert split out
                            (`model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj.weight`), router
                            `model.layers.N.mlp.gate.weight`, `model.layers.N.mlp.shared_experts.*`, and
                            `expert_bias_E` kept as Hugging Face's `model.layers.N.mlp.gate.e_score_correction_bias`
                            (absent with --no-load-balance, as the buffer is; transformers then fills zeros, the
                            same routing); no config.json
    OUT/reference.pt        (rank 0) every model tensor of the state dict in torchtitan names, full and float32
    OUT/logits.pt           (rank 0) {"ids", "logits"}: the trained model's eval logits for ids 1..16, as torchtitan
                            computes them: its GroupedExperts cast inputs and weights to bfloat16 whatever the
                            parameter dtype
    OUT/logits_fp32.pt      (rank 0) the same, with GroupedExperts.forward's grouped GEMMs run in float32 (its
                            bfloat16 casts removed, nothing else changed): what a float32 release must reproduce
    OUT/model_args.json     the sizes, rope and routing settings a Hugging Face DeepseekV3Config needs

transformers' DeepseekV3ForCausalLM (float32) reproduces logits_fp32.pt to ~5e-7 with q_lora_rank None (for 0),
rope_interleave True, rope_parameters {"rope_type": "yarn", "rope_theta", "factor", "original_max_position_embeddings",
"beta_fast", "beta_slow", "truncate": True, and "mscale" and "mscale_all_dim" both torchtitan's mscale: then the
cos/sin attention_factor is 1 and the softmax scale takes mscale_all_dim twice}, n_group 1 and topk_group 1 (no
groups), norm_topk_prob True, routed_scaling_factor 2.5, num_mtp_layers 0, but only once its kv_a_layernorm's eps
(1e-6, fixed in its code, not read from the config) is set to torchtitan's 1e-5 (`kv_norm_eps`); left as loaded,
the logits differ by ~3e-5.

CPU shims: those of torchtitan_run.py (device mesh on "cpu", SDPA attention instead of FlexAttention, the triton
stub, SUM reduction for gloo, the "partial_dtensor" spmd backend). MLA needs nothing more: its q/k head dim (24)
differs from v's (16), which SDPA's math backend takes, with torchtitan's softmax_scale passed as `scale`. The experts
need none: with EP=1 the token dispatcher only reorders locally, and GroupedExperts' `torch._grouped_mm` (bfloat16)
has a CPU kernel in torch 2.13 (forward and backward; it wants 16-byte aligned strides, which D=64 and F=32 give). The
load-balancing hook all-reduces the token counts over the loss mesh with gloo.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan_qwen3_moe import moe_pieces
from torchtitan_run import VOCAB, run, start

if TYPE_CHECKING:
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

DIM, N_LAYERS, N_DENSE_LAYERS, N_HEADS, MAX_SEQ_LEN = 64, 3, 1, 4, 32
Q_LORA_RANK, KV_LORA_RANK, QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, V_HEAD_DIM = 0, 32, 16, 8, 16
DENSE_HIDDEN_DIM, MOE_HIDDEN_DIM, NUM_EXPERTS, NUM_SHARED_EXPERTS, TOP_K = 128, 32, 4, 1, 2
ROUTE_SCALE = 2.5
# 10x torchtitan's 1e-3: after 2 steps a 1e-3 bias (<= 2e-3) is below every eval token's score margin and reroutes none.
LOAD_BALANCE_COEFF = 1e-2


def model_config(load_balance: bool = True) -> DeepSeekV3Model.Config:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import _EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers, _output_linear_init
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    # As deepseekv3_configs["debugmodel"] is made (untied output, no MTP layers, no expert groups, its yarn rope and
    # mscale), at a tiny size, with the 671B flavour's sigmoid, renormalized and scaled routing.
    config = DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_dsv3_layers(
            n_layers=N_LAYERS,
            n_dense_layers=N_DENSE_LAYERS,
            dim=DIM,
            n_heads=N_HEADS,
            q_lora_rank=Q_LORA_RANK,
            kv_lora_rank=KV_LORA_RANK,
            qk_nope_head_dim=QK_NOPE_HEAD_DIM,
            qk_rope_head_dim=QK_ROPE_HEAD_DIM,
            v_head_dim=V_HEAD_DIM,
            mscale=0.70,
            dense_hidden_dim=DENSE_HIDDEN_DIM,
            moe_hidden_dim=MOE_HIDDEN_DIM,
            num_experts=NUM_EXPERTS,
            num_shared_experts=NUM_SHARED_EXPERTS,
            router_top_k=TOP_K,
            router_score_func="sigmoid",
            router_num_expert_groups=None,
            router_num_limited_groups=None,
            router_route_scale=ROUTE_SCALE,
            router_route_norm=True,
            attn_backend="flex",
            moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(
                dim=QK_ROPE_HEAD_DIM,
                max_seq_len=MAX_SEQ_LEN,
                theta=10000.0,
                scaling="yarn",
                rope_factor=40.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_seq_len=4096,
            ),
        ),
        mtp_layers=[],
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layer.moe is not None:
            layer.moe.load_balance_coeff = LOAD_BALANCE_COEFF if load_balance else None
    return config


def model_args(config: DeepSeekV3Model.Config) -> dict:
    attention = config.layers[0].attention
    rope = attention.rope
    moe_layers = [i for i, block in enumerate(config.layers) if block.moe is not None]
    moe = config.layers[moe_layers[0]].moe
    router, experts = moe.router, moe.routed_experts.inner_experts
    return {
        "dim": config.dim,
        "n_layers": len(config.layers),
        "n_dense_layers": moe_layers[0],  # first_k_dense_replace
        "n_heads": attention.n_heads,
        "q_lora_rank": attention.q_lora_rank,  # 0: a plain wq (Hugging Face: q_lora_rank None, q_proj)
        "kv_lora_rank": attention.kv_lora_rank,
        "qk_nope_head_dim": attention.qk_nope_head_dim,
        "qk_rope_head_dim": attention.qk_rope_head_dim,
        "v_head_dim": attention.v_head_dim,
        "vocab_size": config.vocab_size,
        "max_seq_len": rope.max_seq_len,
        "rope_format": "complex",  # ComplexRoPE: adjacent (interleaved) pairs (Hugging Face: rope_interleave True)
        "rope_theta": rope.theta,
        "rope_scaling": rope.scaling,
        "rope_factor": rope.rope_factor,
        "beta_fast": rope.beta_fast,
        "beta_slow": rope.beta_slow,
        "original_seq_len": rope.original_seq_len,
        "rope_truncate": rope.truncate,
        "mscale": attention.mscale,  # folded twice into the softmax scale; the rope itself is not scaled
        "norm_eps": config.norm.eps,
        "kv_norm_eps": attention.kv_norm.eps,
        "tie_word_embeddings": config.enable_weight_tying,
        "moe_layers": moe_layers,
        "dense_hidden_dim": config.layers[0].feed_forward.w1.out_features,
        "moe_hidden_dim": experts.hidden_dim,
        "num_experts": moe.num_experts,
        "num_shared_experts": moe.shared_experts.w1.out_features // experts.hidden_dim,
        "top_k": router.top_k,
        "score_func": router.score_func,
        "num_expert_groups": router.num_expert_groups,
        "num_limited_groups": router.num_limited_groups,
        "route_norm": router.route_norm,
        "route_scale": router.route_scale,
        "load_balance_coeff": moe.load_balance_coeff,
        "num_mtp_layers": len(config.mtp_layers),
    }


def main(out: Path, load_balance: bool = True) -> None:
    start()
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    run(
        out,
        model_config(load_balance),
        set_sharding=set_deepseek_v3_sharding_config,
        parallelize=parallelize_deepseekv3,
        sd_adapter=DeepSeekV3StateDictAdapter,
        model_args=model_args,
        **moe_pieces(),
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), load_balance="--no-load-balance" not in sys.argv[2:])
