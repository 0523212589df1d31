"""compressed-tensors checkpoints (llm-compressor's output): which weights are quantized, in which of its formats.

`quantization_config` holds `config_groups`, each with `weights` arguments (num_bits, type int|float, strategy
tensor|channel|group|tensor_group|block, group_size, block_structure, symmetric) and a `format`; `ignore` lists
layers left as they were. A quantized Linear `X` is stored as (compressed_tensors/compressors/):
- naive (float-quantized, int-quantized, naive-quantized): `X.weight` float8_e4m3fn or int8, `X.weight_scale`
  (the scale itself, not its inverse), `X.weight_zero_point` when asymmetric;
- pack-quantized: `X.weight_packed` int32, 32 / num_bits values a word along the last dim, `X.weight_shape` (the
  weight's shape, int64), `X.weight_scale`, and when asymmetric `X.weight_zero_point` packed along dim 0;
- nvfp4-pack-quantized: `X.weight_packed` uint8 (two E2M1 values a byte), `X.weight_scale` float8_e4m3fn per 16
  values, `X.weight_global_scale` float32.
Activation scales (`X.input_global_scale`, `X.input_scale`, ...) carry no weight: a dequantized copy leaves them out.
"""

from __future__ import annotations

import json
from contextlib import closing
from typing import Any

from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.errors import DataError
from ckpt_cli.ops.quant_schemes import Quantized, file_of

QUANTIZED_DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")  # a naive-quantized weight's values
COMPANIONS = ("weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape", "weight_g_idx")
ACTIVATION_SUFFIXES = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point")
STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block")


