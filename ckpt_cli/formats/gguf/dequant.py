"""GGUF tensor types to float32, in numpy, bit-equal to gguf-py's `gguf.quants.dequantize` (gguf-py 0.19.0,
gguf/quants.py: each `dequantize_blocks` here does the same float32 operations in the same order, so every value
rounds the same), and the block checks of ggml's `ggml_validate_row_data` (ggml/src/ggml-quants.c) for verify --deep.

Blocks are independent: a row range of a tensor decodes on its own, which is how a read streams (formats/gguf/reader.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK_K = 256
Decoder = Callable[[np.ndarray], np.ndarray]


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, width: int) -> np.ndarray:
    """Low then high 4 bits of each byte of rows of `width` bytes: (n, -1) uint8 in gguf-py's order."""
    return ((qs.reshape((n, -1, 1, width)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))) & np.uint8(0x0F)).reshape((n, -1))


def _q4_0(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, qs = _f16(b[:, :2]), b[:, 2:]
    q = _nibbles(qs, n, 16).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, m, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:]
    return (d * _nibbles(qs, n, 16).astype(np.float32)) + m


def _q5_high(qh_raw: np.ndarray, n: int) -> np.ndarray:
    qh = np.ascontiguousarray(qh_raw).view(np.uint32).reshape((n, 1)) >> np.arange(32, dtype=np.uint32).reshape((1, 32))
    return (qh & np.uint32(0x01)).astype(np.uint8)


def _q5_0(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, qh, qs = _f16(b[:, :2]), _q5_high(b[:, 2:6], n), b[:, 6:]
    q = (_nibbles(qs, n, 16) | (qh << np.uint8(4))).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, m, qh, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), _q5_high(b[:, 4:8], n), b[:, 8:]
    q = (_nibbles(qs, n, 16) | (qh << np.uint8(4))).astype(np.float32)
    return (d * q) + m


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, :2])
    x = np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)
    return x * d


