"""Quantized checkpoints: which tensors are quantized and how, and views that dequantize or quantize them as they
stream (the arithmetic is core/quant_math.py).

Recognised layouts (the Hugging Face names; the config's `quantization_config` says the method and block size, the
tensors say which weights are quantized):
- FP8 block-scaled (`quant_method: fp8`, DeepSeek-V3 and Qwen3 FP8 releases): `X.weight` float8_e4m3fn and
  `X.weight_scale_inv` one float32 (or E8M0) scale per block, ceil(rows / bm) x ceil(cols / bn) of them.
- MXFP4 (`quant_method: mxfp4`, gpt-oss experts): `X_blocks` uint8 (..., G, 16), two E2M1 values a byte, and
  `X_scales` uint8 (..., G) E8M0 exponents; the weight `X` is (E, G * 32, R), experts' last two dims swapped, as
  transformers' loader lays it out.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core import quant_math, structured
from ckpt_cli.core.dtypes import BY_NAME, DType
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.paths import read_regular_text
from ckpt_cli.core.reading import BLOCK_BYTES, read_elements
from ckpt_cli.errors import DataError, UsageError

FP8_TYPES = ("float8_e4m3fn", "float8_e5m2")
DEQUANTIZED_DEFAULT = BY_NAME["bfloat16"]


@dataclass(frozen=True)
class Quantized:
    """One quantized weight: the stored tensors it is made from and the name and shape it dequantizes to."""

    name: str
    method: str  # "fp8" or "mxfp4"
    values: str  # the stored values: X.weight (fp8) or X_blocks (mxfp4)
    scales: str
    shape: tuple[int, ...]
    block: tuple[int, int]


@dataclass
class Scheme:
    """What a checkpoint's quantization is: method, block size, where it was read, and each quantized weight."""

    method: str
    block: tuple[int, int] | None
    source: str  # "config.json" or "tensor names"
    weights: dict[str, Quantized] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # the config's quantization_config, as written

    def stored_names(self) -> set[str]:
        return {n for q in self.weights.values() for n in (q.values, q.scales)}

    def summary(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "block_size": list(self.block) if self.block else None,
            "from": self.source,
            "quantized_tensors": len(self.weights),
            "example": next(iter(self.weights), None),
        }


def load_config(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The model's config.json kept beside the weights (an hf folder's), parsed; None when there is none."""
    path = ckpt.companions.get("config.json")
    if path is None:
        return None
    if isinstance(path, bytes):  # already rewritten by a view
        return json.loads(path)
    try:
        text = read_regular_text(Path(path), max_bytes=16 << 20)
    except OSError as exc:
        raise DataError(f"{path}: not readable ({exc})") from exc
    doc = structured.load_json(text, path, DataError)
    if not isinstance(doc, dict):
        raise DataError(f"{path}: not a JSON object")
    return doc


def scheme_of(ckpt: Checkpoint) -> Scheme | None:
    """The checkpoint's quantization, from its config and tensors; None when nothing is quantized."""
    config = load_config(ckpt) or {}
    qconfig = config.get("quantization_config")
    qconfig = qconfig if isinstance(qconfig, dict) else {}
    method = qconfig.get("quant_method")
    block = _block_size(qconfig.get("weight_block_size"), ckpt)
    tensors = ckpt.tensors
    weights: dict[str, Quantized] = {}
    for name, entry in tensors.items():
        if entry.dtype.name in FP8_TYPES and name.endswith(".weight") and (scale := tensors.get(name + "_scale_inv")):
            weights[name] = Quantized(name, "fp8", name, scale.name, entry.shape, _fp8_block(entry, scale, block))
        elif name.endswith("_blocks") and entry.dtype.name == "uint8" and (scale := tensors.get(name[:-7] + "_scales")):
            weights[name[:-7]] = _mxfp4(name[:-7], entry, scale)
    if not weights:
        if method in ("fp8", "mxfp4"):
            raise DataError(f"{ckpt.companions['config.json']}: quant_method {method!r} but no tensor stored that way")
        return None
    found = "+".join(sorted({q.method for q in weights.values()}))
    if method is not None and method != found:
        raise DataError(f"{ckpt.companions.get('config.json')}: quant_method {method!r} but the tensors are {found}")
    return Scheme(found, block, "config.json" if method else "tensor names", weights, qconfig)


def _block_size(value: Any, ckpt: Checkpoint) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and 0 < v <= 1 << 20 for v in value)):
        raise DataError(f"{ckpt.companions.get('config.json')}: weight_block_size must be two positive integers, got {value!r}")
    return value[0], value[1]


