"""Views of a quantized checkpoint for writing: each quantized weight replaced by a computed tensor that dequantizes
it as it streams, or each weight replaced by its FP8 values and scales (ops/quantized.py says which tensors are
which; core/quant_math.py does the arithmetic). Nothing is read when a view is made.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core import quant_math
from ckpt_cli.core.dtypes import BY_NAME, DType
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.reading import BLOCK_BYTES, read_elements
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.ops.quant_schemes import Quantized, Scheme, load_config
from ckpt_cli.ops.quantized import FP8_TYPES, may_be_quantized, scheme_of, shape_problems

# --- dequantizing --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class RowDequant:
    """A quantized matrix (or a stack of them) dequantized a band of rows at a time: windows are whole multiples of
    `band` rows (a block row: its scales), of about BLOCK_BYTES of float32 work each."""

    q: Quantized
    tensors: dict[str, TensorEntry]
    out: DType

    @property
    def band(self) -> int:
        return self.q.block[0]

    def windows(self) -> Iterator[tuple[int, int]]:
        rows, cols = self.q.shape[-2:]
        step = max(self.band, BLOCK_BYTES // max(cols * 4, 1) // self.band * self.band)
        for m in range(math.prod(self.q.shape[:-2])):
            for r0 in range(0, rows, step):
                yield (m * rows + r0) * cols, min(step, rows - r0) * cols

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        rows, cols = self.q.shape[-2:]
        first, last = start // cols, -(-(start + count) // cols)
        parts, row = [], first
        while row < last:  # spans of rows within one matrix
            m, r0 = divmod(row, rows)
            r1 = min(rows, last - m * rows)
            parts.append(self.rows(m, r0, r1, sources).to(self.out.torch()).reshape(-1))
            row = m * rows + r1
        whole = torch.cat(parts) if len(parts) > 1 else parts[0]
        skip = start - first * cols
        return whole[skip : skip + count]

    def rows(self, m: int, r0: int, r1: int, sources: Any) -> Any:
        raise NotImplementedError

    def _scale_rows(self, name: str, m: int, r0: int, r1: int, sources: Any) -> Any:
        """The rows of a per-block tensor (scales, zero points) that cover weight rows [r0, r1) of matrix m."""
        entry = self.tensors[name]
        if entry.numel == 1:
            return read_elements(entry, 0, 1, sources).reshape(1, 1)
        srows, scols = entry.shape[-2:]
        s0, s1 = r0 // self.band, -(-r1 // self.band)
        return read_elements(entry, (m * srows + s0) * scols, (s1 - s0) * scols, sources).reshape(s1 - s0, scols)

    def _value_rows(self, m: int, r0: int, r1: int, sources: Any) -> Any:
        entry = self.tensors[self.q.values]
        width = entry.shape[-1]
        return read_elements(entry, (m * entry.shape[-2] + r0) * width, (r1 - r0) * width, sources).reshape(r1 - r0, width)


class Fp8Dequant(RowDequant):
    """Hugging Face FP8: values times the inverse scale of their block, in float32 (transformers' Fp8Dequantize)."""

    def rows(self, m: int, r0: int, r1: int, sources: Any) -> Any:
        values = self._value_rows(m, r0, r1, sources)
        scales = self._scale_rows(self.q.scales, m, r0, r1, sources)
        return quant_math.dequant_fp8_rows(values, scales, self.q.block, r0, self.out.torch())


class CompressedDequant(RowDequant):
    """compressed-tensors: values unpacked (int4/int8 from int32 words, NVFP4 from bytes), then `_dequantize` in the
    scale's dtype (NVFP4: the scale over the global scale, float32), the result in the reference's dtype."""

    def rows(self, m: int, r0: int, r1: int, sources: Any) -> Any:
        import torch

        q, cols = self.q, self.q.shape[-1]
        raw = self._value_rows(m, r0, r1, sources)
        scales = self._scale_rows(q.scales, m, r0, r1, sources)
        zero_points, global_scale, result = None, None, scales.dtype
        if q.method == "ct-pack":
            values = quant_math.unpack_int_from_int32(raw, q.bits, cols)
            if q.zero_point:
                zero_points = self._packed_zero_points(q.zero_point, r0, r1, sources)
        elif q.method == "ct-nvfp4":
            values, result = quant_math.unpack_fp4(raw)[:, :cols], torch.bfloat16
            scales = scales.to(torch.bfloat16)
            assert q.global_scale is not None, "an NVFP4 weight is found with its global scale (quant_ct)"
            global_scale = read_elements(self.tensors[q.global_scale], 0, 1, sources)
        else:
            values = raw
            if q.zero_point:
                zero_points = self._scale_rows(q.zero_point, m, r0, r1, sources)
        return quant_math.dequant_scaled(values, scales, zero_points, q.block, r0, global_scale).to(result)

    def _packed_zero_points(self, name: str, r0: int, r1: int, sources: Any) -> Any:
        """The zero points (tensor `name`) of scale rows [r0 // b, ceil(r1 / b)): compressed-tensors packs them along
        dim 0, 32 / bits rows a word, so the words holding those rows are read and unpacked."""
        entry = self.tensors[name]
        groups, per_word = entry.shape[-1], 32 // self.q.bits
        s0, s1 = r0 // self.q.block[0], -(-r1 // self.q.block[0])
        w0, w1 = s0 // per_word, -(-s1 // per_word)
        words = read_elements(entry, w0 * groups, (w1 - w0) * groups, sources).reshape(w1 - w0, groups)
        unpacked = quant_math.unpack_int_from_int32(words.t().contiguous(), self.q.bits, (w1 - w0) * per_word).t()
        return unpacked[s0 - w0 * per_word : s1 - w0 * per_word]


@dataclass(eq=False)
class Mxfp4Dequant:
    """gpt-oss MXFP4 experts, one expert at a time: (E, R, G, 16) nibbles and (E, R, G) exponents to (E, G * 32, R)."""

    blocks: TensorEntry
    scales: TensorEntry
    out: DType

    def windows(self) -> Iterator[tuple[int, int]]:
        experts, rows, groups, _ = self.blocks.shape
        size = rows * groups * 32
        return ((e * size, size) for e in range(experts))

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        experts, rows, groups, width = self.blocks.shape
        size = rows * groups * 32
        parts = []
        for e in range(start // size, -(-(start + count) // size)):
            b = read_elements(self.blocks, e * rows * groups * width, rows * groups * width, sources).reshape(1, rows, groups, width)
            s = read_elements(self.scales, e * rows * groups, rows * groups, sources).reshape(1, rows, groups)
            parts.append(quant_math.dequant_mxfp4(b, s, self.out.torch()).transpose(1, 2).contiguous().reshape(-1))
        whole = torch.cat(parts) if len(parts) > 1 else parts[0]
        skip = start - (start // size) * size
        return whole[skip : skip + count]


def dequantized(ckpt: Checkpoint, scheme: Scheme, out: DType) -> Checkpoint:
    """The checkpoint with each quantized weight replaced by its dequantized value (as `out`), in its place, and the
    tensors that only served quantization (scales, zero points, activation scales, packed shapes) left out; the
    config (when carried) loses its quantization_config and names `out` as its dtype."""
    tensors: dict[str, TensorEntry] = {}
    by_values = {q.values: q for q in scheme.weights.values()}
    dropped = scheme.stored_names()
    for name, entry in ckpt.tensors.items():
        q = by_values.get(name)
        if q is None:
            if name not in dropped:
                tensors[name] = entry
            continue
        if q.method == "mxfp4":
            derived: Any = Mxfp4Dequant(ckpt.tensors[q.values], ckpt.tensors[q.scales], out)
        elif q.method == "fp8":
            derived = Fp8Dequant(q, ckpt.tensors, out)
        else:
            derived = CompressedDequant(q, ckpt.tensors, out)
        pieces = [p for n in q.reads() for p in ckpt.tensors[n].pieces]  # the files it reads
        tensors[q.name] = TensorEntry(q.name, out, q.shape, "model", pieces, (q.name,), derived=derived)
    note = f"dequantized {len(scheme.weights)} {scheme.method} weights to {out.name}"
    return dataclasses.replace(ckpt, tensors=tensors, notes=[*ckpt.notes, note], companions=_config_without(ckpt, out))


def _config_without(ckpt: Checkpoint, out: DType) -> dict[str, str | bytes]:
    config = load_config(ckpt)
    if config is None:
        return ckpt.companions
    config.pop("quantization_config", None)
    return {**ckpt.companions, "config.json": _with_dtype(config, out)}


def _with_dtype(config: dict[str, Any], dtype: DType) -> bytes:
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = dtype.name
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


# --- quantizing ----------------------------------------------------------------------------------------------------

FP8_BLOCK = (128, 128)  # the DeepSeek-V3 recipe, and transformers' FineGrainedFP8Config default
# Weights left in their precision: embeddings, the output head, norms and MoE routers are not Linear layers served in
# FP8 by the reference (transformers' FP8 loader replaces nn.Linear only, lm_head excepted).
KEEP_UNQUANTIZED = ("*embed*", "lm_head.*", "*norm*", "*.gate.weight", "*router*")


@dataclass(eq=False)
class Fp8QuantValues:
    """A weight's float8_e4m3fn values, one block row (band) of each matrix after another; a matrix whose rows are not
    a multiple of the block ends in a shorter band (its scales are a row of their own: DeepSeek's ceil-divided grid)."""

    source: TensorEntry
    block: tuple[int, int]

    @property
    def per_matrix(self) -> int:
        """Bands a matrix has: ceil(rows / block rows)."""
        return -(-self.source.shape[-2] // self.block[0])

    @property
    def bands(self) -> int:
        return math.prod(self.source.shape[:-2]) * self.per_matrix

    def windows(self) -> Iterator[tuple[int, int]]:
        rows, cols = self.source.shape[-2:]
        step = max(1, BLOCK_BYTES // max(self.block[0] * cols * 4, 1)) * self.block[0]
        for m in range(math.prod(self.source.shape[:-2])):
            for r0 in range(0, rows, step):
                yield (m * rows + r0) * cols, min(step, rows - r0) * cols

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        cols = self.source.shape[-1]
        first, last = self._band_of(start // cols), self._band_of(-(-(start + count) // cols) - 1)
        parts = [self._band(b, sources)[0].reshape(-1) for b in range(first, last + 1)]
        whole = torch.cat(parts) if len(parts) > 1 else parts[0]
        skip = start - self._band_rows(first)[0] * cols
        return whole[skip : skip + count]

    def _band_of(self, row: int) -> int:
        """The band that holds row `row` of the weight's rows, matrices one after another."""
        m, r = divmod(row, self.source.shape[-2])
        return m * self.per_matrix + r // self.block[0]

    def _band_rows(self, index: int) -> tuple[int, int]:
        """The first row (matrices one after another) and the height of band `index`."""
        rows = self.source.shape[-2]
        m, k = divmod(index, self.per_matrix)
        return m * rows + k * self.block[0], min(self.block[0], rows - k * self.block[0])

    def _band(self, index: int, sources: Any) -> tuple[Any, Any]:
        cols = self.source.shape[-1]
        row0, height = self._band_rows(index)
        data = read_elements(self.source, row0 * cols, height * cols, sources).reshape(height, cols)
        return quant_math.quant_fp8_block(data, self.block)


@dataclass(eq=False)
class Fp8QuantScales:
    """A weight's float32 inverse block scales (amax / 448), computed from its block rows one at a time."""

    values: Fp8QuantValues

    @property
    def per_band(self) -> int:
        return -(-self.values.source.shape[-1] // self.values.block[1])

    def windows(self) -> Iterator[tuple[int, int]]:
        return iter([(0, self.values.bands * self.per_band)])

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        first, last = start // self.per_band, -(-(start + count) // self.per_band)
        whole = torch.cat([self.values._band(b, sources)[1] for b in range(first, last)])
        return whole[start - first * self.per_band : start - first * self.per_band + count]


def _quantizable(entry: TensorEntry) -> bool:
    """Model weights of 2 or more dims, as the DeepSeek recipe quantizes them: a trailing partial block (dims not a
    multiple of the block) has its own scale, over the elements it has."""
    from ckpt_cli.ops.transform import matches

    if entry.role != "model" or not entry.dtype.is_float or entry.dtype.name in FP8_TYPES or len(entry.shape) < 2:
        return False
    if not entry.name.endswith(".weight") or matches(entry.name, KEEP_UNQUANTIZED):
        return False
    return entry.numel > 0


def quantized_fp8(ckpt: Checkpoint, block: tuple[int, int] = FP8_BLOCK) -> Checkpoint:
    """Model weights as FP8 block-scaled (`X.weight` float8_e4m3fn + `X.weight_scale_inv` float32), the config (when
    carried) given the quantization_config a loader needs, with every 2-d weight left as it was named as not converted."""
    tensors: dict[str, TensorEntry] = {}
    kept: list[str] = []
    fp8, f32 = BY_NAME["float8_e4m3fn"], BY_NAME["float32"]
    for name, entry in ckpt.tensors.items():
        if not _quantizable(entry):
            tensors[name] = entry
            if entry.role == "model" and len(entry.shape) == 2 and name.endswith(".weight"):
                kept.append(name.removesuffix(".weight"))
            continue
        values = Fp8QuantValues(entry, block)
        *lead, rows, cols = entry.shape
        tensors[name] = TensorEntry(name, fp8, entry.shape, "model", entry.pieces, (name,), derived=values)
        scale_name = name + "_scale_inv"
        if scale_name in ckpt.tensors:
            raise UsageError(f"{ckpt.path}: holds '{scale_name}' already; is it quantized? (inspect shows it)")
        scale_shape = (*lead, -(-rows // block[0]), -(-cols // block[1]))  # ceil: DeepSeek's grid
        tensors[scale_name] = TensorEntry(
            scale_name, f32, scale_shape, "model", list(entry.pieces), (scale_name,), derived=Fp8QuantScales(values)
        )
    count = sum(1 for t in tensors.values() if isinstance(t.derived, Fp8QuantValues))
    if not count:
        raise UsageError(f"{ckpt.path}: no weight to quantize (float weights of 2 or more dims, named *.weight)")
    qconfig = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": kept,
    }
    companions = ckpt.companions
    config = load_config(ckpt)
    if config is not None:
        config["quantization_config"] = qconfig
        companions = {**companions, "config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}
    note = f"quantized {count} weights to FP8 in blocks of {list(block)} (left {len(kept)} 2-d weights as they were)"
    return dataclasses.replace(ckpt, tensors=tensors, companions=companions, notes=[*ckpt.notes, note])


# --- choosing ------------------------------------------------------------------------------------------------------


def for_write(ckpt: Checkpoint, cast: DType | None, quantize: str | None, target: str) -> Checkpoint:
    """The checkpoint as a weights export should see it: dequantized when a quantized source is cast to a float width
    (--dtype), quantized with --quantize, else as it is (a quantized source copied as stored)."""
    scheme = scheme_of(ckpt) if may_be_quantized(ckpt) else None
    if quantize is not None:
        if quantize != "fp8":
            raise UsageError(f"--quantize {quantize!r}: ckpt quantizes to fp8 (block-scaled, 128 x 128) only")
        if scheme is not None:
            raise UsageError(f"{ckpt.path} is quantized already ({scheme.method}); --dtype bf16 dequantizes it first")
        _check_target(target)
        return quantized_fp8(ckpt)
    if scheme is None or cast is None:
        return ckpt
    _check_target(target)
    problems = shape_problems(ckpt, scheme)
    if problems:
        raise DataError(problems[0])
    return dequantized(ckpt, scheme, cast)


def _check_target(target: str) -> None:
    if target not in ("hf", "safetensors", "torch"):
        raise UsageError(f"dequantized or quantized weights are written as hf, safetensors or torch, not {target}")