def _q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales, qs = b[:, : QK_K // 16], b[:, QK_K // 16 : QK_K // 16 + QK_K // 4]
    d, dmin = _f16(b[:, -4:-2]), _f16(b[:, -2:])
    dl = (d * (scales & 0xF).astype(np.float32)).reshape((n, QK_K // 16, 1))
    ml = (dmin * (scales >> 4).astype(np.float32)).reshape((n, QK_K // 16, 1))
    shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    q = ((qs.reshape((n, -1, 1, 32)) >> shift) & np.uint8(3)).reshape((n, QK_K // 16, 16)).astype(np.float32)
    return (dl * q - ml).reshape((n, -1))


def _q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask, qs = b[:, : QK_K // 8], b[:, QK_K // 8 : QK_K // 8 + QK_K // 4]
    scales, d = b[:, QK_K // 8 + QK_K // 4 : -2], _f16(b[:, -2:])
    lscales = (scales[:, :8].reshape((n, 1, 8)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 2, 1))).reshape((n, 16))
    hscales = (scales[:, 8:].reshape((n, 1, 4)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 4, 1))).reshape((n, 16))
    sc = (lscales & np.uint8(0x0F)) | ((hscales & np.uint8(0x03)) << np.uint8(4))
    sc = (sc.astype(np.int8) - np.int8(32)).astype(np.float32)
    dl = (d * sc).reshape((n, 16, 1))
    ql = qs.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    qh = hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))
    ql = ql.reshape((n, 16, QK_K // 16)) & np.uint8(3)
    qh = (qh.reshape((n, 16, QK_K // 16)) & np.uint8(1)) ^ np.uint8(1)  # the offset is zero where the mask bit is 1
    q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).astype(np.float32)
    return (dl * q).reshape((n, QK_K))


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K)."""
    n = scales.shape[0]
    s = scales.reshape((n, 3, 4))
    d, m, m_d = s[:, 0:1], s[:, 1:2], s[:, 2:3]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape((n, 8)), mn.reshape((n, 8))


def _q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin, scales, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:16], b[:, 16:]
    sc, m = _k_scale_min(scales)
    d = (d * sc.astype(np.float32)).reshape((n, -1, 1))
    dm = (dmin * m.astype(np.float32)).reshape((n, -1, 1))
    q = _nibbles(qs, n, 32).reshape((n, -1, 32)).astype(np.float32)
    return (d * q - dm).reshape((n, QK_K))


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin, scales = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:16]
    qh, qs = b[:, 16 : 16 + QK_K // 8], b[:, 16 + QK_K // 8 :]
    sc, m = _k_scale_min(scales)
    d = (d * sc.astype(np.float32)).reshape((n, -1, 1))
    dm = (dmin * m.astype(np.float32)).reshape((n, -1, 1))
    ql = _nibbles(qs, n, 32).reshape((n, -1, 32))
    high = (qh.reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))) & np.uint8(0x01)
    q = (ql | (high.reshape((n, -1, 32)) << np.uint8(4))).astype(np.float32)
    return (d * q - dm).reshape((n, QK_K))


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[:, : QK_K // 2], b[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    scales, d = b[:, QK_K // 2 + QK_K // 4 : -2], _f16(b[:, -2:])
    sc = np.ascontiguousarray(scales).view(np.int8).astype(np.float32)
    d = (d * sc).reshape((n, QK_K // 16, 1))
    low = _nibbles(ql, n, 64).reshape((n, -1, 32))
    high = ((qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))) & np.uint8(0x03)).reshape(
        (n, -1, 32)
    )
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (d * q.reshape((n, QK_K // 16, -1)).astype(np.float32)).reshape((n, QK_K))


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
FP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled (kvalues_mxfp4)


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = _nibbles(b[:, 2:], n, 16).reshape((n, -1, 1))
    q = np.take_along_axis(np.array(IQ4_VALUES, dtype=np.int8).reshape(1, 1, 16), qs, axis=-1).astype(np.float32).reshape((n, -1))
    return d * q


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, :2])
    scales_h = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)
    scales_l, qs = b[:, 4 : 4 + QK_K // 64], b[:, 4 + QK_K // 64 :]
    low = (scales_l.reshape((n, -1, 1)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2))).reshape((n, -1)) & np.uint8(0x0F)
    high = scales_h.reshape((n, 1, -1)) >> np.array([2 * i for i in range(QK_K // 32)], dtype=np.uint16).reshape((1, -1, 1))
    high = high.reshape((n, -1)).astype(np.uint8) & np.uint8(0x03)
    scales = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (d * scales.astype(np.float32)).reshape((n, -1, 1))
    q = (qs.reshape((n, -1, 1, 16)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))).reshape((n, -1, 32, 1)) & np.uint8(0x0F)
    values = np.array(IQ4_VALUES, dtype=np.int8).reshape((1, 1, 1, -1))
    q = np.take_along_axis(values, q, axis=-1).astype(np.float32).reshape((n, -1, 32))
    return (dl * q).reshape((n, -1))


def _tq1_0(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    qs, qh, d = b[:, : (QK_K - 4 * QK_K // 64) // 5], b[:, (QK_K - 4 * QK_K // 64) // 5 : -2], _f16(b[:, -2:])
    pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
    qs0 = (qs[..., :32].reshape((n, -1, 1, 32)) * pow3.reshape((1, 1, 5, 1))).reshape((n, -1))
    qs1 = (qs[..., 32:].reshape((n, -1, 1, 16)) * pow3.reshape((1, 1, 5, 1))).reshape((n, -1))
    qh = (qh.reshape((n, -1, 1, 4)) * pow3[:4].reshape((1, 1, 4, 1))).reshape((n, -1))
    q = ((np.concatenate([qs0, qs1, qh], axis=-1).astype(np.uint16) * 3) >> 8).astype(np.int8) - np.int8(1)
    return d * q.astype(np.float32)


def _tq2_0(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    qs, d = b[:, : QK_K // 4], _f16(b[:, -2:])
    q = (qs.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))) & 0x03
    return d * (q.reshape((n, -1)).astype(np.int8) - np.int8(1)).astype(np.float32)


def _mxfp4(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    e, qs = b[:, :1], b[:, 1:]
    d = np.where(e < 2, np.uint32(0x00200000) << np.uint32(e), np.uint32(e - 1) << np.uint32(23)).view(np.float32)
    q = ((qs.reshape((n, 1, 16)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 2, 1))) & np.uint8(0x0F)).view(np.int8)
    q = np.take_along_axis(np.array(FP4_VALUES, dtype=np.int8).reshape(1, 1, 16), q, axis=-1).reshape((n, 32))
    return d * q.astype(np.float32)


def _f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float32)


def _f16_block(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view(np.int16).astype(np.int32) << 16).view(np.float32)


# type name -> how a (blocks, bytes per block) uint8 array becomes (blocks, elements per block) float32
DECODERS: dict[str, Decoder] = {
    "F32": _f32,
    "F16": _f16_block,
    "BF16": _bf16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "TQ1_0": _tq1_0,
    "TQ2_0": _tq2_0,
    "MXFP4": _mxfp4,
}


def dequantize(raw: np.ndarray, type_name: str, type_size: int) -> np.ndarray:
    """Whole blocks of `type_name` (uint8 bytes) as a flat float32 array."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape((-1, type_size))
    with np.errstate(all="ignore"):  # a NaN or inf scale decodes to NaN or inf, as in gguf-py (verify --deep names it)
        return DECODERS[type_name](blocks).reshape(-1)


# --- ggml_validate_row_data ----------------------------------------------------------------------------------------
# Byte offsets of each block's fp16 scales that ggml checks for inf/NaN; float types check every value.
F16_SCALES: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q8_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),  # block_q2_K: scales[16], qs[64], d, dmin
    "Q3_K": (108,),  # hmask[32], qs[64], scales[12], d
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),  # ql[128], qh[64], scales[16], d
    "TQ1_0": (52,),
    "TQ2_0": (64,),
    "Q1_0": (0,),
    **{name: (0,) for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_NL", "IQ4_XS")},
}


def invalid_block(raw: np.ndarray, type_name: str, type_size: int) -> tuple[int, str] | None:
    """The first block that ggml_validate_row_data rejects, and why (None: all valid). I8..I64 and types ggml does
    not validate pass."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape((-1, type_size))
    if type_name in ("F32", "F64", "F16"):
        values = blocks.reshape(-1).view({"F32": np.float32, "F64": np.float64, "F16": np.float16}[type_name])
        bad = np.flatnonzero(~np.isfinite(values))
        return (int(bad[0]), "nan" if np.isnan(values[bad[0]]) else "inf") if bad.size else None
    if type_name == "BF16":
        bits = blocks.reshape(-1).view(np.uint16) & np.uint16(0x7FFF)
        bad = np.flatnonzero(bits >= 0x7F80)
        return (int(bad[0]), "nan" if bits[bad[0]] > 0x7F80 else "inf") if bad.size else None
    if type_name == "Q8_K":
        d = np.ascontiguousarray(blocks[:, :4]).view(np.float32).reshape(-1)
        bad = np.flatnonzero(~np.isfinite(d))
        return (int(bad[0]), "nan" if np.isnan(d[bad[0]]) else "inf") if bad.size else None
    if type_name == "MXFP4":
        bad = np.flatnonzero(blocks[:, 0] == 0xFF)
        return (int(bad[0]), "invalid e value 255") if bad.size else None
    for at in F16_SCALES.get(type_name, ()):
        bits = np.ascontiguousarray(blocks[:, at : at + 2]).view(np.uint16).reshape(-1)
        bad = np.flatnonzero((bits & np.uint16(0x7C00)) == 0x7C00)
        if bad.size:
            return int(bad[0]), "nan" if bits[bad[0]] & 0x03FF else "inf"
    return None