def _fp8_block(weight: TensorEntry, scale: TensorEntry, block: tuple[int, int] | None) -> tuple[int, int]:
    """The block a weight's scales cover: the config's, else what the shapes say (one scale a tensor: the whole)."""
    if len(weight.shape) < 2:
        raise DataError(f"{weight.name}: an FP8 weight with scales must have at least 2 dims, has shape {list(weight.shape)}")
    rows, cols = weight.shape[-2:]
    if scale.numel == 1:
        return rows, cols
    if block is not None:
        return block
    if len(scale.shape) >= 2 and scale.shape[-2] and scale.shape[-1] and not rows % scale.shape[-2] and not cols % scale.shape[-1]:
        return rows // scale.shape[-2], cols // scale.shape[-1]
    raise DataError(
        f"{scale.name}: shape {list(scale.shape)} does not divide {weight.name} {list(weight.shape)}; the block size is in config.json"
    )


def _mxfp4(name: str, blocks: TensorEntry, scales: TensorEntry) -> Quantized:
    if len(blocks.shape) != 4 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]:
        raise DataError(
            f"{blocks.name}: MXFP4 blocks must be (experts, rows, groups, 16) with scales (experts, rows, groups); "
            f"got {list(blocks.shape)} and {list(scales.shape)}"
        )
    experts, rows, groups, _ = blocks.shape
    return Quantized(name, "mxfp4", blocks.name, scales.name, (experts, groups * 32, rows), (1, 32))