class MissingCompanions(DataError):
    """Quantized weights without tensors their layout needs: each a problem of its own (verify lists them all)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        self.problems = problems


def weights(ckpt: Checkpoint, qconfig: dict[str, Any], where: str) -> dict[str, Quantized]:
    """Every quantized weight of a compressed-tensors checkpoint, by the name it dequantizes to."""
    groups = _weight_args(qconfig, where)
    tensors = ckpt.tensors
    missing = missing_companions(tensors, groups)
    if missing:
        raise MissingCompanions(missing)
    found: dict[str, Quantized] = {}
    for name in tensors:
        if not name.endswith(".weight_scale"):
            continue
        base = name[: -len(".weight_scale")]
        if base + ".weight_g_idx" in tensors:
            raise DataError(f"{where}: '{base}' is stored with activation ordering (weight_g_idx); ckpt does not dequantize it")
        if base + ".weight_packed" in tensors:
            q = _packed(base, tensors, groups, where)
        elif base + ".weight" in tensors:
            q = _naive(base, tensors, groups, where)
        else:
            raise DataError(f"{where}: '{name}' scales '{base}', which holds neither 'weight' nor 'weight_packed'")
        found[q.name] = q
    if not found:
        raise DataError(f"{where}: quant_method 'compressed-tensors' but no tensor is stored quantized (no '*.weight_scale')")
    return found


def missing_companions(tensors: dict[str, TensorEntry], groups: list[dict[str, Any]]) -> list[str]:
    """Each quantized weight that lacks a tensor its layout stores (compressed-tensors' `compression_param_names`):
    its values, `weight_scale`, `weight_shape` (int32-packed), `weight_global_scale` (NVFP4), `weight_zero_point`
    (asymmetric), `weight_g_idx` (activation order 'group'). Without one a weight dequantizes to garbage or not at all."""
    found: dict[str, TensorEntry] = {}  # a weight's base name: a tensor of it, its values where stored
    for name, entry in tensors.items():
        base, _, leaf = name.rpartition(".")
        values = leaf == "weight_packed" or (leaf == "weight" and entry.dtype.name in QUANTIZED_DTYPES)
        if values or (leaf in COMPANIONS and base):
            found[base] = entry if values or base not in found else found[base]
    out = []
    for base, entry in found.items():
        layout, need = _layout(base, tensors, groups)
        missing = [f"'{base}.{n}'" for n in need if f"{base}.{n}" not in tensors]
        if missing:
            out.append(f"{file_of(entry)}: {layout} weight '{base}' has no {' or '.join(missing)}; it cannot be dequantized")
    return out


def _layout(base: str, tensors: dict[str, TensorEntry], groups: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The compressed-tensors format a weight is stored in and the tensors it needs (the values themselves included),
    as its compressor's `compression_param_names` has them for the config groups that can describe it."""
    packed, plain = tensors.get(base + ".weight_packed"), tensors.get(base + ".weight")
    if packed is not None and packed.dtype.name == "uint8":
        fits = [g for g in groups if g["type"] == "float" and g["num_bits"] == 4]
        mx = bool(fits) and all(g.get("format") == "mxfp4-pack-quantized" for g in fits)
        layout, need = (
            ("mxfp4-pack-quantized", ["weight_scale"]) if mx else ("nvfp4-pack-quantized", ["weight_scale", "weight_global_scale"])
        )
        static_input = bool(fits) and all(isinstance(g["input"], dict) and g["input"].get("dynamic") is False for g in fits)
    elif packed is not None:
        layout, need = "pack-quantized", ["weight_scale", "weight_shape"]
        fits = [g for g in groups if g["type"] == "int"]
        static_input = bool(fits) and all(isinstance(g["input"], dict) and g["input"].get("strategy") == "tensor_group" for g in fits)
    elif plain is not None:
        layout, need = "naive-quantized", ["weight_scale"] if plain.dtype.name in QUANTIZED_DTYPES else []
        fits = [g for g in groups if g["num_bits"] == 8 and g["type"] == ("float" if plain.dtype.is_float else "int")]
        static_input = False
    else:  # scales stored, values not: the config groups' format says which name they would have
        packs = all(str(g.get("format")).endswith("pack-quantized") for g in groups)
        return "quantized", ["weight_packed" if packs else "weight"]
    if fits and all(g.get("symmetric", True) is False for g in fits):
        need.append("weight_zero_point")
    if fits and all(g.get("actorder") in ("group", True) for g in fits):
        need.append("weight_g_idx")
    if static_input:
        need.append("input_global_scale")
    return layout, need


def _weight_args(qconfig: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The distinct `weights` arguments of the config groups (checked: types and ranges)."""
    groups = qconfig.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise DataError(f"{where}: compressed-tensors quantization_config has no config_groups")
    found: list[dict[str, Any]] = []
    for key, group in groups.items():
        args = group.get("weights") if isinstance(group, dict) else None
        if args is None:
            continue  # activations only
        if not isinstance(args, dict):
            raise DataError(f"{where}: config_groups.{key}.weights must be an object")
        _check_args(args, f"{where}: config_groups.{key}.weights")
        args = {**args, "format": group.get("format") or qconfig.get("format"), "input": group.get("input_activations")}
        if args not in found:
            found.append(args)
    return found


def _check_args(args: dict[str, Any], where: str) -> None:
    bits, strategy = args.get("num_bits"), args.get("strategy")
    if args.get("type") not in ("int", "float"):
        raise DataError(f"{where}.type must be int or float, got {args.get('type')!r}")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise DataError(f"{where}.num_bits must be 1..8, got {bits!r}")
    if strategy not in STRATEGIES:
        raise DataError(f"{where}.strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    size = args.get("group_size")
    if strategy in ("group", "tensor_group") and not (isinstance(size, int) and 0 < size <= 1 << 20):
        raise DataError(f"{where}.group_size must be a positive integer for strategy {strategy}, got {size!r}")
    block = args.get("block_structure")
    if strategy == "block" and not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and 0 < v <= 1 << 20 for v in block)
    ):
        raise DataError(f"{where}.block_structure must be two positive integers, got {block!r}")


def _block(args: dict[str, Any], rows: int, cols: int) -> tuple[int, int]:
    """The rows x columns one scale covers under the arguments' strategy."""
    strategy = args["strategy"]
    if strategy == "tensor":
        return max(rows, 1), max(cols, 1)
    if strategy == "channel":
        return 1, max(cols, 1)
    if strategy == "block":
        return args["block_structure"][0], args["block_structure"][1]
    return 1, args["group_size"]


def _choose(groups: list[dict[str, Any]], fits: Any, base: str, scale: TensorEntry, shape: tuple[int, int], where: str) -> dict[str, Any]:
    """The config group whose arguments describe this layer's tensors (several could: the one that fits them)."""
    matching = [g for g in groups if fits(g)]
    if len(matching) != 1:
        what = "no config group describes" if not matching else "several config groups describe"
        seen = f"'{scale.name}' is {list(scale.shape)} for a {shape[0]} x {shape[1]} weight"
        raise DataError(f"{where}: {what} the quantized tensors of '{base}' ({seen})")
    args = matching[0]
    if args["strategy"] in ("group", "tensor_group") and shape[1] % args["group_size"]:
        raise DataError(f"{where}: '{base}' has {shape[1]} columns, not a multiple of its group size {args['group_size']}")
    return args


def _scale_fits(scale: TensorEntry, args: dict[str, Any], rows: int, cols: int) -> bool:
    block = _block(args, rows, cols)
    want = (-(-rows // block[0]), -(-cols // block[1]))
    return scale.shape == want or (args["strategy"] == "tensor" and scale.numel == 1)


def _naive(base: str, tensors: dict[str, TensorEntry], groups: list[dict[str, Any]], where: str) -> Quantized:
    values, scale = tensors[base + ".weight"], tensors[base + ".weight_scale"]
    if values.dtype.name not in QUANTIZED_DTYPES or len(values.shape) != 2:
        raise DataError(
            f"{where}: '{base}.weight' has a scale but is {values.dtype.name} {list(values.shape)}, not a 2-d int8 or FP8 weight"
        )
    rows, cols = values.shape
    kind = "float" if values.dtype.is_float else "int"
    args = _choose(
        groups, lambda g: g["type"] == kind and g["num_bits"] == 8 and _scale_fits(scale, g, rows, cols), base, scale, (rows, cols), where
    )
    zero = base + ".weight_zero_point" if base + ".weight_zero_point" in tensors else None
    return Quantized(base + ".weight", "ct-naive", values.name, scale.name, (rows, cols), _block(args, rows, cols), zero,
                     unused=_unused(base, tensors))  # fmt: skip


def _packed(base: str, tensors: dict[str, TensorEntry], groups: list[dict[str, Any]], where: str) -> Quantized:
    packed, scale = tensors[base + ".weight_packed"], tensors[base + ".weight_scale"]
    if len(packed.shape) != 2:
        raise DataError(f"{where}: '{packed.name}' is {list(packed.shape)}; ckpt dequantizes 2-d packed weights")
    if packed.dtype.name == "uint8":  # NVFP4
        rows, cols = packed.shape[0], packed.shape[1] * 2
        fits = lambda g: g["type"] == "float" and g["num_bits"] == 4 and _scale_fits(scale, g, rows, cols)  # noqa: E731
        args = _choose(groups, fits, base, scale, (rows, cols), where)
        global_scale = base + ".weight_global_scale"
        if global_scale not in tensors or tensors[global_scale].numel != 1:
            raise DataError(f"{where}: NVFP4 weight '{base}' has no one-element 'weight_global_scale'")
        return Quantized(base + ".weight", "ct-nvfp4", packed.name, scale.name, (rows, cols), _block(args, rows, cols),
                         global_scale=global_scale, bits=4, unused=_unused(base, tensors))  # fmt: skip
    if packed.dtype.name != "int32":
        raise DataError(f"{where}: '{packed.name}' is {packed.dtype.name}; pack-quantized weights are int32 words")
    rows, cols = _packed_shape(base, tensors, where)
    if rows != packed.shape[0]:
        raise DataError(f"{where}: '{base}.weight_shape' says {rows} rows, but '{packed.name}' holds {packed.shape[0]}")
    args = _choose(groups, lambda g: g["type"] == "int" and _scale_fits(scale, g, rows, cols), base, scale, (rows, cols), where)
    bits = args["num_bits"]
    if bits not in (4, 8):
        raise DataError(f"{where}: '{base}' packs {bits}-bit values; ckpt unpacks 4- and 8-bit ones")
    if packed.shape != (rows, -(-cols * bits // 32)):
        raise DataError(
            f"{where}: '{packed.name}' is {list(packed.shape)}, but {rows} x {cols} {bits}-bit values need {[rows, -(-cols * bits // 32)]}"
        )
    zero = base + ".weight_zero_point" if base + ".weight_zero_point" in tensors else None
    return Quantized(base + ".weight", "ct-pack", packed.name, scale.name, (rows, cols), _block(args, rows, cols), zero,
                     bits=bits, unused=_unused(base, tensors))  # fmt: skip


def _packed_shape(base: str, tensors: dict[str, TensorEntry], where: str) -> tuple[int, int]:
    """`X.weight_shape`: two integers, read now (the packed width only bounds the column count)."""
    from ckpt_cli.core.reading import SourceFiles, read_elements

    entry = tensors.get(base + ".weight_shape")
    if entry is None or entry.numel != 2 or entry.dtype.is_float:
        raise DataError(f"{where}: pack-quantized weight '{base}' has no 2-element integer 'weight_shape'")
    with closing(SourceFiles()) as sources:
        rows, cols = (int(v) for v in read_elements(entry, 0, 2, sources).tolist())
    if not (0 < rows <= 1 << 40 and 0 < cols <= 1 << 40):
        raise DataError(f"{where}: '{entry.name}' says {json.dumps([rows, cols])}, not a weight shape")
    return rows, cols


def _unused(base: str, tensors: dict[str, TensorEntry]) -> tuple[str, ...]:
    return tuple(n for n in (base + ".weight_shape", *(f"{base}.{s}" for s in ACTIVATION_SUFFIXES)) if n in tensors)
