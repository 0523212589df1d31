"""Byte sizes as users write them: 5GB (10^9), 5GiB (2^30), 500MB, plain bytes."""

from __future__ import annotations

import re

from ckpt_cli.errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", text, flags=re.IGNORECASE)
    unit = (match.group(2) or "").upper() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(f"cannot read size '{text}' (examples: 5GB, 5GiB, 500MB, 1048576)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"size must be positive, got '{text}'")
    return value


def human_bytes(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
