"""A torchtitan (0.3.0) Llama 3 run on the CPU, under torchrun (gloo), saved by torchtitan's own CheckpointManager.

    torchrun --nproc-per-node 2 torchtitan_llama.py OUT

A tiny Llama 3 (dim 64, 2 layers, 4 heads over 2 kv heads, vocab 128, llama3 rope scaling, theta 500000) is built
from torchtitan's own config helpers, parallelized by `parallelize_llama` and trained 2 steps by torchtitan_run.py
(FSDP2 over both ranks, float32 parameters, torchtitan's AdamW container, LR scheduler, cross-entropy loss and
gradient clipping). Written (the layout: torchtitan_run.py):

    OUT/step-2              the DCP checkpoint an interval save writes (CheckpointManager.save(2)): the model's
                            keys at the top level (fused wqkv split into wq/wk/wv by torchtitan's state_dict hook),
                            the optimizer's state (its fqns name the fused `qkv_linear.wqkv.weight`), `lr_scheduler`,
                            the dataloader's per-rank state and `train_state`
    OUT/hf_export           the last-step export with `last_save_in_hf` (CheckpointManager.save(2, last_step=True)):
                            Llama3StateDictAdapter's `to_hf` names and q/k permutation; no config.json
    OUT/reference.pt        (rank 0) every model tensor of the state dict in torchtitan names, full and float32
    OUT/logits.pt           (rank 0) {"ids", "logits"}: the trained model's eval logits for ids 1..16
    OUT/model_args.json     the sizes a Hugging Face LlamaConfig needs

CPU shims: those of torchtitan_run.py (device mesh on "cpu", SDPA attention instead of FlexAttention, the triton
stub, SUM reduction for gloo, the "partial_dtensor" spmd backend); a dense Llama needs nothing more.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan_run import VOCAB, run, start

if TYPE_CHECKING:
    from torchtitan.models.llama3.model import Llama3Model

DIM, N_LAYERS, N_HEADS, N_KV_HEADS, MULTIPLE_OF, MAX_SEQ_LEN = 64, 2, 4, 2, 16, 32
ROPE_THETA = 500000.0


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
    }


def set_sharding(config: Llama3Model.Config, *, enable_sp: bool, enable_ep: bool) -> None:
    """set_llama3_sharding_config, which has no enable_ep (a dense model)."""
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    set_llama3_sharding_config(config, enable_sp=enable_sp)


def main(out: Path) -> None:
    start()
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    run(
        out,
        model_config(),
        set_sharding=set_sharding,
        parallelize=parallelize_llama,
        sd_adapter=Llama3StateDictAdapter,
        model_args=model_args,
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
