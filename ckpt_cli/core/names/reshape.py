"""A tensor viewed in another shape of the same element count (a name map's `reshape`): a JAX attention kernel
[embed, heads, head_dim] as [embed, heads * head_dim], the 2-D weight a torch Linear holds once transposed. Row-major
order is kept, so no byte moves: a stored tensor's pieces become flat ranges of the same bytes, and a computed one
(an Orbax array) is read through its own windows."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.model import TensorEntry
from ckpt_cli.core.names.row_split import gather
from ckpt_cli.errors import UsageError


@dataclass(frozen=True)
class Reshape:
    """`{from: REGEX, shape: [N, ...]}`: each N a size, 0 for the source's size at that position, -1 (once) for
    what the element count leaves, or a key of the model's config.json (`hidden_size`)."""

    pattern: str
    shape: tuple[int | str, ...]

    @classmethod
    def parse(cls, item: Any, where: str) -> Reshape:
        shape = item.get("shape") if isinstance(item, dict) else None
        if (
            not isinstance(shape, list)
            or not shape
            or not all(type(n) is int and n >= -1 or isinstance(n, str) and re.fullmatch(r"\w+", n) for n in shape)
            or shape.count(-1) > 1
        ):
            raise UsageError(
                f"{where}: each reshape is {{from: REGEX, shape: [N, ...]}} (N >= 1, 0: the source's, -1: once, or a config.json key)"
            )
        structured.regex(str(item["from"]), where)
        return cls(str(item["from"]), tuple(shape))

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None

    def needs_config(self) -> bool:
        return any(isinstance(n, str) for n in self.shape)

    def target(self, entry: TensorEntry, config: dict[str, Any] | None = None) -> tuple[int, ...]:
        """The new shape of `entry`; a UsageError naming it when its element count does not fit."""
        dims = []
        for i, n in enumerate(self.shape):
            if isinstance(n, str):
                value = (config or {}).get(n)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    where = "pass --hf-config DIR" if config is None else f"config.json has no positive integer '{n}' ({value!r})"
                    raise UsageError(f"reshape /{self.pattern}/ of '{entry.name}' takes '{n}' from the model's config: {where}")
                dims.append(value)
            elif n == 0 and i >= len(entry.shape):
                raise UsageError(f"reshape /{self.pattern}/ of '{entry.name}' {list(entry.shape)}: it has no dimension {i} to keep")
            else:
                dims.append(entry.shape[i] if n == 0 else n)
        known = math.prod(n for n in dims if n != -1)
        if -1 in dims:
            if known == 0 or entry.numel % known:
                raise UsageError(f"reshape /{self.pattern}/ of '{entry.name}' {list(entry.shape)}: {entry.numel} elements are not {dims}")
            dims[dims.index(-1)] = entry.numel // known
        if math.prod(dims) != entry.numel:
            raise UsageError(f"reshape /{self.pattern}/ of '{entry.name}' {list(entry.shape)}: {entry.numel} elements are not {dims}")
        return tuple(dims)

    def describe(self) -> str:
        return f"reshape /{self.pattern}/ to {list(self.shape)}"


def reshaped(entry: TensorEntry, shape: tuple[int, ...]) -> TensorEntry:
    """`entry` as `shape` (same element count), pointing at the same bytes."""
    if shape == entry.shape:
        return entry
    if entry.derived is not None:
        derived = Reshaped(entry, shape)
        if getattr(entry.derived, "read_box", None) is not None and _merged_at(entry.shape, shape) is not None:
            derived = ReshapedBoxes(entry, shape)
        return TensorEntry(entry.name, entry.dtype, shape, entry.role, entry.pieces, entry.path, derived=derived)
    return gather(entry, entry.name, [(0, entry.numel)], shape)


def _merged_at(old: tuple[int, ...], new: tuple[int, ...]) -> int | None:
    """k when `new` is [prod(old[:k]), prod(old[k:])] with k >= 1 (a kernel's trailing axes merged into its columns)."""
    if len(new) != 2:
        return None
    for k in range(1, len(old)):
        if math.prod(old[:k]) == new[0] and math.prod(old[k:]) == new[1]:
            return k
    return None


class Reshaped:
    """A computed tensor in another shape: the same row-major elements, read through the source's `derived`."""

    __slots__ = ("entry", "shape")

    def __init__(self, entry: TensorEntry, shape: tuple[int, ...]) -> None:
        self.entry, self.shape = entry, shape

    def windows(self) -> Iterator[tuple[int, int]]:
        return self.entry.derived.windows()  # type: ignore[union-attr]

    def read(self, start: int, count: int, sources: Any) -> Any:
        return self.entry.derived.read(start, count, sources)  # type: ignore[union-attr]

    def read_raw(self, start: int, count: int, sources: Any) -> Any:
        from ckpt_cli.core.reading import window_bytes

        return window_bytes(self.entry, self.entry.dtype, start, count, sources)


class ReshapedBoxes(Reshaped):
    """A computed tensor [A, B] whose source is [A0, ..., Ak-1, Bk, ...] (B the product of the trailing axes), read
    by boxes too (a `transpose` after the reshape reads boxes of its columns): a box of columns is read as the
    source's box of the whole leading-axis slices that hold it, cut to the columns in memory (at most two slices more)."""

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        old = self.entry.shape
        k = _merged_at(old, self.shape)
        assert k is not None
        (r0, c0), (nr, nc) = offsets, sizes
        if k > 1 and (r0, nr) != (0, self.shape[0]):  # some rows of several merged axes: row by row, as flat ranges
            import torch

            rows = [self.read(r * self.shape[1] + c0, nc, None) for r in range(r0, r0 + nr)]
            return torch.cat(rows) if rows else self.read(0, 0, None)
        inner = math.prod(old[k + 1 :])  # elements of one index of axis k
        lo, hi = c0 // inner, -(-(c0 + nc) // inner) if inner else 0
        lead_off, lead_size = ((r0,), (nr,)) if k == 1 else ((0,) * k, old[:k])
        box = self.entry.derived.read_box(  # type: ignore[union-attr]
            (*lead_off, lo, *(0,) * (len(old) - k - 1)), (*lead_size, hi - lo, *old[k + 1 :])
        )
        cols = box.reshape(nr, (hi - lo) * inner)[:, c0 - lo * inner : c0 - lo * inner + nc]
        return cols.contiguous().reshape(-1)
