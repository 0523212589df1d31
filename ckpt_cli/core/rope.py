"""The rotary-embedding row order of q/k projections, changed as the tensor is read (a name map's `permute`).

Rotary embeddings rotate pairs of a head's dimensions. Meta's Llama code and torchtitan pair rows 2i and 2i+1 of
each head (`interleaved`: they view the head as complex numbers); Hugging Face's Llama family pairs row i with row
i + head_dim/2 (`halves`: `rotate_half`). The same weights in the other convention are the rows permuted within
each head, which is what Hugging Face's convert_llama_weights_to_hf.py and torchtitan's state-dict adapter do:

    interleaved -> halves:  w.view(heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    halves -> interleaved:  w.view(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)

The permuted tensor is computed one group of whole heads at a time from the source's bytes (a core/model.py
`Derived`): memory is bounded by a window, and the values are the source's, moved, never changed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core.model import TensorEntry
from ckpt_cli.errors import UsageError

LAYOUTS = ("interleaved", "halves")
WINDOW_BYTES = 16 << 20


@dataclass(frozen=True)
class RopePermute:
    """`source` (rows = heads x head_dim, any trailing shape) with each head's rows moved from `source_layout`."""

    source: TensorEntry
    heads: int
    to_halves: bool  # interleaved -> halves; False: halves -> interleaved

    @classmethod
    def of(cls, entry: TensorEntry, heads: int, to: str) -> RopePermute:
        if to not in LAYOUTS:
            raise UsageError(f"permute of '{entry.name}': rope layout is one of {', '.join(LAYOUTS)}, not '{to}'")
        rows = entry.shape[0] if entry.shape else 0
        if heads < 1 or rows % heads or (rows // heads) % 2:
            raise UsageError(
                f"permute of '{entry.name}' {list(entry.shape)}: {rows} rows are not {heads} heads of an even head_dim; "
                "check the head count the map takes from the config"
            )
        return cls(entry, heads, to == "halves")

    @property
    def head_elements(self) -> int:
        return self.source.numel // self.heads

    def windows(self) -> Iterator[tuple[int, int]]:
        per = max(1, WINDOW_BYTES // max(self.head_elements * self.source.dtype.itemsize, 1))
        for h in range(0, self.heads, per):
            n = min(per, self.heads - h)
            yield h * self.head_elements, n * self.head_elements

    def read(self, start: int, count: int, sources: Any) -> Any:
        from ckpt_cli.core.reading import read_elements

        size = self.head_elements
        h0, h1 = start // size, -(-(start + count) // size)
        rows = self.source.shape[0] // self.heads
        cols = math.prod(self.source.shape[1:])
        block = read_elements(self.source, h0 * size, (h1 - h0) * size, sources)
        if self.to_halves:
            moved = block.view(h1 - h0, rows // 2, 2, cols).transpose(1, 2)
        else:
            moved = block.view(h1 - h0, 2, rows // 2, cols).transpose(1, 2)
        offset = start - h0 * size
        return moved.reshape(-1)[offset : offset + count].clone()


def permuted(entry: TensorEntry, name: str, heads: int, to: str) -> TensorEntry:
    """`entry` under `name` with its rows in the `to` rotary layout (read from the source's pieces)."""
    derived = RopePermute.of(entry, heads, to)
    return TensorEntry(name, entry.dtype, entry.shape, entry.role, entry.pieces, (name,), derived=derived)
