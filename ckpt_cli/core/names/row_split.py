"""Splitting a tensor by rows into several named tensors (a name map's `split`), without reading it.

Frameworks fuse parameters that other frameworks keep apart: Megatron's `linear_qkv` holds, for each query
group, the group's query heads then its key head then its value head; its SwiGLU `linear_fc1` holds the gate
rows then the up rows; its torch_dist checkpoints stack the layers of a block along a leading dimension. A
`RowSplit` says how: the leading dims are first stacks (`layers`: true or 1 for a stack of layers, 2 for layers of
stacked experts, as Megatron's MoE `experts.experts.linear_fc1.weight` [layers, experts, rows, cols]), each
stacked matrix's rows are `groups` equal blocks, and each block is cut in proportion to `shares`, part j of every
block going (in block order) to output j.
Every output is a list of element ranges of the source, so its pieces point into the source's stored bytes
(core/model.py): the export streams them as byte ranges and never loads the fused tensor. A computed source (an Orbax
array, a dequantized weight) has no stored bytes to point at: its outputs read their ranges through it (`Gathered`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.model import FlatRange, Piece, TensorEntry
from ckpt_cli.errors import UsageError

LAYER = "{layer}"
EXPERT = "{expert}"
STACKS = (LAYER, EXPERT)  # the placeholders of the stacked dims, outermost first


@dataclass(frozen=True)
class RowSplit:
    pattern: str  # a regular expression the whole (segment-stripped) source name must match
    names: tuple[str, ...]  # output names: regex group references (\1) and {layer} are filled in
    shares: tuple[int | str, ...]  # each output's share of a block's rows (a config key, "KEY/KEY": see resolved)
    groups: int | str = 1
    layers: bool | int = False  # how many leading dims are stacks: true = 1 ({layer}), 2 ({layer}, {expert})

    @classmethod
    def parse(cls, item: Any, where: str) -> RowSplit:
        """One `split` entry: {from: REGEX, to: NAME | [NAME, ...] | {NAME: SHARE, ...}, groups: N, layers: BOOL | 2}."""
        if not isinstance(item, dict) or not {"from", "to"} <= set(item) or set(item) - {"from", "to", "groups", "layers"}:
            raise UsageError(f"{where}: each split is {{from: REGEX, to: NAMES, groups: N, layers: true|false|2}}")
        to = item["to"]
        pairs = [(to, 1)] if isinstance(to, str) else [(n, 1) for n in to] if isinstance(to, list) else list((to or {}).items())
        groups, layers = item.get("groups", 1), item.get("layers", False)
        if not pairs or not all(isinstance(n, str) and n and _count_or_key(s) for n, s in pairs):
            raise UsageError(
                f"{where}: split '{item['from']}': 'to' names the outputs (a name, a list, or name: share with shares >= 1 "
                "or config.json keys)"
            )
        if not _count_or_key(groups) or layers not in (True, False, 2) or type(layers) not in (bool, int):
            raise UsageError(f"{where}: split '{item['from']}': groups is an integer >= 1 (or a config.json key), layers true, false or 2")
        needed = STACKS[: int(layers)]
        if not all(p in n for n, _ in pairs for p in needed):
            raise UsageError(f"{where}: split '{item['from']}' has layers: {layers}, so every output name needs {' and '.join(needed)}")
        if len({n for n, _ in pairs}) != len(pairs):
            raise UsageError(f"{where}: split '{item['from']}' names an output twice")
        structured.regex(str(item["from"]), where)
        return cls(str(item["from"]), tuple(n for n, _ in pairs), tuple(s for _, s in pairs), groups, layers)

    def needs_config(self) -> bool:
        return isinstance(self.groups, str) or any(isinstance(s, str) for s in self.shares)

    def resolved(self, config: dict[str, Any] | None) -> RowSplit:
        """The split with its config.json keys replaced by their values: `groups: num_key_value_heads`, a share
        `num_attention_heads/num_key_value_heads` (the query heads of a group, a whole number)."""
        if not self.needs_config():
            return self
        if config is None:
            raise UsageError(
                f"split /{self.pattern}/ takes its sizes from the model's config.json: pass --hf-config DIR "
                "(the folder of the Hugging Face config)"
            )
        shares = tuple(_config_count(s, config, self.pattern) for s in self.shares)
        return RowSplit(self.pattern, self.names, shares, _config_count(self.groups, config, self.pattern), self.layers)

    def describe(self) -> str:
        parts = ", ".join(f"{n} ({s})" if len(set(self.shares)) > 1 else n for n, s in zip(self.names, self.shares))
        how = f"{self.groups} groups of rows" if self.groups != 1 else "rows"
        per = {0: "", 1: " per layer", 2: " per layer and expert"}[int(self.layers)]
        return f"split /{self.pattern}/{per}: {how} -> {parts}"

    def _numbers(self) -> tuple[int, tuple[int, ...]]:
        """groups and shares as numbers (a split applied is a resolved one: no config.json key left)."""
        groups, shares = self.groups, tuple(s for s in self.shares if isinstance(s, int))
        if isinstance(groups, str) or len(shares) != len(self.shares):
            raise ValueError(f"split /{self.pattern}/ applied before its config.json keys were resolved")
        return groups, shares

    def apply(self, entry: TensorEntry, name: str) -> list[TensorEntry] | None:
        """The outputs for `entry` (known as `name`), or None when the pattern does not match the name."""
        match = re.fullmatch(self.pattern, name)
        if match is None:
            return None
        groups, shares = self._numbers()
        shape = entry.shape
        where = f"split of '{entry.name}' {list(shape)}"
        depth = int(self.layers)
        stacks, inner = shape[:depth], shape[depth:]
        layers = math.prod(stacks)
        if not inner:
            raise UsageError(f"{where}: {f'{depth} stacked dims need' if depth else 'splitting rows needs'} one more dimension")
        rows, row = inner[0], math.prod(inner[1:])
        if layers * groups > max(entry.numel, 1):  # each output range holds >= 1 element: the loop is bounded by the data
            raise UsageError(f"{where}: {layers} layers x {groups} groups from {entry.numel} elements; nothing to split")
        if rows % groups:
            raise UsageError(f"{where}: {rows} rows do not divide into {groups} groups")
        block = rows // groups
        if block % sum(shares):
            raise UsageError(f"{where}: blocks of {block} rows do not split in the proportion {':'.join(map(str, shares))}")
        unit = block // sum(shares)
        runs = entry.runs()
        starts = [r[0] for r in runs]
        out = []
        for layer in range(layers):
            first = layer * rows
            index = [layer // math.prod(stacks[d + 1 :]) % stacks[d] for d in range(depth)]  # the stacked dims' indices
            for j, (template, share) in enumerate(zip(self.names, shares)):
                offset = sum(shares[:j]) * unit
                ranges = [((first + g * block + offset) * row, share * unit * row) for g in range(groups)]
                new = match.expand(template)
                for placeholder, i in zip(STACKS, index):
                    new = new.replace(placeholder, str(i))
                out.append(_gather(entry, new, runs, starts, ranges, (groups * share * unit, *inner[1:])))
        return out


def gather(entry: TensorEntry, name: str, ranges: list[tuple[int, int]], shape: tuple[int, ...]) -> TensorEntry:
    """Elements [start, start + count) of `entry` for each range, one after the other, as a tensor of `shape`."""
    runs = entry.runs()
    return _gather(entry, name, runs, [r[0] for r in runs], ranges, shape)


def _count_or_key(value: Any) -> bool:
    return type(value) is int and value > 0 or isinstance(value, str) and bool(re.fullmatch(r"\w+(/\w+)?", value))


def _config_count(value: int | str, config: dict[str, Any], pattern: str) -> int:
    """A positive integer, or config.json's value of KEY, or of KEY/KEY when the division is exact."""
    if isinstance(value, int):
        return value
    parts = []
    for key in value.split("/"):
        got = config.get(key)
        if isinstance(got, bool) or not isinstance(got, int) or got < 1:
            raise UsageError(f"split /{pattern}/: config.json has no positive integer '{key}' ({got!r})")
        parts.append(got)
    if len(parts) == 2 and parts[0] % parts[1]:
        raise UsageError(f"split /{pattern}/: {value} is {parts[0]}/{parts[1]}, not a whole number")
    return parts[0] // parts[1] if len(parts) == 2 else parts[0]


