"""Reader of llama.cpp's GGUF files (one file, or a gguf-split set `NAME-0000i-of-0000N.gguf` read as one checkpoint).

Each tensor is presented as transformers' GGUF loader gives it: dequantized to float32 (gguf-py's `dequantize` returns
float32 for every type, F16 and BF16 included), under its Hugging Face name, Llama's q/k rows un-permuted
(formats/gguf/names.py). F32 tensors are plain stored arrays; F16 and BF16 ones are cast as they are read; quantized
and un-permuted ones are computed a band of rows at a time (`GgufArray`). GGUF stores no checksums.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli import store
from ckpt_cli.core.dtypes import BY_NAME, FLOAT32
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Box, Checkpoint, FileInfo, FlatRange, LazyPieces, Piece, StoredArray, TensorEntry, contiguous_strides
from ckpt_cli.core.paths import shown
from ckpt_cli.core.reading import BLOCK_BYTES
from ckpt_cli.errors import DataError
from ckpt_cli.formats.gguf import dequant, names
from ckpt_cli.formats.gguf.constants import ALL_BLOCKS, MAGIC
from ckpt_cli.formats.gguf.header import Header, TensorInfo, parse

SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")  # llama_split_path: "%s-%05d-of-%05d.gguf"
STORED = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F64": "float64",
}
KEPT = ("I8", "I16", "I32", "I64", "F64")  # presented as stored (gguf-py does not dequantize them)


class GgufArray:
    """A GGUF tensor as float32 (core/model.Derived): whole rows (ggml rows: `cols` elements, a whole number of blocks)
    read and dequantized a band at a time; an un-permuted tensor in bands of whole heads."""

    __slots__ = ("path", "offset", "type_name", "type_size", "block", "shape", "heads", "name", "rows", "cols", "unit")

    def __init__(self, path: str, offset: int, info: TensorInfo, heads: int | None, name: str) -> None:
        self.path, self.offset, self.name, self.heads = path, offset, name, heads
        self.type_name, self.block, self.type_size = info.type_name, *ALL_BLOCKS[info.type_id][1:]
        self.shape = info.shape
        self.cols = info.dims[0] if info.dims else 1
        self.rows = info.numel // self.cols if self.cols else 0
        self.unit = 1  # rows a window holds a multiple of: one head's (a bias, one row: all of it)
        if heads is not None:
            per_head = self.rows if len(self.shape) > 1 else self.cols
            self.unit = self.rows // heads if len(self.shape) > 1 else self.rows
            if heads <= 0 or per_head % heads or (per_head // heads) % 2:
                raise DataError(f"{path}: tensor {shown(info.name)} of shape {list(self.shape)} cannot be split into {heads} rotary heads")

    def windows(self) -> Iterator[tuple[int, int]]:
        if not self.rows or not self.cols:
            return
        step = max(self.unit, BLOCK_BYTES // max(self.cols * 4, 1) // self.unit * self.unit)
        for r0 in range(0, self.rows, step):
            yield r0 * self.cols, min(step, self.rows - r0) * self.cols

    def read(self, start: int, count: int, sources: Any) -> Any:
        import numpy as np
        import torch

        if count == 0:
            return torch.empty(0, dtype=torch.float32)
        decode = dequant.DECODERS.get(self.type_name)
        if decode is None:
            supported = ", ".join(dequant.DECODERS)
            raise DataError(
                f"{self.path}: tensor {shown(self.name)} is {self.type_name}, which ckpt does not dequantize (it reads {supported})"
            )
        first, last = start // self.cols, -(-(start + count) // self.cols)
        r0, r1 = first // self.unit * self.unit, min(self.rows, -(-last // self.unit) * self.unit)
        row_bytes = self.cols // self.block * self.type_size
        raw = bytearray((r1 - r0) * row_bytes)
        sources.pread_into(self.path, self.offset + r0 * row_bytes, raw)
        values = dequant.dequantize(np.frombuffer(raw, dtype=np.uint8), self.type_name, self.type_size)
        if self.heads is not None:  # LlamaTensorProcessor._reverse_permute_weights, a head at a time
            dim, inner = (self.unit // 2, self.cols) if len(self.shape) > 1 else (self.cols // self.heads // 2, 1)
            values = values.reshape(-1, dim, 2, inner).swapaxes(2, 1).reshape(-1)
        skip = start - r0 * self.cols
        return torch.from_numpy(np.ascontiguousarray(values[skip : skip + count]))


@dataclass(frozen=True)
class Source:
    headers: tuple[Header, ...]  # the parts, in order
    arch: str | None
    dropped: tuple[str, ...]  # GGUF tensors transformers has no parameter for


def parts_of(path: Path) -> list[Path]:
    """The files of the set `path` belongs to: itself, or every part of its gguf-split set (any part names the set)."""
    m = SPLIT_NAME.fullmatch(path.name)
    if m is None or int(m["count"]) <= 1:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _split_headers(path: Path) -> list[Header]:
    """Every part's header, checked against each other as llama.cpp's loader does (llama-model-loader.cpp: split.no,
    split.count, split.tensors.count); a missing or mismatched part is named."""
    paths = parts_of(path)
    if len(paths) == 1:
        header = parse(path)
        count = header.metadata.get("split.count", 1)
        if count != 1:
            raise DataError(
                f"{path}: split.count says it is one of {count} parts, but it is not named as one (NAME-00001-of-{count:05d}.gguf)"
            )
        return [header]
    for i, part in enumerate(paths):
        if not store.exists(part):
            raise DataError(f"{part}: missing: part {i + 1} of the {len(paths)}-part GGUF set {paths[0].name}")
    headers = [parse(p) for p in paths]
    total = headers[0].metadata.get("split.tensors.count")
    for i, h in enumerate(headers):
        no, count = h.metadata.get("split.no"), h.metadata.get("split.count")
        if no != i or count != len(paths):
            raise DataError(
                f"{h.path}: split.no {no} of split.count {count}, but it is part {i + 1} of {len(paths)} by its name (from another set?)"
            )
        if h.metadata.get("split.tensors.count") != total:
            raise DataError(f"{h.path}: split.tensors.count {h.metadata.get('split.tensors.count')} differs from the first part's {total}")
    found = sum(len(h.tensors) for h in headers)
    if total is not None and found != total:
        raise DataError(f"{headers[0].path}: split.tensors.count is {total}, the {len(paths)} parts hold {found} tensors")
    seen: dict[str, str] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in seen:
                raise DataError(f"{h.path}: tensor {shown(t.name)} is in {seen[t.name]} too")
            seen[t.name] = h.path
    return headers


def _entry(header: Header, info: TensorInfo, name: str, heads: int | None) -> TensorEntry:
    offset = header.data_start + info.offset
    shape = info.shape
    if heads is None and info.type_name in STORED:
        stored = BY_NAME[STORED[info.type_name]]
        array = StoredArray(header.path, offset, stored, shape, contiguous_strides(shape))
        dtype = stored if info.type_name in KEPT else FLOAT32
        return TensorEntry(name, dtype, shape, "model", [Piece(Box((0,) * len(shape), shape), array)])
    derived = GgufArray(header.path, offset, info, heads, info.name)
    raw = StoredArray(header.path, offset, BY_NAME["uint8"], (info.nbytes,), (1,))
    pieces = LazyPieces(lambda: [Piece(FlatRange(0, info.numel), raw)], count=1, by_layout=True)  # the bytes it reads
    return TensorEntry(name, FLOAT32, shape, "model", pieces, derived=derived)


def _scalars(metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k.removeprefix(prefix): v for k, v in metadata.items() if k.startswith(prefix) and isinstance(v, (int, float, str, bool))}


def _details(headers: list[Header], arch: str | None, mapped: bool) -> dict[str, Any]:
    meta = headers[0].metadata
    types: dict[str, int] = {}
    for h in headers:
        for t in h.tensors:
            types[t.type_name] = types.get(t.type_name, 0) + 1
    tokens = meta.get("tokenizer.ggml.tokens")
    tokenizer = {
        "model": meta.get("tokenizer.ggml.model"),
        "pre": meta.get("tokenizer.ggml.pre"),
        "vocab_size": len(tokens) if tokens is not None else None,
        "merges": len(meta["tokenizer.ggml.merges"]) if "tokenizer.ggml.merges" in meta else None,
        **{k: v for k, v in _scalars(meta, "tokenizer.ggml.").items() if k.endswith("_token_id")},
    }
    return {
        "version": headers[0].version,
        "architecture": arch or "-",
        "model_name": meta.get("general.name", ""),
        "alignment": headers[0].alignment,
        "parts": len(headers),
        "hyperparameters": _scalars(meta, f"{arch}.") if arch else {},
        "tokenizer": {k: v for k, v in tokenizer.items() if v is not None},
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1])),
        "stored_bytes": sum(t.nbytes for h in headers for t in h.tensors),
        "metadata_keys": len(meta),
        "names": ("Hugging Face" + (", q/k un-permuted" if arch in names.UNPERMUTED else "")) if mapped else "GGUF",
        "checksums": "none (GGUF stores none; verify --write-manifest records some)",
    }


class GgufReader:
    name = "gguf"

    def detect(self, path: Path) -> bool:
        """By its magic, or by its name: a damaged `.gguf` is read as GGUF and refused for what is wrong with it."""
        if path.suffix == ".gguf":
            return True
        try:
            with store.open_read(path) as f:
                return f.read(4) == MAGIC
        except (OSError, DataError):
            return False

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        headers = _split_headers(path)
        meta = headers[0].metadata
        arch = meta.get("general.architecture")
        arch = arch if isinstance(arch, str) else None
        mapped = arch in names.MAPPED
        tensors: dict[str, TensorEntry] = {}
        dropped, notes = [], []
        for h in headers:
            for info in h.tensors:
                name = names.hf_name(info.name, arch) if mapped and arch else info.name
                if name is None:
                    dropped.append(info.name)
                    continue
                heads = names.heads_for(info.name, arch, meta) if arch else None
                tensors[name] = _entry(h, info, name, heads)
        if dropped:
            notes.append(f"left out {len(dropped)} GGUF tensors that transformers has no parameter for: {', '.join(dropped[:5])}")
        if arch and not mapped:
            notes.append(f"architecture {shown(arch)}: no Hugging Face name map in ckpt; tensors keep their GGUF names")
        undecoded = sorted(
            {t.type_name for h in headers for t in h.tensors if t.type_name not in dequant.DECODERS and t.type_name not in KEPT}
        )
        if undecoded:
            notes.append(f"tensors of type {', '.join(undecoded)} cannot be dequantized by ckpt (inspect and verify read them)")
        companions: dict[str, str | bytes] = {}
        if mapped and arch:  # a Hugging Face folder written from it loads with from_pretrained
            config = names.hf_config(meta, arch, {t.name for h in headers for t in h.tensors})
            companions["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        return Checkpoint(
            format=self.name,
            path=str(headers[0].path),
            tensors=tensors,
            files=[FileInfo(h.path, h.file_size) for h in headers],
            details=_details(headers, arch, mapped),
            notes=notes,
            source=Source(tuple(headers), arch, tuple(dropped)),
            companions=companions,
        )

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        source: Source = ckpt.source
        problems = [p for h in source.headers for p in h.problems]
        if deep and not problems:
            problems += [p for h in source.headers for p in _block_problems(h)]
        return problems


def _block_problems(header: Header) -> list[str]:
    """What ggml_validate_row_data rejects (llama.cpp's loader with check_tensors): inf/NaN floats, non-finite fp16
    block scales. Read a band of blocks at a time."""
    import numpy as np

    out = []
    with store.open_read(header.path) as f:
        for t in header.tensors:
            _, block, size = ALL_BLOCKS[t.type_id]
            step = max(1, BLOCK_BYTES // size) * size
            f.seek(header.data_start + t.offset)
            for done in range(0, t.nbytes, step):
                raw = f.read(min(step, t.nbytes - done))
                if len(raw) < min(step, t.nbytes - done):
                    out.append(f"{header.path}: truncated inside tensor {shown(t.name)}")
                    break
                bad = dequant.invalid_block(np.frombuffer(raw, dtype=np.uint8), t.type_name, size)
                if bad is not None:
                    index = done // size + bad[0]
                    unit = "value" if block == 1 else "block"
                    out.append(f"{header.path}: tensor {shown(t.name)} ({t.type_name}): {unit} {index} has {bad[1]} (llama.cpp refuses it)")
                    break
    return out


READER = GgufReader()
