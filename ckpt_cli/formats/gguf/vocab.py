"""A release's tokenizer as GGUF metadata (`tokenizer.ggml.*`), as llama.cpp's converter writes it: the vocabulary of a
SentencePiece `tokenizer.model` (conversion/base.py `_create_vocab_sentencepiece`) or of a BPE `tokenizer.json`
(formats/gguf/bpe.py), then the special tokens, add-BOS/EOS flags and chat template that gguf-py's `SpecialVocab` finds
in tokenizer.json, tokenizer_config.json and config.json (gguf/vocab.py, ported here rule for rule). The files are
companions of the checkpoint (a release's own, or --hf-config's); nothing here imports sentencepiece or tokenizers.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from ckpt_cli.core.paths import read_regular_bytes
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.gguf.constants import ValueType
from ckpt_cli.formats.gguf.encode import KV

MAX_BYTES = 256 << 20
# llama.cpp's token types (gguf TokenType / SentencePieceTokenTypes)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")

Files = dict[str, "str | bytes"]


def file_bytes(files: Files, name: str) -> bytes | None:
    source = files.get(name)
    if source is None:
        return None
    return source if isinstance(source, bytes) else read_regular_bytes(source, max_bytes=MAX_BYTES)


def file_json(files: Files, name: str) -> Any:
    data = file_bytes(files, name)
    if data is None:
        return None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        source = files[name]
        raise DataError(f"{source if isinstance(source, str) else name}: not valid JSON ({exc})") from exc


# --- SentencePiece ---------------------------------------------------------------------------------------------------


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DataError("tokenizer.model: truncated or not a SentencePiece model")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes) -> list[tuple[int, int, Any]]:
    """A protobuf message's (field, wire type, value) in order: varints as ints, length-delimited as bytes."""
    out, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise DataError(f"tokenizer.model: protobuf wire type {wire} (not a SentencePiece model)")
        if pos > len(data):
            raise DataError("tokenizer.model: truncated")
        out.append((field, wire, value))
    return out


def sentencepiece_pieces(data: bytes) -> list[tuple[bytes, float, int]]:
    """(piece, score, type) of each piece of a SentencePiece ModelProto (sentencepiece_model.proto: field 1 the
    repeated pieces, each {1: piece, 2: float score, 3: type, NORMAL when absent})."""
    pieces = []
    for field, wire, value in _fields(data):
        if field != 1 or wire != 2:
            continue
        piece, score, kind = b"", 0.0, NORMAL
        for f, w, v in _fields(value):
            if f == 1 and w == 2:
                piece = v
            elif f == 2 and w == 5:
                score = struct.unpack("<f", v)[0]
            elif f == 3 and w == 0:
                kind = v
        pieces.append((piece, score, kind))
    if not pieces:
        raise DataError("tokenizer.model: no pieces (not a SentencePiece model)")
    return pieces