def _gather(
    entry: TensorEntry,
    name: str,
    runs: list[tuple[int, int, Piece, int]],
    starts: list[int],
    ranges: list[tuple[int, int]],
    shape: tuple[int, ...],
) -> TensorEntry:
    """Elements [start, start + count) of `entry` for each range, one after the other, as a tensor of `shape`."""
    if entry.derived is not None:
        return TensorEntry(
            name, entry.dtype, shape, entry.role, entry.pieces, (name,), derived=Gathered([(entry, s, n) for s, n in ranges])
        )
    pieces: list[Piece] = []
    pos = 0
    for start, count in ranges:
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(runs) and runs[i][0] < start + count:
            gstart, length, piece, lstart = runs[i]
            lo, hi = max(gstart, start), min(gstart + length, start + count)
            if lo < hi:
                pieces.append(Piece(FlatRange(pos + lo - start, hi - lo), piece.data, lstart + lo - gstart))
            i += 1
        pos += count
    return TensorEntry(name, entry.dtype, shape, entry.role, pieces)


class Gathered:
    """A tensor made of element ranges of computed tensors (a split, permute or stack of an Orbax array or a dequantized
    weight), in order: each window is read range by range through the sources' own `derived`, BLOCK_BYTES at most."""

    __slots__ = ("parts", "starts", "itemsize")

    def __init__(self, parts: list[tuple[TensorEntry, int, int]]) -> None:
        self.parts = parts  # (source, first element, count)
        self.starts = list(itertools.accumulate((n for _, _, n in parts), initial=0))
        self.itemsize = parts[0][0].dtype.itemsize if parts else 1

    def windows(self) -> Iterator[tuple[int, int]]:
        from ckpt_cli.core.reading import BLOCK_BYTES

        step, total = max(1, BLOCK_BYTES // self.itemsize), self.starts[-1]
        for start in range(0, total, step):
            yield start, min(step, total - start)

    def read(self, start: int, count: int, sources: Any) -> Any:
        import torch

        from ckpt_cli.core.reading import read_elements

        out, pos, end = [], start, start + count
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while pos < end and i < len(self.parts):
            entry, first, n = self.parts[i]
            skip = pos - self.starts[i]
            take = min(n - skip, end - pos)
            if take > 0:
                out.append(torch.as_tensor(read_elements(entry, first + skip, take, sources)))
                pos += take
            i += 1
        if not out:
            return torch.empty(0, dtype=self.parts[0][0].dtype.torch() if self.parts else torch.float32)
        return torch.cat(out) if len(out) > 1 else out[0]
