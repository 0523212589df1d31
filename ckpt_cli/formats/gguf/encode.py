"""A GGUF file's header as bytes, from metadata alone: magic, version, counts, the key-values in the order they were
added, then each tensor's info (name, dims innermost first, type, offset into the data section, each tensor padded to
the alignment), then zeros up to the alignment, as gguf-py's GGUFWriter writes them (write_header_to_file,
write_kv_data_to_file, write_ti_data_to_file, all little-endian).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from ckpt_cli.formats.gguf.constants import DEFAULT_ALIGNMENT, MAGIC, VERSION, TensorType, ValueType, nbytes

_SIMPLE = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
    ValueType.BOOL: "?",
}


@dataclass(frozen=True)
class KV:
    key: str
    type: ValueType
    value: Any
    item: ValueType | None = None  # an array's item type


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy's order); written innermost first
    type: TensorType

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return nbytes(self.type, count)


def pad(n: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def _string(value: str | bytes) -> bytes:
    data = value.encode("utf-8") if isinstance(value, str) else value
    return struct.pack("<Q", len(data)) + data


def _value(value: Any, kind: ValueType) -> bytes:
    fmt = _SIMPLE.get(kind)
    if fmt is not None:
        return struct.pack(fmt, value)
    if kind == ValueType.STRING:
        return _string(value)
    raise ValueError(f"GGUF value of type {kind.name} is not a plain value")


def kv_bytes(kv: KV) -> bytes:
    out = bytearray(_string(kv.key))
    out += struct.pack("<I", kv.type)
    if kv.type != ValueType.ARRAY:
        out += _value(kv.value, kv.type)
        return bytes(out)
    assert kv.item is not None, kv.key
    out += struct.pack("<IQ", kv.item, len(kv.value))
    fmt = _SIMPLE.get(kv.item)
    if fmt is not None and fmt != "?":  # numbers packed at once
        out += struct.pack("<" + fmt[-1] * len(kv.value), *kv.value)
    else:
        for item in kv.value:
            out += _value(item, kv.item)
    return bytes(out)


def header(kvs: list[KV], infos: list[TensorInfo], alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """Everything before the first tensor's data, padded to the alignment."""
    out = bytearray(MAGIC)
    out += struct.pack("<IQQ", VERSION, len(infos), len(kvs))
    for kv in kvs:
        out += kv_bytes(kv)
    offset = 0
    for info in infos:
        out += _string(info.name)
        out += struct.pack("<I", len(info.shape))
        out += struct.pack(f"<{len(info.shape)}Q", *reversed(info.shape))
        out += struct.pack("<IQ", info.type, offset)
        offset += pad(info.nbytes, alignment)
    out += bytes(pad(len(out), alignment) - len(out))
    return bytes(out)