def looks_special(token: str) -> bool:
    """Added tokens that ought to be control tokens though not marked special (conversion/base.py)."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def sentencepiece_vocab(files: Files, vocab_size: int | None) -> tuple[list[bytes], list[float], list[int]]:
    pieces = sentencepiece_pieces(file_bytes(files, "tokenizer.model") or b"")
    size = vocab_size or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores = [-10000.0] * size
    types = [UNUSED] * size
    for i, (piece, score, kind) in enumerate(pieces[:size]):
        # sentencepiece's IsUnknown / IsControl / IsUnused / IsByte, else NORMAL (a USER_DEFINED piece too)
        tokens[i], scores[i] = piece, score
        types[i] = kind if kind in (UNKNOWN, CONTROL, UNUSED, BYTE) else NORMAL
    added = file_json(files, "added_tokens.json") or {}
    for key, tid in added.items():
        if isinstance(tid, int) and 0 <= tid < size:
            tokens[tid], scores[tid], types[tid] = key.encode(), -1000.0, USER_DEFINED
    config = file_json(files, "tokenizer_config.json") or {}
    for key, data in (config.get("added_tokens_decoder") or {}).items():
        tid, token = int(key), data["content"]
        if tid >= size:
            continue
        if data.get("special") or looks_special(token):
            types[tid] = CONTROL
        else:
            token = token.replace("\u2581", " ")  # pre-normalize user-defined spaces
            types[tid] = USER_DEFINED
        scores[tid], tokens[tid] = -1000.0, token.encode()
    return tokens, scores, types


# --- special tokens (gguf-py SpecialVocab) ---------------------------------------------------------------------------


class SpecialVocab:
    """Which ids are BOS/EOS/..., whether they are added, the chat template and merges: gguf/vocab.py's SpecialVocab."""

    def __init__(self, files: Files, n_vocab: int | None, load_merges: bool = False, types: tuple[str, ...] = SPECIAL_TYPES) -> None:
        self.files, self.n_vocab, self.load_merges, self.types = files, n_vocab, load_merges, types
        self.ids: dict[str, int] = {}
        self.add: dict[str, bool] = {}
        self.merges: list[str] = []
        self.chat_template: Any = None
        self.lowercase: bool | None = None
        self.strip_accents: bool | None = None
        self._from_tokenizer_json()
        config = file_json(files, "config.json") or {}
        for typ in self.types:
            tid = config.get(f"{typ}_token_id")
            if tid is None and isinstance(config.get("text_config"), dict):
                tid = config["text_config"].get(f"{typ}_token_id")
            self._set(typ, tid)
        if load_merges and not self.merges:
            self._merges_txt()

    def _set(self, typ: str, tid: Any) -> None:
        if not isinstance(tid, int) or isinstance(tid, bool):
            return
        if tid < 0:
            raise DataError(f"invalid value for special token type {typ}: {tid}")
        if (self.n_vocab is None or tid < self.n_vocab) and typ not in self.ids:
            self.ids[typ] = tid

    def _normalizer(self, normalizer: dict[str, Any]) -> None:
        kind = normalizer.get("type")
        if kind == "Lowercase":
            self.lowercase = True
        elif kind == "StripAccents":
            self.strip_accents = True
        elif kind == "BertNormalizer":
            if "lowercase" in normalizer:
                self.lowercase = normalizer["lowercase"]
            if "strip_accents" in normalizer:
                self.strip_accents = normalizer["strip_accents"]
        elif kind == "Sequence":
            for inner in normalizer.get("normalizers", []):
                self._normalizer(inner)

    def _merges_txt(self) -> None:
        data = file_bytes(self.files, "merges.txt")
        if data is None:
            return
        lines = data.decode("utf-8").splitlines()
        if lines and lines[0].strip().startswith("#"):
            lines = lines[1:]
        self.merges = [" ".join(parts) for parts in (line.strip().split(None, 3) for line in lines) if len(parts) == 2]

    def _from_tokenizer_json(self) -> None:
        tokenizer = file_json(self.files, "tokenizer.json")
        added: list[dict[str, Any]] = []
        if tokenizer is not None:
            if self.load_merges:
                self.merges = merges_of(tokenizer)
            if normalizer := tokenizer.get("normalizer"):
                self._normalizer(normalizer)
            added = tokenizer.get("added_tokens", {})
        config = file_json(self.files, "tokenizer_config.json")
        if tokenizer:
            self._post_processor(tokenizer, config)
        if not config:
            return
        self._chat_template(config)
        for typ in self.types:
            entry = config.get(f"add_{typ}_token")
            if isinstance(entry, bool) and typ not in self.add:
                self.add[typ] = entry
            value = config.get(f"{typ}_token")
            content = value.get("content") if isinstance(value, dict) else value
            if not isinstance(content, str):
                continue
            self._set(typ, next((a.get("id") for a in added if a.get("content") == content), None))

    def _chat_template(self, config: dict[str, Any]) -> None:
        alt: Any = None
        jinja = file_bytes(self.files, "chat_template.jinja")
        if jinja is not None:
            alt = jinja.decode("utf-8")
        elif (data := file_json(self.files, "chat_template.json")) is not None:
            alt = data.get("chat_template")
        template = config.get("chat_template", alt)
        if template is None or isinstance(template, (str, list)):
            self.chat_template = template

    def _post_processor(self, tokenizer: dict[str, Any], config: dict[str, Any] | None) -> None:
        """BOS/EOS a ByteLevel post-processor adds (none); the others gguf-py reads by heuristics (TemplateProcessing,
        RobertaProcessing) are refused rather than guessed."""
        post = tokenizer.get("post_processor")
        if not post:
            return
        for proc in post.get("processors", [post]):
            kind = proc.get("type")
            if kind == "ByteLevel":
                self.add.setdefault("bos", False)
                self.add.setdefault("eos", False)
            elif kind is not None:
                raise UsageError(f"tokenizer.json: a {kind} post-processor, which ckpt does not convert; use llama.cpp's converter")

    def kvs(self) -> list[KV]:
        out = []
        if self.merges:
            out.append(KV("tokenizer.ggml.merges", ValueType.ARRAY, self.merges, ValueType.STRING))
        for typ, tid in self.ids.items():  # GGUFWriter has no key for a CLS id: it skips it
            if typ in TOKEN_ID_KEYS:
                out.append(KV(f"tokenizer.ggml.{TOKEN_ID_KEYS[typ]}_token_id", ValueType.UINT32, tid))
        for typ, value in self.add.items():  # nor for adding UNK, PAD, CLS or MASK
            if typ in ("bos", "eos", "sep"):
                out.append(KV(f"tokenizer.ggml.add_{typ}_token", ValueType.BOOL, value))
        if self.chat_template is not None:
            out.append(KV("tokenizer.chat_template", ValueType.STRING, _template_text(self.chat_template)))
        if self.lowercase is not None:
            out.append(KV("tokenizer.ggml.normalizer.lowercase", ValueType.BOOL, self.lowercase))
        if self.strip_accents is not None:
            out.append(KV("tokenizer.ggml.normalizer.strip_accents", ValueType.BOOL, self.strip_accents))
        return out


