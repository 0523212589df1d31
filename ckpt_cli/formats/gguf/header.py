"""A GGUF file's header, parsed as ggml's gguf.cpp reads it (gguf_init_from_file_impl) and refused where it refuses.

Layout (little-endian): magic `GGUF`, uint32 version, uint64 tensor count, uint64 key-value count; each key-value a
string key (uint64 length + bytes), a uint32 value type and the value (an array: uint32 element type, uint64 count,
the elements); each tensor info a string name, uint32 n_dims, n_dims uint64 dims (ggml order: the row length first),
uint32 ggml type, uint64 offset in the data section; then padding to `general.alignment` (default 32), where the
data section starts. Nothing read is trusted: every count and length is checked against the bytes left in the file
before anything is read or allocated for it, so a file claiming 2**60 keys or a 4 GB string fails at once.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_cli import store
from ckpt_cli.core.paths import shown
from ckpt_cli.errors import DataError
from ckpt_cli.formats.gguf.constants import (
    ALL_BLOCKS,
    DEFAULT_ALIGNMENT,
    MAGIC,
    MAX_ARRAY,
    MAX_DIMS,
    MAX_NAME,
    MAX_STRING,
    TYPE_COUNT,
    VALUE_SIZES,
    ValueType,
)

SUPPORTED_VERSIONS = (2, 3)  # gguf-py's READER_SUPPORTED_VERSIONS; ggml refuses 1 and anything past 3
MAX_NESTING = 8  # arrays of arrays: more levels are no real file's, and each would cost a Python frame
INT64_MAX = (1 << 63) - 1
# The fewest bytes a key-value and a tensor info can take: what a claimed count is checked against.
MIN_KV = 8 + 1 + 4 + 1
MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # an empty name and no dims


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: ne[0] (the row) first
    type_id: int
    offset: int  # in the data section

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch order (gguf-py's reader reverses the dims)."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return ALL_BLOCKS[self.type_id][0]

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        _, block, size = ALL_BLOCKS[self.type_id]
        return self.numel // block * size


@dataclass
class Header:
    path: str
    version: int
    file_size: int
    metadata: dict[str, Any]  # key -> value (numeric arrays as numpy arrays, string arrays as lists)
    types: dict[str, str]  # key -> its value type as written ("UINT32", "ARRAY[STRING]")
    tensors: list[TensorInfo]
    alignment: int
    data_start: int
    problems: list[str] = field(default_factory=list)  # what llama.cpp refuses and the data survives (verify reports)


class _Cursor:
    """Sequential reads of a file whose size is known: a read past the end is refused before it is made."""

    def __init__(self, f: BinaryIO, size: int, where: str) -> None:
        self.f, self.size, self.where, self.pos = f, size, where, 0

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise DataError(f"{self.where}: truncated in the {what}: needs {n} bytes at offset {self.pos}, the file has {self.size}")
        data = self.f.read(n)
        if len(data) != n:
            raise DataError(f"{self.where}: truncated in the {what}: the file ends at offset {self.pos + len(data)}")
        self.pos += n
        return data

    def number(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        at = self.pos
        n = self.number("<Q", what)
        if n > MAX_STRING or n > self.left():
            raise DataError(
                f"{self.where}: a string of {n} bytes at offset {at} (in the {what}) runs past the end of the file ({self.size} bytes)"
            )
        return self.take(n, what)


def _text(raw: bytes, where: str, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{where}: {what} {shown(raw[:64])} is not UTF-8") from None


def _value_type(code: int, where: str, key: str) -> ValueType:
    try:
        return ValueType(code)
    except ValueError:
        raise DataError(f"{where}: key {shown(key)} has value type {code}, which GGUF does not define") from None


def _value(cur: _Cursor, kind: ValueType, key: str, depth: int = 0) -> tuple[Any, str]:
    """One value of `kind` and its type as written."""
    what = f"value of key {shown(key)}"
    if kind == ValueType.STRING:
        return cur.string(what).decode("utf-8", "replace"), "STRING"
    if kind != ValueType.ARRAY:
        size, fmt = VALUE_SIZES[kind]
        return cur.number(fmt, what), kind.name
    if depth >= MAX_NESTING:
        raise DataError(f"{cur.where}: key {shown(key)} nests arrays more than {MAX_NESTING} deep")
    item = _value_type(cur.number("<I", what), cur.where, key)
    at = cur.pos
    count = cur.number("<Q", what)
    least = VALUE_SIZES[item][0] if item in VALUE_SIZES else 8 if item == ValueType.STRING else 12
    if count > MAX_ARRAY or count * least > cur.left():
        raise DataError(
            f"{cur.where}: key {shown(key)} claims an array of {count} {item.name} values at offset {at}, "
            f"more than the {cur.left()} bytes left in the file hold"
        )
    if item in VALUE_SIZES:
        import numpy as np

        size, fmt = VALUE_SIZES[item]
        array = np.frombuffer(cur.take(count * size, what), dtype=np.dtype(fmt))
        return array, f"ARRAY[{item.name}]"
    values = [_value(cur, item, key, depth + 1)[0] for _ in range(count)]
    return values, f"ARRAY[{item.name}]"


def parse(path: Path | str) -> Header:
    """The header of one GGUF file; DataError (one line naming the file) when ggml would not load it."""
    where = str(path)
    try:
        with store.open_read(path) as f:
            return _parse(_Cursor(f, store.file_size(f), where))
    except OSError as exc:
        raise DataError(f"{where}: cannot read ({exc.strerror or exc})") from exc


def _parse(cur: _Cursor) -> Header:
    where = cur.where
    magic = cur.take(4, "magic") if cur.size >= 4 else b""
    if magic != MAGIC:
        raise DataError(f"{where}: not a GGUF file (magic {shown(magic)}, expected 'GGUF')")
    version = cur.number("<I", "header")
    if version & 0xFFFF == 0 and version:
        raise DataError(f"{where}: GGUF version {version:#x} reads as big-endian; ckpt reads little-endian GGUF files only")
    if version not in SUPPORTED_VERSIONS:
        raise DataError(f"{where}: GGUF version {version} is not supported (versions {', '.join(map(str, SUPPORTED_VERSIONS))})")
    n_tensors = cur.number("<Q", "header")
    n_kv = cur.number("<Q", "header")
    if n_kv * MIN_KV > cur.left():
        raise DataError(f"{where}: claims {n_kv} metadata keys, more than the {cur.left()} bytes left in the file hold")
    if n_tensors * MIN_TENSOR_INFO > cur.left():
        raise DataError(f"{where}: claims {n_tensors} tensors, more than the {cur.left()} bytes left in the file hold")
    metadata: dict[str, Any] = {}
    types: dict[str, str] = {}
    for i in range(n_kv):
        key = _text(cur.string(f"key of metadata entry {i}"), where, "a metadata key")
        if not key:
            raise DataError(f"{where}: metadata key {i} is empty")
        if key in metadata:
            raise DataError(f"{where}: metadata key {shown(key)} appears twice")
        kind = _value_type(cur.number("<I", f"type of key {shown(key)}"), where, key)
        metadata[key], types[key] = _value(cur, kind, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and types["general.alignment"] != "UINT32":
        raise DataError(f"{where}: general.alignment is a {types['general.alignment']}, GGUF requires UINT32")
    if alignment == 0 or alignment & (alignment - 1):
        raise DataError(f"{where}: general.alignment {alignment} is not a power of 2")
    tensors = [_tensor_info(cur, i) for i in range(n_tensors)]
    names = set()
    for t in tensors:
        if t.name in names:
            raise DataError(f"{where}: tensor {shown(t.name)} appears twice")
        names.add(t.name)
    data_start = -(-cur.pos // alignment) * alignment
    header = Header(where, version, cur.size, metadata, types, tensors, int(alignment), data_start)
    _check_layout(header)
    return header


def _tensor_info(cur: _Cursor, i: int) -> TensorInfo:
    where = cur.where
    name = _text(cur.string(f"name of tensor {i}"), where, "a tensor name")
    what = f"info of tensor {shown(name)}"
    n_dims = cur.number("<I", what)
    if n_dims > MAX_DIMS:
        raise DataError(f"{where}: tensor {shown(name)} has {n_dims} dimensions (ggml allows at most {MAX_DIMS})")
    dims = tuple(cur.number("<Q", what) for _ in range(n_dims))
    count = 1
    for d in dims:
        count *= d
        if d > INT64_MAX or count > INT64_MAX:
            raise DataError(f"{where}: tensor {shown(name)} has shape {list(dims)}, whose element count overflows 64 bits")
    type_id = cur.number("<I", what)
    offset = cur.number("<Q", what)
    if type_id not in ALL_BLOCKS:
        known = "ggml removed it" if type_id < TYPE_COUNT else "ggml does not define it"
        raise DataError(f"{where}: tensor {shown(name)} has type {type_id}, which ckpt cannot lay out ({known})")
    type_name, block, _ = ALL_BLOCKS[type_id]
    row = dims[0] if dims else 1
    if row % block:
        raise DataError(
            f"{where}: tensor {shown(name)} of type {type_name} has rows of {row} elements, not a whole number of its blocks of {block}"
        )
    return TensorInfo(name, dims, type_id, offset)


def _check_layout(header: Header) -> None:
    """Every tensor's bytes inside the file (else DataError: truncated); misaligned, overlapping or out-of-place
    tensors are problems (ggml loads a tensor only at the offset right after the previous one, padded)."""
    data_len = header.file_size - header.data_start
    if header.tensors and data_len < 0:
        raise DataError(
            f"{header.path}: truncated: the data section would start at offset {header.data_start}, the file has {header.file_size} bytes"
        )
    for t in header.tensors:
        if t.offset + t.nbytes > data_len:
            raise DataError(
                f"{header.path}: tensor {shown(t.name)} needs bytes up to {header.data_start + t.offset + t.nbytes} "
                f"but the file has {header.file_size} (truncated?)"
            )
    overlapping: dict[str, str] = {}  # tensor -> a tensor before it that it overlaps
    reach: tuple[int, str] | None = None  # the furthest end so far, and whose
    for begin, end, name in sorted((t.offset, t.offset + t.nbytes, t.name) for t in header.tensors if t.nbytes):
        if reach is not None and begin < reach[0]:
            overlapping[name] = reach[1]
            overlapping.setdefault(reach[1], name)
        if reach is None or end > reach[0]:
            reach = (end, name)
    expected = 0
    for t in header.tensors:
        if t.offset % header.alignment:
            header.problems.append(
                f"{header.path}: tensor {shown(t.name)} at data offset {t.offset} is not aligned to {header.alignment} bytes"
            )
        elif t.name in overlapping:
            header.problems.append(
                f"{header.path}: tensor {shown(t.name)} overlaps tensor {shown(overlapping[t.name])} (data offset {t.offset})"
            )
        elif len(t.name.encode()) >= MAX_NAME:
            header.problems.append(
                f"{header.path}: tensor name {shown(t.name)} is {len(t.name.encode())} bytes (llama.cpp allows {MAX_NAME - 1})"
            )
        elif t.offset != expected:
            header.problems.append(
                f"{header.path}: tensor {shown(t.name)} is at data offset {t.offset}, llama.cpp expects {expected} (after the previous one)"
            )
        expected = t.offset + -(-t.nbytes // header.alignment) * header.alignment
