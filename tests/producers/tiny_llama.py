"""The tiny transformers Llama both training producers train (untied embeddings, sizes that shard unevenly)."""

from __future__ import annotations

from typing import Any


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
