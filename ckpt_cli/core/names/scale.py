"""A tensor multiplied by a constant as it is read (a name map's `scale`): MaxText keeps the query kernel divided by
sqrt(head_dim) (its attention folds the softmax scale into the weight), so its Hugging Face export multiplies it back.

The product is computed as MaxText's `to_huggingface` does it (checkpoint_conversion/utils/param_mapping.py
`scale_query_layer`): the factor is float32(sqrt(N)) computed in double precision, the tensor is cast to float32,
multiplied, and cast back to its own dtype, so a bfloat16 kernel gives the bits MaxText's export gives.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.model import TensorEntry
from ckpt_cli.errors import UsageError

_SQRT = re.compile(r"sqrt\((\w+)\)")


@dataclass(frozen=True)
class Scale:
    """`{from: REGEX, by: NUMBER | 'sqrt(KEY)'}`: KEY a positive integer of the model's config.json (head_dim)."""

    pattern: str
    by: float | str

    @classmethod
    def parse(cls, item: Any, where: str) -> Scale:
        by: Any = item.get("by") if isinstance(item, dict) else None
        number = type(by) in (int, float) and math.isfinite(by) and by != 0
        if not isinstance(item, dict) or set(item) != {"from", "by"} or not (number or isinstance(by, str) and _SQRT.fullmatch(by)):
            raise UsageError(f"{where}: each scale is {{from: REGEX, by: NUMBER or 'sqrt(KEY)'}} (KEY: a config.json key)")
        structured.regex(str(item["from"]), where)
        return cls(str(item["from"]), by if isinstance(by, str) else float(by))

    def needs_config(self) -> bool:
        return isinstance(self.by, str)

    def factor(self, config: dict[str, Any] | None) -> float:
        """The multiplier as a float32 value (returned as the Python float that holds it exactly)."""
        import numpy as np

        if isinstance(self.by, float):
            return float(np.float32(self.by))
        key = _SQRT.fullmatch(self.by)[1]  # type: ignore[index]
        value = (config or {}).get(key)
        if config is None:
            raise UsageError(f"scale /{self.pattern}/ by {self.by} needs the model's config.json: pass --hf-config DIR")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"scale /{self.pattern}/: config.json has no positive integer '{key}' ({value!r})")
        return float(np.float32(np.sqrt(value)))

    def describe(self) -> str:
        return f"scale /{self.pattern}/ by {self.by}"


def scaled(entry: TensorEntry, factor: float) -> TensorEntry:
    """`entry` times `factor` (float32 arithmetic, back to its dtype), computed as it is read."""
    if not entry.dtype.is_float:
        raise UsageError(f"scale of '{entry.name}': a {entry.dtype.name} tensor; only floating-point tensors scale")
    return TensorEntry(entry.name, entry.dtype, entry.shape, entry.role, entry.pieces, entry.path, derived=Scaled(entry, factor))


class Scaled:
    __slots__ = ("entry", "factor")

    def __init__(self, entry: TensorEntry, factor: float) -> None:
        self.entry, self.factor = entry, factor

    def windows(self) -> Iterator[tuple[int, int]]:
        from ckpt_cli.core.reading import element_windows

        return element_windows(self.entry)

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        from ckpt_cli.core.reading import read_elements

        values = torch.as_tensor(read_elements(self.entry, start, count, sources))
        factor = torch.tensor(self.factor, dtype=torch.float32)  # a 0-d tensor: float32 arithmetic, no promotion
        return (values.to(torch.float32) * factor).to(values.dtype)
