"""One `.safetensors` file: an 8-byte header length, a JSON header, then the tensor bytes.

The writer lays tensors out exactly as the safetensors library does (largest dtype first, then
by name; header padded with spaces to 8 bytes), so its output is byte-identical to `save_file`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core import dtypes
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.interface import ReadOptions, WriteOptions
from ckpt_cli.core.model import Box, Checkpoint, FileInfo, Piece, StoredArray, TensorEntry, contiguous_strides
from ckpt_cli.core.paths import file_size, open_regular, shown
from ckpt_cli.core.write.plan import Literal, OutputFile, Segment, TensorData, WritePlan
from ckpt_cli.errors import DataError
from ckpt_cli.store import location

MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers


@dataclass
class Header:
    path: str
    data_start: int  # absolute offset of the data buffer (8 + header length)
    file_size: int
    metadata: dict[str, str]
    tensors: dict[str, tuple[DType, tuple[int, ...], int, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def parse_header(path: Path) -> Header:
    """Parse and validate a safetensors header. Fatal problems raise; the rest are listed."""
    where = str(path)
    try:
        with open_regular(path) as f:
            size = file_size(f)
            prefix = f.read(8)
            if len(prefix) < 8:
                raise DataError(f"{where}: too short to be a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER or n + 8 > size:
                raise DataError(f"{where}: header length {n} does not fit in the file ({size} bytes); truncated or not safetensors")
            raw = f.read(n)
    except OSError as exc:
        raise DataError(f"{where}: cannot read ({exc.strerror})") from exc
    doc = _load_json(raw, where)
    if not isinstance(doc, dict):
        raise DataError(f"{where}: header is not a JSON object")
    metadata = doc.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DataError(f"{where}: __metadata__ must map strings to strings (the safetensors library refuses this header)")
    header = Header(where, 8 + n, size, metadata)
    for name, info in doc.items():
        header.tensors[name] = _parse_entry(where, name, info)
    _check_layout(header)
    return header


def _load_json(raw: bytes, where: str) -> Any:
    """The header as JSON, as strictly as the library's parser (serde_json): no repeated key, no NaN/Infinity."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise DataError(f"{where}: header names {shown(next(k for k in keys if keys.count(k) > 1))} twice")
        return dict(pairs)

    def constant(name: str) -> Any:
        raise DataError(f"{where}: header is not valid JSON ({name})")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique, parse_constant=constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DataError(f"{where}: header is not valid JSON ({type(exc).__name__})") from exc


def _is_size(value: Any) -> bool:
    """A JSON number the library reads as a usize (no bool, float or string; below 2^64)."""
    return type(value) is int and 0 <= value < 1 << 64


def _overflows(shape: tuple[int, ...], itemsize: int) -> bool:
    """The element and bit counts in unsigned 64-bit arithmetic, multiplied in order as the library does
    (checked_mul): [2**32, 2**32, 0] holds no element, yet the library refuses it."""
    count = 1
    for d in shape:
        count *= d
        if count >= 1 << 64:
            return True
    return count * itemsize * 8 >= 1 << 64