def shape_problems(ckpt: Checkpoint, scheme: Scheme) -> list[str]:
    """What a quantized checkpoint promises and does not keep: scales of the shape the block size gives."""
    problems = []
    for q in scheme.weights.values():
        scale = ckpt.tensors[q.scales]
        if q.method == "fp8" and scale.numel != 1:
            values = ckpt.tensors[q.values]
            *lead, rows, cols = values.shape
            want = (*lead, -(-rows // q.block[0]), -(-cols // q.block[1]))
            if scale.shape != want:
                problems.append(
                    f"{_file(scale)}: scales '{q.scales}' have shape {list(scale.shape)}, but '{q.values}' "
                    f"{list(values.shape)} in blocks of {list(q.block)} needs {list(want)}"
                )
    return problems


def true_params(ckpt: Checkpoint, names: set[str]) -> int:
    """Parameters of the model weights among `names`: scales are not parameters, a packed 4-bit byte holds two."""
    counts = param_counts(ckpt)
    return sum(counts.get(n, ckpt.tensors[n].numel) for n in names)


def param_counts(ckpt: Checkpoint) -> dict[str, int]:
    """The parameters of each stored tensor of a quantized checkpoint that differ from its element count."""
    scheme = scheme_of(ckpt) if may_be_quantized(ckpt) else None
    if scheme is None:
        return {}
    counts = {q.scales: 0 for q in scheme.weights.values()}
    counts.update({q.values: 2 * ckpt.tensors[q.values].numel for q in scheme.weights.values() if q.method == "mxfp4"})
    return counts


# --- dequantizing --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Fp8Dequant:
    """An FP8 weight times its block scales, read a few block rows at a time."""

    values: TensorEntry
    scales: TensorEntry
    block: tuple[int, int]
    out: DType

    def windows(self) -> Iterator[tuple[int, int]]:
        rows, cols = self.values.shape[-2:]
        step = max(self.block[0], BLOCK_BYTES // max(cols * 4, 1) // self.block[0] * self.block[0])
        for m in range(math.prod(self.values.shape[:-2])):
            for r0 in range(0, rows, step):
                yield (m * rows + r0) * cols, min(step, rows - r0) * cols

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        rows, cols = self.values.shape[-2:]
        srows, scols = (1, 1) if self.scales.numel == 1 else self.scales.shape[-2:]
        first, last = start // cols, -(-(start + count) // cols)
        parts, row = [], first
        while row < last:  # spans of rows within one matrix
            m, r0 = divmod(row, rows)
            r1 = min(rows, last - m * rows)
            q = read_elements(self.values, (m * rows + r0) * cols, (r1 - r0) * cols, sources).reshape(r1 - r0, cols)
            if self.scales.numel == 1:
                s = read_elements(self.scales, 0, 1, sources)
            else:
                s0, s1 = r0 // self.block[0], -(-r1 // self.block[0])
                s = read_elements(self.scales, (m * srows + s0) * scols, (s1 - s0) * scols, sources).reshape(s1 - s0, scols)
            parts.append(quant_math.dequant_fp8_rows(q, s, self.block, r0, self.out.torch()).reshape(-1))
            row = m * rows + r1
        whole = torch.cat(parts) if len(parts) > 1 else parts[0]
        skip = start - first * cols
        return whole[skip : skip + count]


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
    """The checkpoint with each quantized weight replaced by its dequantized value (as `out`), in its place; the
    config (when carried) loses its quantization_config and names `out` as its dtype."""
    tensors: dict[str, TensorEntry] = {}
    by_values = {q.values: q for q in scheme.weights.values()}
    stored = scheme.stored_names()
    for name, entry in ckpt.tensors.items():
        q = by_values.get(name)
        if q is None:
            if name not in stored:
                tensors[name] = entry
            continue
        values, scales = ckpt.tensors[q.values], ckpt.tensors[q.scales]
        if q.method == "fp8":
            derived: Any = Fp8Dequant(values, scales, q.block, out)
        else:
            derived = Mxfp4Dequant(values, scales, out)
        pieces = [*values.pieces, *scales.pieces]  # the files it reads
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


def check_target(ckpt: Checkpoint, target: str) -> None:
    if target not in ("hf", "safetensors", "torch"):
        raise UsageError(f"dequantized or quantized weights are written as hf, safetensors or torch, not {target}")


# --- quantizing ----------------------------------------------------------------------------------------------------

FP8_BLOCK = (128, 128)  # the DeepSeek-V3 recipe, and transformers' FineGrainedFP8Config default
# Weights left in their precision: embeddings, the output head, norms and MoE routers are not Linear layers served in
# FP8 by the reference (transformers' FP8 loader replaces nn.Linear only, lm_head excepted).
KEEP_UNQUANTIZED = ("*embed*", "lm_head.*", "*norm*", "*.gate.weight", "*router*")


@dataclass(eq=False)
class Fp8QuantValues:
    """A weight's float8_e4m3fn values, one block row of each matrix after another."""

    source: TensorEntry
    block: tuple[int, int]

    def windows(self) -> Iterator[tuple[int, int]]:
        rows, cols = self.source.shape[-2:]
        band = self.block[0] * cols
        step = max(1, BLOCK_BYTES // max(band * 4, 1)) * band
        total = self.source.numel
        return ((start, min(step, total - start)) for start in range(0, total, step))

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        band = self.block[0] * self.source.shape[-1]
        first, last = start // band, -(-(start + count) // band)
        parts = [self._band(b, sources)[0].reshape(-1) for b in range(first, last)]
        whole = torch.cat(parts) if len(parts) > 1 else parts[0]
        return whole[start - first * band : start - first * band + count]

    def _band(self, index: int, sources: Any) -> tuple[Any, Any]:
        rows, cols = self.source.shape[-2:]
        band = self.block[0] * cols
        data = read_elements(self.source, index * band, band, sources).reshape(self.block[0], cols)
        return quant_math.quant_fp8_block(data, self.block)


@dataclass(eq=False)
class Fp8QuantScales:
    """A weight's float32 inverse block scales (amax / 448), computed from its block rows one at a time."""

    values: Fp8QuantValues

    def windows(self) -> Iterator[tuple[int, int]]:
        rows, cols = self.values.source.shape[-2:]
        per_band = cols // self.values.block[1]
        bands = self.values.source.numel // (self.values.block[0] * cols)
        return iter([(0, bands * per_band)])

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        per_band = self.values.source.shape[-1] // self.values.block[1]
        first, last = start // per_band, -(-(start + count) // per_band)
        whole = torch.cat([self.values._band(b, sources)[1] for b in range(first, last)])
        return whole[start - first * per_band : start - first * per_band + count]


def _quantizable(entry: TensorEntry, block: tuple[int, int]) -> bool:
    """As the reference quantizes: model weights of 2 or more dims that the block tiles exactly (others pass through)."""
    from ckpt_cli.ops.transform import matches

    if entry.role != "model" or not entry.dtype.is_float or entry.dtype.name in FP8_TYPES or len(entry.shape) < 2:
        return False
    if not entry.name.endswith(".weight") or matches(entry.name, KEEP_UNQUANTIZED):
        return False
    return entry.shape[-2] % block[0] == 0 and entry.shape[-1] % block[1] == 0 and entry.numel > 0


def quantized_fp8(ckpt: Checkpoint, block: tuple[int, int] = FP8_BLOCK) -> Checkpoint:
    """Model weights as FP8 block-scaled (`X.weight` float8_e4m3fn + `X.weight_scale_inv` float32), the config (when
    carried) given the quantization_config a loader needs, with every 2-d weight left as it was named as not converted."""
    tensors: dict[str, TensorEntry] = {}
    kept: list[str] = []
    fp8, f32 = BY_NAME["float8_e4m3fn"], BY_NAME["float32"]
    for name, entry in ckpt.tensors.items():
        if not _quantizable(entry, block):
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
        scale_shape = (*lead, rows // block[0], cols // block[1])
        tensors[scale_name] = TensorEntry(
            scale_name, f32, scale_shape, "model", list(entry.pieces), (scale_name,), derived=Fp8QuantScales(values)
        )
    count = sum(1 for t in tensors.values() if isinstance(t.derived, Fp8QuantValues))
    if not count:
        raise UsageError(f"{ckpt.path}: no weight to quantize (2-d float weights whose dims are multiples of {list(block)})")
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


def for_write(ckpt: Checkpoint, cast: DType | None, quantize: str | None, target: str) -> Checkpoint:
    """The checkpoint as a weights export should see it: dequantized when a quantized source is cast to a float width
    (--dtype), quantized with --quantize, else as it is (a quantized source copied as stored)."""
    scheme = scheme_of(ckpt) if may_be_quantized(ckpt) else None
    if quantize is not None:
        if quantize != "fp8":
            raise UsageError(f"--quantize {quantize!r}: ckpt quantizes to fp8 (block-scaled, 128 x 128) only")
        if scheme is not None:
            raise UsageError(f"{ckpt.path} is quantized already ({scheme.method}); --dtype bf16 dequantizes it first")
        check_target(ckpt, target)
        return quantized_fp8(ckpt)
    if scheme is None or cast is None:
        return ckpt
    check_target(ckpt, target)
    problems = shape_problems(ckpt, scheme)
    if problems:
        raise DataError(problems[0])
    return dequantized(ckpt, scheme, cast)


def may_be_quantized(ckpt: Checkpoint) -> bool:
    return "config.json" in ckpt.companions or any(t.dtype.name in FP8_TYPES or t.dtype.name == "uint8" for t in ckpt.tensors.values())


# --- checking ------------------------------------------------------------------------------------------------------


def problems(ckpt: Checkpoint, deep: bool) -> list[str]:
    """What a quantized checkpoint promises and does not keep: every quantized weight has its scales, of the shape
    its block size gives; with `deep`, every scale finite and positive (an E8M0 byte 255 is NaN)."""
    if not may_be_quantized(ckpt):
        return []
    try:
        scheme = scheme_of(ckpt)
    except DataError as exc:
        return [str(exc)]
    found = _unpaired(ckpt, scheme)
    if scheme is None:
        return found
    found += shape_problems(ckpt, scheme)
    if deep and not found:
        found += _scale_values(ckpt, scheme)
    return found


def _unpaired(ckpt: Checkpoint, scheme: Scheme | None) -> list[str]:
    paired = scheme.stored_names() if scheme is not None else set()
    out = []
    for name, entry in ckpt.tensors.items():
        if name in paired:
            continue
        if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in ckpt.tensors:
            out.append(f"{_file(entry)}: '{name}' scales '{name[: -len('_scale_inv')]}', which is not stored as FP8")
        elif name.endswith("_scales") and (name[:-7] + "_blocks") in ckpt.tensors:
            out.append(f"{_file(entry)}: '{name}' has no MXFP4 blocks of the matching shape")
        elif scheme is not None and scheme.method == "fp8" and entry.dtype.name in FP8_TYPES and name.endswith(".weight"):
            out.append(f"{_file(entry)}: FP8 weight '{name}' has no '{name}_scale_inv'; a loader would use its values unscaled")
        elif scheme is not None and "mxfp4" in scheme.method and name.endswith("_blocks") and entry.dtype.name == "uint8":
            out.append(f"{_file(entry)}: MXFP4 blocks '{name}' have no '{name[:-7]}_scales'")
    return out


def _scale_values(ckpt: Checkpoint, scheme: Scheme) -> list[str]:
    import torch

    from ckpt_cli.core.reading import SourceFiles

    out = []
    sources = SourceFiles()
    try:
        for q in scheme.weights.values():
            entry = ckpt.tensors[q.scales]
            scales = read_elements(entry, 0, entry.numel, sources)
            if scales.dtype == torch.uint8:
                bad = int((scales == 255).sum())
                what = "E8M0 NaN (255)"
            else:
                as_float = scales.to(torch.float32)
                bad = int((~torch.isfinite(as_float) | (as_float <= 0)).sum())
                what = "not finite or not positive"
            if bad:
                out.append(f"{_file(entry)}: scales '{q.scales}' hold {bad} values {what}; the weight '{q.name}' dequantizes wrong")
    except DataError as exc:
        out.append(str(exc))
    finally:
        sources.close()
    return out


def _file(entry: TensorEntry) -> str:
    return entry.pieces[0].data.path if entry.pieces else entry.name