# gguf-py's key of each special token type's id (gguf/constants.py Keys.Tokenizer; its misspelling kept)
TOKEN_ID_KEYS = {
    "bos": "bos",
    "eos": "eos",
    "unk": "unknown",
    "sep": "seperator",
    "pad": "padding",
    "mask": "mask",
    "eot": "eot",
    "eom": "eom",
}


def _template_text(template: Any) -> str:
    if isinstance(template, str):
        return template
    raise UsageError("a list of named chat templates: ckpt writes a single chat template; use llama.cpp's converter")


def merges_of(tokenizer: dict[str, Any]) -> list[str]:
    merges = tokenizer.get("model", {}).get("merges")
    if not isinstance(merges, list) or not merges:
        return []
    if isinstance(merges[0], str):
        return merges
    if isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
        # the pair form (transformers >= 4.45): a space inside a part is written as U+0120 (' ' + 256)
        return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair) for pair in merges]
    raise DataError("tokenizer.json: unknown merges format")


def spm_kvs(files: Files, config: dict[str, Any]) -> list[KV]:
    """A SentencePiece release's tokenizer metadata (LlamaModel.set_vocab -> _set_vocab_sentencepiece)."""
    tokens, scores, types = sentencepiece_vocab(files, config.get("vocab_size"))
    kvs = [
        KV("tokenizer.ggml.model", ValueType.STRING, "llama"),
        KV("tokenizer.ggml.pre", ValueType.STRING, "default"),
        KV("tokenizer.ggml.tokens", ValueType.ARRAY, tokens, ValueType.STRING),
        KV("tokenizer.ggml.scores", ValueType.ARRAY, scores, ValueType.FLOAT32),
        KV("tokenizer.ggml.token_type", ValueType.ARRAY, types, ValueType.INT32),
    ]
    return kvs + SpecialVocab(files, len(tokens)).kvs()
