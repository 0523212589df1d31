"""`--adapter DIR`: a PEFT LoRA adapter (formats/hf/adapter.py reads it) merged into its base as the base streams.

Each targeted weight W becomes a computed tensor (`derived=`), read a band of rows at a time, as peft's
`merge_and_unload` computes it (peft/tuners/lora/layer.py `Linear.get_delta_weight`, variants.py `DoraLinearVariant`,
dora.py `DoraLinearLayer.get_weight_norm`), in float32 (peft loads adapter weights as float32:
`autocast_adapter_dtype`) and cast back to the base's dtype:
- LoRA, rsLoRA: W + (B @ A) * scale, scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora;
- DoRA: delta = (B @ A) * scale, norm = the L2 norm of each row of W + delta, W' = (magnitude / norm)[:, None] * (W + delta).
Every output row needs only its own rows of W and B (and all of A, [r, in]), so memory is bounded by a band of rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.reading import BLOCK_BYTES, read_elements
from ckpt_cli.errors import UsageError
from ckpt_cli.formats import registry
from ckpt_cli.store import location

MERGEABLE = ("float32", "bfloat16", "float16", "float64")
MIN_ROWS = 64  # rows a band holds at least (torch's CPU matmul of under 12 rows rounds otherwise than the whole's)


@dataclass(eq=False)
class LoraMerged:
    """A base weight [out, in] with its LoRA (and DoRA magnitude) merged, computed a band of rows at a time."""

    base: TensorEntry
    a: TensorEntry  # [r, in]
    b: TensorEntry  # [out, r]
    magnitude: TensorEntry | None  # [out], DoRA
    scale: float
    out: DType  # the written dtype: the base's, or --dtype's

    def windows(self) -> Iterator[tuple[int, int]]:
        """Bands of about BLOCK_BYTES of float32 rows, none under MIN_ROWS (a trailing short band joins the one before):
        a matmul of a few rows takes another kernel than the whole matrix's, and rounds differently."""
        rows, cols = self.base.shape
        step = max(MIN_ROWS, BLOCK_BYTES // max(cols * 4, 1))
        starts = list(range(0, rows, step))
        if len(starts) > 1 and rows - starts[-1] < MIN_ROWS:
            starts.pop()
        for k, r0 in enumerate(starts):
            r1 = starts[k + 1] if k + 1 < len(starts) else rows
            yield r0 * cols, (r1 - r0) * cols

    def read(self, start: int, count: int, sources: Any) -> Any:
        rows, cols = self.base.shape
        if count == 0 or cols == 0:  # nothing to merge into: an empty weight stays empty
            import torch

            return torch.empty(count, dtype=self.out.torch())
        first, last = start // cols, -(-(start + count) // cols)
        merged = self.rows(first, last, sources).reshape(-1)
        skip = start - first * cols
        return merged[skip : skip + count]

    def rows(self, r0: int, r1: int, sources: Any) -> Any:
        """Rows [r0, r1) of the merged weight, as `out`."""
        import torch

        cols, rank = self.base.shape[1], self.a.shape[0]
        weight = read_elements(self.base, r0 * cols, (r1 - r0) * cols, sources).reshape(r1 - r0, cols)
        lora_a = read_elements(self.a, 0, self.a.numel, sources).reshape(rank, cols).to(torch.float32)
        lora_b = read_elements(self.b, r0 * rank, (r1 - r0) * rank, sources).reshape(r1 - r0, rank).to(torch.float32)
        # peft's operations in its order, each in place on the one band-sized buffer the product made (a fresh buffer per
        # operation costs more than the arithmetic); IEEE addition and multiplication commute, so the bits are peft's.
        merged = (lora_b @ lora_a).mul_(self.scale)  # get_delta_weight: transpose(B @ A, fan_in_fan_out) * scaling
        merged.add_(weight)  # base_layer.weight.data += delta_weight (computed in float32, stored in W's dtype)
        if self.magnitude is not None:  # DoRA: W + delta is get_weight_norm(W, delta, scaling=1)'s sum too
            magnitude = read_elements(self.magnitude, r0, r1 - r0, sources).to(torch.float32)
            norm = torch.linalg.norm(merged, dim=1).to(merged.dtype)
            merged.mul_((magnitude / norm).view(-1, 1))  # (magnitude / norm) * (W + delta)
        return merged.to(self.base.dtype.torch()).to(self.out.torch())


def open_adapter(folder: str | Path) -> Checkpoint:
    """--adapter DIR read (formats/hf/adapter.py); UsageError when DIR is not a PEFT adapter folder, DataError naming
    the first thing in it ckpt cannot apply (verify DIR lists them all)."""
    where = location(folder)
    fmt = registry.get("adapter")
    if not fmt.reader.detect(where):
        raise UsageError(f"--adapter {folder}: not a PEFT adapter folder (adapter_config.json + adapter_model.safetensors or .bin)")
    adapter_ckpt = fmt.reader.read(where, ReadOptions())
    adapter_ckpt.source.refuse_problems("refusing to apply the adapter: ")
    return adapter_ckpt


def applied(ckpt: Checkpoint, folder: str | Path, cast: DType | None) -> Checkpoint:
    """The base checkpoint with the adapter at `folder` merged into each weight it targets (computed tensors; nothing
    is read now). `cast`: --dtype's, which the merged weights are written as (merged in the base's dtype first)."""
    adapter_ckpt = open_adapter(folder)
    adapter, lora = adapter_ckpt.source, adapter_ckpt.tensors
    tensors = dict(ckpt.tensors)
    tied = {name: group for group in ckpt.tied_groups() for name in group}
    for module in adapter.modules.values():
        base = tensors.get(module.weight)
        if base is None:
            raise UsageError(f"--adapter {folder}: targets '{module.weight}', which {ckpt.path} does not hold (is it this adapter's base?)")
        a, b = lora[module.a], lora[module.b]
        if len(base.shape) != 2 or base.shape != (b.shape[0], a.shape[1]):
            raise UsageError(
                f"--adapter {folder}: '{module.weight}' is {list(base.shape)} in the base; its lora_B {list(b.shape)} and lora_A "
                f"{list(a.shape)} make [{b.shape[0]}, {a.shape[1]}] (is it this adapter's base?)"
            )
        if base.dtype.name not in MERGEABLE:
            raise UsageError(f"--adapter {folder}: '{module.weight}' is {base.dtype.name} in the base; ckpt merges into float weights")
        if module.weight in tied:
            others = [n for n in tied[module.weight] if n != module.weight]
            raise UsageError(f"--adapter {folder}: '{module.weight}' is tied to '{others[0]}'; merging into one tied weight is refused")
        out = cast if cast is not None and base.role == "model" else base.dtype
        magnitude = lora[module.magnitude] if module.magnitude is not None else None
        derived = LoraMerged(base, a, b, magnitude, adapter.scale(module), out)
        pieces = [*base.pieces, *a.pieces, *b.pieces, *(magnitude.pieces if magnitude is not None else [])]
        tensors[module.weight] = TensorEntry(module.weight, out, base.shape, base.role, pieces, base.path, derived=derived)
    kind = "DoRA" if adapter.dora else "rsLoRA" if adapter.rslora else "LoRA"
    scales = sorted({adapter.scale(m) for m in adapter.modules.values()})
    shown = ", ".join(f"{s:g}" for s in scales[:4]) + (", ..." if len(scales) > 4 else "")
    note = f"merged the {kind} adapter {folder} into {len(adapter.modules)} weights (scale {shown})"
    return dataclasses.replace(ckpt, tensors=tensors, notes=[*ckpt.notes, note])


def check_combination(names_given: bool, carries_state: bool, folder: str | Path) -> None:
    """What --adapter cannot be combined with: a name map (its transforms lay out stored bytes), a training state."""
    if names_given:
        raise UsageError(f"--adapter {folder} merges into the base's own names; --name-map, --preset and --rename do not apply with it")
    if carries_state:
        raise UsageError(
            f"--adapter {folder} merges into model weights: write them (--to hf, safetensors or torch, or --weights-only), "
            "not a training state"
        )
