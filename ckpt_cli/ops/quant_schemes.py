"""What a quantized checkpoint is made of: each quantized weight (`Quantized`: the stored tensors it is computed
from, its shape and block) and the checkpoint's scheme; the model config they are read with."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.paths import read_regular_text
from ckpt_cli.errors import DataError
from ckpt_cli.store import location


def file_of(entry: TensorEntry) -> str:
    """The file a problem with a quantization tensor names: the one holding its first piece."""
    return entry.pieces[0].data.path if entry.pieces else entry.name


@dataclass(frozen=True)
class Quantized:
    """One quantized weight: the stored tensors it is made from and the name and shape it dequantizes to."""

    name: str
    method: str  # "fp8", "mxfp4"; compressed-tensors: "ct-naive", "ct-pack", "ct-nvfp4"
    values: str  # the stored values: X.weight (fp8, ct-naive), X_blocks (mxfp4), X.weight_packed (ct-pack, ct-nvfp4)
    scales: str
    shape: tuple[int, ...]  # of the weight it dequantizes to
    block: tuple[int, int]  # the rows x columns each scale covers
    zero_point: str | None = None
    global_scale: str | None = None
    bits: int = 8  # a packed value's width
    unused: tuple[str, ...] = ()  # tensors that belong to the quantization but carry no weight (packed shape, input scales)

    def reads(self) -> tuple[str, ...]:
        """The stored tensors its dequantized value is computed from."""
        return tuple(n for n in (self.values, self.scales, self.zero_point, self.global_scale) if n)


@dataclass
class Scheme:
    """What a checkpoint's quantization is: method, block size, where it was read, and each quantized weight."""

    method: str
    block: tuple[int, int] | None
    source: str  # "config.json" or "tensor names"
    weights: dict[str, Quantized] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # the config's quantization_config, as written

    def stored_names(self) -> set[str]:
        """Every stored tensor that belongs to a quantized weight (left out of a dequantized copy)."""
        return {n for q in self.weights.values() for n in (*q.reads(), *q.unused)}

    def summary(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "formats": sorted({q.method for q in self.weights.values()}),
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
        text = read_regular_text(location(path), max_bytes=16 << 20)
    except OSError as exc:
        raise DataError(f"{path}: not readable ({exc})") from exc
    doc = structured.load_json(text, path, DataError)
    if not isinstance(doc, dict):
        raise DataError(f"{path}: not a JSON object")
    return doc