def _parse_entry(where: str, name: str, info: Any) -> tuple[DType, tuple[int, ...], int, int]:
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        raise DataError(f"{where}: malformed header entry for {shown(name)} (no dtype)")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise DataError(f"{where}: malformed header entry for {shown(name)} (shape must be a list of non-negative integers)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(x) for x in offsets):
        raise DataError(f"{where}: malformed header entry for {shown(name)} (data_offsets must be two non-negative integers)")
    dtype = dtypes.from_safetensors(info["dtype"], where)
    shape, (begin, end) = tuple(shape), offsets
    if _overflows(shape, dtype.itemsize):
        raise DataError(f"{where}: shape {shown(shape)} of {shown(name)} overflows 64 bits (the safetensors library refuses the file)")
    if end < begin:
        raise DataError(f"{where}: malformed header entry for {shown(name)} (data_offsets end before they begin)")
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise DataError(
            f"{where}: '{name}' has {end - begin} bytes for shape {list(shape)} of {dtype} (needs {math.prod(shape) * dtype.itemsize})"
        )
    return dtype, shape, begin, end


def _check_layout(header: Header) -> None:
    """Tensors must tile the data buffer: no overlap, no gap, nothing past the end."""
    data_len = header.file_size - header.data_start
    spans = sorted((b, e, name) for name, (_, _, b, e) in header.tensors.items())
    pos = 0
    for begin, end, name in spans:
        if end > data_len:
            raise DataError(f"{header.path}: '{name}' runs past the end of the file (bytes {begin}..{end} of {data_len}); truncated?")
        if begin < pos:
            raise DataError(f"{header.path}: '{name}' overlaps the previous tensor (offset {begin} < {pos})")
        if begin > pos:
            header.problems.append(
                f"{header.path}: {begin - pos} unreferenced bytes before '{name}' (the safetensors library refuses the file)"
            )
        pos = max(pos, end)
    if pos != data_len:
        header.problems.append(
            f"{header.path}: {data_len - pos} bytes after the last tensor are not referenced (the safetensors library refuses the file)"
        )


def tensor_entries(header: Header, role: str = "model") -> dict[str, TensorEntry]:
    out = {}
    for name, (dtype, shape, begin, _end) in header.tensors.items():
        array = StoredArray(header.path, header.data_start + begin, dtype, shape, contiguous_strides(shape))
        out[name] = TensorEntry(name, dtype, shape, role, [Piece(Box((0,) * len(shape), shape), array)])
    return out


def looks_like_safetensors(path: Path) -> bool:
    try:
        with open_regular(path) as f:
            prefix = f.read(9)
            size = file_size(f)
        return len(prefix) == 9 and prefix[8:9] == b"{" and struct.unpack("<Q", prefix[:8])[0] + 8 <= size
    except (OSError, DataError):
        return False


class SafetensorsReader:
    name = "safetensors"

    def detect(self, path: Path) -> bool:
        return path.is_file() and (path.suffix == ".safetensors" or looks_like_safetensors(path))

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        header = parse_header(path)
        return Checkpoint(
            format=self.name,
            path=str(path),
            tensors=tensor_entries(header),
            files=[FileInfo(str(path), header.file_size)],
            details={"metadata": header.metadata},
        )

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        return parse_header(location(ckpt.path)).problems


def dedupe_tied(ckpt: Checkpoint, tensors: list[TensorEntry], notes: list[str]) -> list[TensorEntry]:
    """Keep one name per group of tied tensors (safetensors cannot alias); say which were dropped."""
    selected = {t.name for t in tensors}
    dropped: set[str] = set()
    for group in ckpt.tied_groups():
        names = [n for n in group if n in selected]
        if len(names) > 1:
            dropped.update(names[1:])
            notes.append(f"tied: {', '.join(names[1:])} = {names[0]} (same data); written once as {names[0]}")
    return [t for t in tensors if t.name not in dropped]


def file_segments(tensors: list[TensorEntry], metadata: dict[str, str]) -> list[Segment]:
    """Header and data segments of one safetensors file holding `tensors`, in the library's order."""
    ordered = sorted(tensors, key=lambda t: (-t.dtype.order, t.name))
    doc: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for t in ordered:
        if _overflows(t.shape, t.dtype.itemsize):
            raise DataError(f"'{t.name}' has shape {list(t.shape)}, whose size overflows 64 bits: no safetensors reader would load it")
        doc[t.name] = {"dtype": t.dtype.safetensors, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return [Literal(struct.pack("<Q", len(raw)) + raw), *(TensorData(t, t.dtype) for t in ordered)]


def model_tensors(ckpt: Checkpoint, notes: list[str]) -> list[TensorEntry]:
    """The tensors a weights-only format can hold; everything else is named as dropped."""
    if ckpt.objects:
        notes.append(
            f"dropped {len(ckpt.objects)} non-tensor entries (this format holds tensors only): "
            + ", ".join(list(ckpt.objects)[:5])
            + (" ..." if len(ckpt.objects) > 5 else "")
        )
    return dedupe_tied(ckpt, list(ckpt.tensors.values()), notes)


class SafetensorsWriter:
    name = "safetensors"
    dest_is_dir = False

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        notes: list[str] = []
        tensors = model_tensors(ckpt, notes)
        metadata = {"format": "pt"}
        if ckpt.format == "safetensors":
            metadata = {**ckpt.details.get("metadata", {}), **metadata}
        return WritePlan(self.name, dest, False, [OutputFile("", file_segments(tensors, metadata))], notes)


READER = SafetensorsReader()
WRITER = SafetensorsWriter()
