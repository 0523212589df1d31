"""A byte-level BPE `tokenizer.json` as GGUF metadata, as the converter's `_set_vocab_gpt2` writes it: the vocabulary with
each added token's type, the merges, and the pre-tokenizer's name. llama.cpp names the pre-tokenizer by the sha256 of
the ids the tokenizer gives for a fixed text (`get_vocab_base_pre`), and refuses a hash its table lacks; ckpt computes
the same hash with Hugging Face's `tokenizers` (the library behind transformers' fast tokenizers, which the converter
loads) and looks it up in a copy of that table (pre_hashes.py). A tokenizer the table lacks is refused, as by the
converter, unless `register` names it (a test's tokenizer trained on the spot).
"""

from __future__ import annotations

import json
from hashlib import sha256
from typing import Any

from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.gguf.constants import ValueType
from ckpt_cli.formats.gguf.encode import KV
from ckpt_cli.formats.gguf.pre_hashes import CHECK_TEXT, PRE_BY_HASH
from ckpt_cli.formats.gguf.vocab import CONTROL, NORMAL, UNUSED, USER_DEFINED, Files, SpecialVocab, file_bytes, looks_special

TOKENIZERS_INSTALL = "pip install 'ckpt-tools[gguf]'"
REGISTERED: dict[str, str] = {}  # hash -> pre-tokenizer name, beside the converter's table (see `register`)


def register(check_hash: str, name: str) -> None:
    """Name the pre-tokenizer of a tokenizer llama.cpp's table lacks (the converter takes the same entry patched into
    its get_vocab_base_pre): what convert_hf_to_gguf_update.py does for a released model."""
    REGISTERED[check_hash] = name


def _tokenizer(data: bytes) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise UsageError(
            f"a BPE tokenizer.json is read with Hugging Face's tokenizers, which is not installed: {TOKENIZERS_INSTALL}"
        ) from exc
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the library's own error type is not exported
        raise DataError(f"tokenizer.json: not a tokenizer the tokenizers library loads ({exc})") from exc


def check_hash(tokenizer: Any) -> str:
    """sha256 of str(ids) of CHECK_TEXT, special tokens added as the tokenizer adds them (the converter's chkhsh)."""
    return sha256(str(tokenizer.encode(CHECK_TEXT).ids).encode()).hexdigest()


def pre_tokenizer(tokenizer: Any) -> str:
    found = check_hash(tokenizer)
    name = REGISTERED.get(found) or PRE_BY_HASH.get(found)
    if name is None:
        raise UsageError(
            f"tokenizer.json: its BPE pre-tokenizer is not in llama.cpp's table (check hash {found}); llama.cpp's "
            "converter refuses it too until convert_hf_to_gguf_update.py lists the model"
        )
    return name


def bpe_vocab(data: bytes, vocab_size: int | None) -> tuple[list[str], list[int], str]:
    """get_vocab_base: every id below the config's vocab_size, [PADi] UNUSED where the tokenizer has none; an added
    token is CONTROL when special (or looking special), else USER_DEFINED with U+2581 made a space; one that is not
    normalized is first encoded and decoded, as the converter does through transformers."""
    tokenizer = _tokenizer(data)
    spec = json.loads(data.decode("utf-8"))
    if (spec.get("model") or {}).get("type") != "BPE":
        raise UsageError(f"tokenizer.json: a {(spec.get('model') or {}).get('type')} model; ckpt writes BPE tokenizers to GGUF")
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = vocab_size or len(vocab)
    if max(vocab.values()) >= size:
        raise DataError(f"tokenizer.json: token id {max(vocab.values())} is past config.json's vocab_size {size}")
    pre = pre_tokenizer(tokenizer)
    reverse = {i: t for t, i in vocab.items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    added_content = {a["content"] for a in added.values()}
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        token = reverse[i]
        if token in added_content and i in added:
            if not added[i].get("normalized", True):
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            if added[i].get("special") or looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    return tokens, types, pre


def bpe_kvs(files: Files, config: dict[str, Any]) -> list[KV]:
    data = file_bytes(files, "tokenizer.json")
    assert data is not None, "asked for a release with tokenizer.json"
    tokens, types, pre = bpe_vocab(data, config.get("vocab_size"))
    kvs = [
        KV("tokenizer.ggml.model", ValueType.STRING, "gpt2"),
        KV("tokenizer.ggml.pre", ValueType.STRING, pre),
        KV("tokenizer.ggml.tokens", ValueType.ARRAY, tokens, ValueType.STRING),
        KV("tokenizer.ggml.token_type", ValueType.ARRAY, types, ValueType.INT32),
    ]
    return kvs + SpecialVocab(files, None, load_merges=True).kvs()
