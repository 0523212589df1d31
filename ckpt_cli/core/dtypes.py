"""The dtype table shared by every format: names, sizes, safetensors codes, torch storage classes.

Kept free of torch so that reading headers and pickles never pays for `import torch`.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_cli.errors import DataError, UsageError


@dataclass(frozen=True, slots=True)
class DType:
    """One row of the table. The rows are shared by every reader and handed to pickles (torch.float32 is
    `DType("float32", ...)`), so they are immutable: slots (no `__dict__` for a pickle's BUILD to write) and
    a `__setstate__` that refuses (the one dataclass adds for frozen slots classes bypasses `frozen`)."""

    name: str  # torch's attribute name: torch.<name>
    itemsize: int
    safetensors: str  # the safetensors header code
    storage_class: str | None  # legacy typed storage pickled by torch.save (None: UntypedStorage + v3)
    order: int  # safetensors' Dtype enum order; files list larger values first
    is_float: bool

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"a pickle may not change dtype {self.name}")

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return by_name, (self.name,)  # a pickle of a row (multiprocessing, copy) is that same row

    def torch(self) -> Any:
        import torch

        return getattr(torch, self.name)

    def __str__(self) -> str:
        return self.name


_TABLE = [
    DType("bool", 1, "BOOL", "BoolStorage", 0, False),
    DType("uint8", 1, "U8", "ByteStorage", 1, False),
    DType("int8", 1, "I8", "CharStorage", 2, False),
    DType("float8_e5m2", 1, "F8_E5M2", None, 3, True),
    DType("float8_e4m3fn", 1, "F8_E4M3", None, 4, True),
    DType("int16", 2, "I16", "ShortStorage", 5, False),
    DType("uint16", 2, "U16", None, 6, False),
    DType("float16", 2, "F16", "HalfStorage", 7, True),
    DType("bfloat16", 2, "BF16", "BFloat16Storage", 8, True),
    DType("int32", 4, "I32", "IntStorage", 9, False),
    DType("uint32", 4, "U32", None, 10, False),
    DType("float32", 4, "F32", "FloatStorage", 11, True),
    DType("complex64", 8, "C64", "ComplexFloatStorage", 12, False),
    DType("float64", 8, "F64", "DoubleStorage", 13, True),
    DType("int64", 8, "I64", "LongStorage", 14, False),
    DType("uint64", 8, "U64", None, 15, False),
]

BY_NAME = {d.name: d for d in _TABLE}
BY_SAFETENSORS = {d.safetensors: d for d in _TABLE}
BY_STORAGE_CLASS = {d.storage_class: d for d in _TABLE if d.storage_class}

# Aliases accepted on the command line and found in pickles (torch.float is float32, etc.).
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "double": "float64",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "complex32": "",
}

FLOAT32 = BY_NAME["float32"]


def by_name(name: str) -> DType:
    """The dtype called `name` (torch name or a common alias); UsageError if unknown."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key in BY_NAME:
        return BY_NAME[key]
    raise UsageError(f"unknown dtype '{name}' (known: {', '.join(BY_NAME)})")


CAST_CHOICES = ("keep", "fp32", "bf16", "fp16")
_CASTS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def cast_target(name: str) -> DType | None:
    """What `--dtype` casts floating-point weights to: None for keep. Only the floating-point widths a model is
    trained and served in: an integer, bool or float8 target would round every weight to 0 or 1 (float8 needs
    scales), so anything else is a UsageError naming the choices."""
    key = name.lower() if isinstance(name, str) else name
    if key == "keep":
        return None
    if key not in _CASTS:
        raise UsageError(f"--dtype {name!r}: ckpt casts weights to {', '.join(CAST_CHOICES)} only (keep leaves them as saved)")
    return BY_NAME[_CASTS[key]]


def from_safetensors(code: str, where: str) -> DType:
    try:
        return BY_SAFETENSORS[code]
    except KeyError:
        raise DataError(f"{where}: unsupported safetensors dtype '{code}'") from None


def dtype_digest(tensors: Mapping[str, Any]) -> bytes:
    """A digest of the tensors' names and dtypes, in order: a source keeps it to tell whether a view selected, renamed
    or cast tensors before a reshard that copies them as they are. A dict of them held 3.7 MB for 82,080 tensors, to
    the end of the command (twice in `diff`). Each name and dtype is length-prefixed, so no two lists share a digest
    by where their boundaries fall."""
    digest = hashlib.blake2b(digest_size=32)
    for name, entry in tensors.items():
        for text in (name, entry.dtype.name):
            data = text.encode("utf-8", "surrogatepass")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return digest.digest()
