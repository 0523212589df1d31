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
# intermediate 80: rows of ffn_down are not whole 32-blocks, so the quantized files hold the F16 fallback too
SIZES = {"hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def train_spm(folder: Path, vocab_size: int = SPM_VOCAB, byte_fallback: bool = True) -> None:
    """A Llama-style SentencePiece model (BPE with byte fallback, <unk> <s> </s>) saved as folder/tokenizer.model, with
    the tokenizer_config.json that transformers' LlamaTokenizer writes for it."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=byte_fallback,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    (folder / "tokenizer.vocab").unlink()
    # tokenizer_config.json as a Llama 2 release has it (transformers 5 would also write a tokenizer.json)
    special = {i: t for i, t in enumerate(("<unk>", "<s>", "</s>"))}
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): {"content": t, **flags} for i, t in special.items()},
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "legacy": False,
        "tokenizer_class": "LlamaTokenizer",
        "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def llama(folder: Path, **overrides: Any) -> None:
    """A tiny LlamaForCausalLM (untied head) with a SentencePiece tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    train_spm(folder)
    config = LlamaConfig(vocab_size=SPM_VOCAB, max_position_embeddings=128, tie_word_embeddings=False, **{**SIZES, **overrides})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


# Qwen2's pre-tokenizer split (its tokenizer.json), then bytes to printable characters
QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_bpe(folder: Path, vocab_size: int) -> None:
    """A Qwen2-style byte-level BPE tokenizer.json trained on the spot with Hugging Face's tokenizers, with the
    tokenizer_config.json a Qwen2 release has (no BOS, <|im_end|> ends a turn, <|endoftext|> pads)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=list(QWEN_SPECIAL)
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    ids = {t: tokenizer.token_to_id(t) for t in QWEN_SPECIAL}
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": t, **flags} for t, i in ids.items()},
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _save(folder: Path, model_class: str, config_class: str, **kwargs: Any) -> None:
    import torch
    import transformers

    config = getattr(transformers, config_class)(max_position_embeddings=128, **kwargs)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(folder)


def mistral(folder: Path) -> None:
    """A tiny MistralForCausalLM with a SentencePiece tokenizer (as Mistral 7B v0.1 to v0.3 ship)."""
    train_spm(folder)
    _save(folder, "MistralForCausalLM", "MistralConfig", vocab_size=SPM_VOCAB, tie_word_embeddings=False, sliding_window=None, **SIZES)


def mixtral(folder: Path) -> None:
    """A tiny MixtralForCausalLM (4 experts, 2 a token) with a SentencePiece tokenizer."""
    train_spm(folder)
    _save(
        folder,
        "MixtralForCausalLM",
        "MixtralConfig",
        vocab_size=SPM_VOCAB,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        **SIZES,
    )


QWEN_VOCAB = 400


def qwen2(folder: Path) -> None:
    train_bpe(folder, 380)
    _save(folder, "Qwen2ForCausalLM", "Qwen2Config", vocab_size=QWEN_VOCAB, tie_word_embeddings=False, **SIZES)


def qwen3(folder: Path) -> None:
    train_bpe(folder, 380)
    _save(folder, "Qwen3ForCausalLM", "Qwen3Config", vocab_size=QWEN_VOCAB, tie_word_embeddings=True, head_dim=16, **SIZES)


def qwen2_moe(folder: Path) -> None:
    """A tiny Qwen2MoeForCausalLM: 4 routed experts (2 a token) and a gated shared expert."""
    train_bpe(folder, 380)
    _save(
        folder,
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        decoder_sparse_step=1,
        **SIZES,
    )


BUILDERS = {"llama": llama, "mistral": mistral, "mixtral": mixtral, "qwen2": qwen2, "qwen3": qwen3, "qwen2_moe": qwen2_moe}


if __name__ == "__main__":
    BUILDERS[sys.argv[1]](Path(sys.argv[2]))
    print(json.dumps(sorted(p.name for p in Path(sys.argv[2]).iterdir())))
