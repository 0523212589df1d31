"""Tiny Hugging Face releases for the GGUF writer's tests: a model from transformers (`save_pretrained`) and a
tokenizer trained on the spot (sentencepiece's `tokenizer.model`, or a `tokenizers` BPE `tokenizer.json`), as the
real releases that llama.cpp's converter reads carry them. Run as a script: `python gguf_models.py ARCH DIR`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Text the tokenizers are trained on: enough distinct words for a few hundred pieces.
CORPUS = [
    f"the {a} {b} jumps over {c} lazy dog number {i}, while {b} cats sleep; {a}-{c}!"
    for i, (a, b, c) in enumerate(
        (x, y, z)
        for x in ("quick", "slow", "red", "green", "tiny", "huge", "bright")
        for y in ("fox", "owl", "bear", "wolf", "hare")
        for z in ("very", "rather", "quite", "too")
    )
]
SPM_VOCAB = 300
SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def train_spm(folder: Path, vocab_size: int = SPM_VOCAB) -> None:
    """A Llama-style SentencePiece model (BPE with byte fallback, <unk> <s> </s>) saved as folder/tokenizer.model, with
    the tokenizer_config.json that transformers' LlamaTokenizer writes for it."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    (folder / "tokenizer.vocab").unlink()
    from transformers import LlamaTokenizer

    LlamaTokenizer(vocab_file=str(folder / "tokenizer.model"), legacy=False).save_pretrained(folder)


def llama(folder: Path, **overrides: Any) -> None:
    """A tiny LlamaForCausalLM (untied head) with a SentencePiece tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    train_spm(folder)
    config = LlamaConfig(vocab_size=SPM_VOCAB, max_position_embeddings=128, tie_word_embeddings=False, **{**SIZES, **overrides})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


BUILDERS = {"llama": llama}


if __name__ == "__main__":
    BUILDERS[sys.argv[1]](Path(sys.argv[2]))
    print(json.dumps(sorted(p.name for p in Path(sys.argv[2]).iterdir())))
