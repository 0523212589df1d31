"""Quantized checkpoints: which tensors are quantized and how, what that makes of parameter counts, and what a
quantized checkpoint must hold (views that dequantize or quantize: ops/quant_views.py; arithmetic: core/quant_math.py).

Recognised layouts (the Hugging Face names; the config's `quantization_config` says the method and block size, the
tensors say which weights are quantized):
- FP8 block-scaled (`quant_method: fp8`, DeepSeek-V3 and Qwen3 FP8 releases): `X.weight` float8_e4m3fn and
  `X.weight_scale_inv` one float32 (or E8M0) scale per block, ceil(rows / bm) x ceil(cols / bn) of them.
- MXFP4 (`quant_method: mxfp4`, gpt-oss experts): `X_blocks` uint8 (..., G, 16), two E2M1 values a byte, and
  `X_scales` uint8 (..., G) E8M0 exponents; the weight `X` is (E, G * 32, R), experts' last two dims swapped, as
  transformers' loader lays it out.
- compressed-tensors (`quant_method: compressed-tensors`, llm-compressor's output): ops/quant_ct.py.
"""

from __future__ import annotations

import math
from typing import Any

from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.reading import read_elements
from ckpt_cli.errors import DataError
from ckpt_cli.ops import quant_ct
from ckpt_cli.ops.quant_schemes import Quantized, Scheme, file_of, load_config

FP8_TYPES = ("float8_e4m3fn", "float8_e5m2")
DEEPSEEK_BLOCK = (128, 128)  # the block of a scale grid that says none (the DeepSeek-V3 recipe)


def scheme_of(ckpt: Checkpoint) -> Scheme | None:
    """The checkpoint's quantization, from its config and tensors; None when nothing is quantized."""
    config = load_config(ckpt) or {}
    qconfig = config.get("quantization_config")
    qconfig = qconfig if isinstance(qconfig, dict) else {}
    method = qconfig.get("quant_method")
    if method == "compressed-tensors":
        where = _config_shown(ckpt)
        return Scheme(method, None, "config.json", quant_ct.weights(ckpt, qconfig, where), qconfig)
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
            raise DataError(f"{_config_shown(ckpt)}: quant_method {method!r} but no tensor stored that way")
        return None
    found = "+".join(sorted({q.method for q in weights.values()}))
    if method is not None and method != found:
        raise DataError(f"{_config_shown(ckpt)}: quant_method {method!r} but the tensors are {found}")
    return Scheme(found, block, "config.json" if method else "tensor names", weights, qconfig)


def _config_shown(ckpt: Checkpoint) -> str:
    """config.json as an error names it: its path, or its name where a view rewrote it (bytes)."""
    path = ckpt.companions.get("config.json")
    return path if isinstance(path, str) else "config.json"


