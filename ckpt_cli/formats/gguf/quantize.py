"""GGUF's block quantizers in numpy, a band of whole rows at a time: each function does, operation for operation and in
the same float32 arithmetic, what llama.cpp's gguf-py does (gguf/quants.py: `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`,
`BF16`), so a band quantized here is bit-equal to the same rows of gguf-py's whole-tensor result (every block lies in
one row; tests/test_gguf_write.py compares them). A block is 32 consecutive values of a row; its bytes are the f16
scale (and f16 minimum for the _1 types), the high bits (Q5), then the packed values.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ckpt_cli.formats.gguf.constants import BLOCKS, TensorType

QUANTIZED = (TensorType.Q8_0, TensorType.Q4_0, TensorType.Q4_1, TensorType.Q5_0, TensorType.Q5_1)
NAMES = {t.name.lower(): t for t in QUANTIZED}


def _inverse(d: Any) -> Any:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, 0, 1 / d)


def _nibbles(q: Any, n: int) -> Any:
    """Values 0..15 of each block packed two a byte: element j low, element j + 16 high."""
    q = q.reshape((n, 2, 16))
    return (q[..., 0, :] & np.uint8(0x0F)) | (q[..., 1, :] << np.uint8(4))


def _high_bits(q: Any, n: int) -> Any:
    """Bit 4 of each of a block's 32 values, as a little-endian 32-bit mask (Q5's qh)."""
    return np.packbits(q.reshape((n, 1, 32)) >> np.uint8(4), axis=-1, bitorder="little").reshape(n, 4)


def _half(x: Any) -> Any:
    return x.astype(np.float16).view(np.uint8)


_SCRATCH = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """A buffer of this thread's, reused band after band: fresh arrays of a few MB each band cost a page fault per
    4 KB (a third of a 2 GB write's time went to the kernel)."""
    cache = _SCRATCH.__dict__.setdefault("arrays", {})
    need = math.prod(shape)
    found = cache.get(name)
    if found is None or found.size < need or found.dtype != dtype:
        found = cache[name] = np.empty(need, dtype=dtype)
    return found[:need].reshape(shape)


# roundf(x) = trunc(x + copysign(0.5 - 2**-25, x)) under round-to-nearest-even, for every float32 of magnitude below
# 128 (checked for all 1.1 billion of them against gguf-py's np_roundf); x + 0.5 would round 0.49999997 up to 1
_HALF_BELOW = np.nextafter(np.float32(0.5), np.float32(0))


def _q8_0(b: Any) -> Any:
    """gguf-py's `d = abs(b).max(axis=1) / 127; qs = np_roundf(b * (1 / d)).astype(np.int8)`, in fewer passes: the
    block maximum as a tree of elementwise maxima (the same maximum, NaN kept), and roundf as the truncating cast to
    int8 of x + copysign(0.5 - 2**-25, x), exact for |x| <= 127 (`_HALF_BELOW`)."""
    n = len(b)
    a = np.abs(b, out=scratch("a", b.shape, np.float32))
    m, width = a, b.shape[1]
    while width > 1:
        width //= 2
        m = np.maximum(m[:, :width], m[:, width : 2 * width], out=scratch(f"m{width}", (n, width), np.float32))
    d = m / np.float32(127)
    v = np.multiply(b, _inverse(d), out=scratch("v", b.shape, np.float32))
    v += np.copysign(_HALF_BELOW, v, out=a)
    out = np.empty((n, 34), dtype=np.uint8)
    out[:, :2] = _half(d)
    out[:, 2:].view(np.int8)[...] = v  # the cast truncates toward zero, as astype(np.int8)
    return out


def _symmetric(b: Any, levels: int) -> tuple[Any, Any]:
    """Q4_0 / Q5_0: the value of largest magnitude (its sign kept) over -levels/2 is the scale."""
    imax = abs(b).argmax(axis=-1, keepdims=True)
    d = np.take_along_axis(b, imax, axis=-1) / -(levels // 2)
    q = np.trunc((b * _inverse(d)) + np.float32(levels // 2 + 0.5), dtype=np.float32).astype(np.uint8).clip(0, levels - 1)
    return d, q


def _affine(b: Any, levels: int) -> tuple[Any, Any, Any]:
    """Q4_1 / Q5_1: (max - min) / (levels - 1) is the scale, min the offset."""
    lo = b.min(axis=-1, keepdims=True)
    d = (b.max(axis=-1, keepdims=True) - lo) / (levels - 1)
    q = np.trunc((b - lo) * _inverse(d) + np.float32(0.5), dtype=np.float32).astype(np.uint8).clip(0, levels - 1)
    return d, lo, q


def _q4_0(b: Any) -> Any:
    d, q = _symmetric(b, 16)
    return np.concatenate([_half(d), _nibbles(q, len(b))], axis=-1)


def _q4_1(b: Any) -> Any:
    d, lo, q = _affine(b, 16)
    return np.concatenate([_half(d), _half(lo), _nibbles(q, len(b))], axis=-1)


def _q5_0(b: Any) -> Any:
    d, q = _symmetric(b, 32)
    return np.concatenate([_half(d), _high_bits(q, len(b)), _nibbles(q, len(b))], axis=-1)


def _q5_1(b: Any) -> Any:
    d, lo, q = _affine(b, 32)
    return np.concatenate([_half(d), _half(lo), _high_bits(q, len(b)), _nibbles(q, len(b))], axis=-1)


_BLOCK_FUNCS = {TensorType.Q8_0: _q8_0, TensorType.Q4_0: _q4_0, TensorType.Q4_1: _q4_1, TensorType.Q5_0: _q5_0, TensorType.Q5_1: _q5_1}


def bf16(values: Any) -> Any:
    """float32 values as bfloat16 bytes: NaN made quiet, then round to nearest even (ggml_compute_fp32_to_bf16)."""
    bits: Any = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    bits = np.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits & np.uint32(0xFFFF0000)) | np.uint32(64 << 16), bits)
    bits = (bits.astype(np.uint64) + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return bits.astype(np.uint16).view(np.uint8)


def quantize(values: Any, kind: TensorType) -> Any:
    """Whole rows of values (any float dtype, row length a multiple of the block) as `kind`'s bytes, in order (F32 and
    F16 as gguf-py makes them: numpy's astype, round to nearest even)."""
    if kind == TensorType.F32:
        return np.array(values, dtype=np.float32).reshape(-1).view(np.uint8)  # a copy: values may be a scratch buffer
    if kind == TensorType.F16:
        return np.ascontiguousarray(values).astype(np.float16).reshape(-1).view(np.uint8)
    if kind == TensorType.BF16:
        return bf16(values).reshape(-1)
    block, size = BLOCKS[kind]
    blocks = np.ascontiguousarray(values).astype(np.float32, copy=False).reshape(-1, block)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and a scale past f16 cast as gguf-py's do, silently
        out = _BLOCK_FUNCS[kind](blocks)
    assert out.dtype == np.uint8 and out.shape[-1] == size
    return out.reshape(-1)


def fits(kind: TensorType, row: int) -> bool:
    """Whether rows of `row` values quantize to `kind` (whole blocks); the converter falls back to F16 otherwise."""
    return row % BLOCKS[kind][0] == 0