def _block_size(value: Any, ckpt: Checkpoint) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and 0 < v <= 1 << 20 for v in value)):
        raise DataError(f"{_config_shown(ckpt)}: weight_block_size must be two positive integers, got {value!r}")
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
    grid = tuple(scale.shape[-2:]) if len(scale.shape) >= 2 else ()
    exact = (rows // grid[0], cols // grid[1]) if len(grid) == 2 and all(grid) and not rows % grid[0] and not cols % grid[1] else None
    # DeepSeek's ceil-divided grid, a trailing partial block with a scale of its own (V3's kv_a_proj_with_mqa: [576, 7168],
    # scales [5, 56]); a grid both read it as and as whole blocks of another size is not guessed at
    deepseek = DEEPSEEK_BLOCK if grid == (-(-rows // DEEPSEEK_BLOCK[0]), -(-cols // DEEPSEEK_BLOCK[1])) else None
    if exact is not None and deepseek is not None and exact != deepseek:
        raise DataError(
            f"{scale.name}: shape {list(scale.shape)} fits {weight.name} {list(weight.shape)} in blocks of {list(exact)} and of "
            f"{list(deepseek)} with partial edge blocks; the block size is in config.json (weight_block_size)"
        )
    found = exact or deepseek
    if found is not None:
        return found
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
        if q.method != "mxfp4" and scale.numel != 1:
            values = ckpt.tensors[q.values]
            *lead, rows, cols = q.shape
            want = (*lead, -(-rows // q.block[0]), -(-cols // q.block[1]))
            if scale.shape != want:
                problems.append(
                    f"{file_of(scale)}: scales '{q.scales}' have shape {list(scale.shape)}, but '{q.values}' "
                    f"{list(values.shape)} in blocks of {list(q.block)} needs {list(want)}"
                )
        if q.zero_point is not None:
            zero = ckpt.tensors[q.zero_point]
            want = scale.shape  # one per scale; packed ones 32 / bits rows a word, along dim 0
            if q.method == "ct-pack" and len(want) == 2:
                want = (-(-want[0] // (32 // q.bits)), want[1])
            if zero.shape != want:
                shapes = f"have shape {list(zero.shape)}; its scales need {list(want)}"
                problems.append(f"{file_of(zero)}: zero points '{q.zero_point}' {shapes}")
    return problems


def true_params(ckpt: Checkpoint, names: set[str], scheme: Scheme | None) -> int:
    """Parameters of the model weights among `names`: scales are not parameters, a packed 4-bit byte holds two."""
    counts = param_counts(ckpt, scheme)
    return sum(counts.get(n, ckpt.tensors[n].numel) for n in names)


def param_counts(ckpt: Checkpoint, scheme: Scheme | None) -> dict[str, int]:
    """The parameters of each stored tensor of a quantized checkpoint (`scheme`: scheme_of's) that differ from its
    element count."""
    if scheme is None:
        return {}
    counts = {n: 0 for n in scheme.stored_names()}
    counts.update({q.values: math.prod(q.shape) for q in scheme.weights.values()})
    return counts


def may_be_quantized(ckpt: Checkpoint) -> bool:
    """Cheap: whether scheme_of can find anything (a config, or a tensor of a quantized dtype)."""
    return "config.json" in ckpt.companions or any(t.dtype.name in FP8_TYPES or t.dtype.name == "uint8" for t in ckpt.tensors.values())


# --- checking ------------------------------------------------------------------------------------------------------


def problems(ckpt: Checkpoint, deep: bool) -> list[str]:
    """What a quantized checkpoint promises and does not keep: every quantized weight has its scales, of the shape
    its block size gives; with `deep`, every scale finite and positive (an E8M0 byte 255 is NaN)."""
    if not may_be_quantized(ckpt):
        return []
    try:
        scheme = scheme_of(ckpt)
    except DataError as exc:  # compressed-tensors' missing companions: one problem each
        return list(getattr(exc, "problems", None) or [str(exc)])
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
            out.append(f"{file_of(entry)}: '{name}' scales '{name[: -len('_scale_inv')]}', which is not stored as FP8")
        elif name.endswith("_scales") and (name[:-7] + "_blocks") in ckpt.tensors:
            out.append(f"{file_of(entry)}: '{name}' has no MXFP4 blocks of the matching shape")
        elif scheme is not None and scheme.method == "fp8" and entry.dtype.name in FP8_TYPES and name.endswith(".weight"):
            out.append(f"{file_of(entry)}: FP8 weight '{name}' has no '{name}_scale_inv'; a loader would use its values unscaled")
        elif scheme is not None and "mxfp4" in scheme.method and name.endswith("_blocks") and entry.dtype.name == "uint8":
            out.append(f"{file_of(entry)}: MXFP4 blocks '{name}' have no '{name[:-7]}_scales'")
    return out


def _scale_values(ckpt: Checkpoint, scheme: Scheme) -> list[str]:
    from ckpt_cli.core.reading import SourceFiles

    out = []
    sources = SourceFiles()
    try:
        for q in scheme.weights.values():
            for name in (q.scales, q.global_scale):
                if name is not None:
                    out += _bad_scales(ckpt.tensors[name], q.name, sources)
    except DataError as exc:
        out.append(str(exc))
    finally:
        sources.close()
    return out


def _bad_scales(entry: TensorEntry, weight: str, sources: Any) -> list[str]:
    import torch

    scales = read_elements(entry, 0, entry.numel, sources)
    if scales.dtype == torch.uint8:
        bad, what = int((scales == 255).sum()), "E8M0 NaN (255)"
    else:
        as_float = scales.to(torch.float32)
        bad, what = int((~torch.isfinite(as_float) | (as_float <= 0)).sum()), "not finite or not positive"
    if not bad:
        return []
    return [f"{file_of(entry)}: scales '{entry.name}' hold {bad} values {what}; the weight '{weight}' dequantizes wrong"]
