"""Stacking many named tensors into one (a name map's `stack`), without reading them: per-expert MoE weights into
the packed expert tensors transformers v5 keeps in memory.

transformers v4 (and every Hugging Face release on disk) holds one tensor per expert, `mlp.experts.E.gate_proj.weight`,
`up_proj`, `down_proj`; transformers v5 models hold `mlp.experts.gate_up_proj` [experts, 2 x intermediate, hidden]
(each expert's gate rows then its up rows: MergeModulelist(dim=0) then Concatenate(dim=1) in its
conversion_mapping.py) and `mlp.experts.down_proj` [experts, hidden, intermediate]. A `Stack` gathers the tensors
its pattern matches by the name they map to, orders them by the `index` group (experts 0..E-1, none missing) and,
within one index, by `parts` (gate, then up), and lays them end to end: the output's pieces are the sources' own
stored bytes. The way back is a `split` with `layers: true` (core/names/row_split.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.model import FlatRange, Piece, TensorEntry
from ckpt_cli.core.names.row_split import Gathered
from ckpt_cli.errors import UsageError


@dataclass(frozen=True)
class Stack:
    pattern: str  # regular expression with named groups `index` (the stacked position) and, with parts, `part`
    to: str  # the output's name: group references (\g<prefix>) filled in from the match
    parts: tuple[str, ...] = ()  # within one index, the `part` values in the order their rows are concatenated

    @classmethod
    def parse(cls, item: Any, where: str) -> Stack:
        if not isinstance(item, dict) or not {"from", "to"} <= set(item) or set(item) - {"from", "to", "parts"}:
            raise UsageError(f"{where}: each stack is {{from: REGEX with (?P<index>...), to: NAME, parts: [NAMES]}}")
        groups = structured.regex(str(item["from"]), where).groupindex
        parts = item.get("parts") or []
        if "index" not in groups or (parts and "part" not in groups):
            raise UsageError(f"{where}: stack '{item['from']}' needs a group (?P<index>...){' and (?P<part>...)' if parts else ''}")
        if not isinstance(parts, list) or not all(isinstance(p, str) and p for p in parts) or len(set(parts)) != len(parts):
            raise UsageError(f"{where}: stack '{item['from']}': parts is a list of distinct names")
        return cls(str(item["from"]), str(item["to"]), tuple(parts))

    def describe(self) -> str:
        return f"stack /{self.pattern}/ -> {self.to}" + (f" ({' then '.join(self.parts)} per index)" if self.parts else "")

    def gather(self, entries: dict[str, TensorEntry], base_of: Any) -> tuple[dict[str, TensorEntry], set[str]]:
        """The stacked outputs and the names of the entries they take."""
        found: dict[str, dict[tuple[int, int], TensorEntry]] = {}
        for entry in entries.values():
            match = re.fullmatch(self.pattern, base_of(entry.name))
            if match is None:
                continue
            if self.parts and match["part"] not in self.parts:
                continue
            slot = self.parts.index(match["part"]) if self.parts else 0
            found.setdefault(match.expand(self.to), {})[(int(match["index"]), slot)] = entry
        outputs = {name: self._stacked(name, members) for name, members in found.items()}
        return outputs, {e.name for members in found.values() for e in members.values()}

    def _stacked(self, name: str, members: dict[tuple[int, int], TensorEntry]) -> TensorEntry:
        count, per = max(i for i, _ in members) + 1, max(len(self.parts), 1)
        missing = [(i, s) for i in range(count) for s in range(per) if (i, s) not in members]
        if missing:
            i, s = missing[0]
            what = f"index {i}" + (f" part '{self.parts[s]}'" if self.parts else "")
            raise UsageError(f"stacking '{name}': no tensor for {what} ({len(members)} found); every index 0..{count - 1} is needed")
        first = [members[(0, s)] for s in range(per)]
        for (_, s), entry in members.items():
            ref = first[s]
            if entry.shape != ref.shape or entry.dtype != ref.dtype or entry.role != ref.role:
                shown = f"{entry.name} is {entry.dtype.name} {list(entry.shape)}, {ref.name} {ref.dtype.name} {list(ref.shape)}"
                raise UsageError(f"stacking '{name}': {shown}")
        if len({(e.dtype, e.shape[1:]) for e in first}) > 1 or any(not e.shape for e in first):
            raise UsageError(f"stacking '{name}': the parts {', '.join(e.name for e in first)} differ past their first dimension")
        rows = sum(e.shape[0] for e in first)
        shape = (count, rows, *first[0].shape[1:])
        ordered = [members[(i, s)] for i in range(count) for s in range(per)]
        if any(e.derived is not None for e in ordered):  # computed members: read through them, one after the other
            stand_in = [p for e in ordered for p in e.pieces]
            derived = Gathered([(e, 0, e.numel) for e in ordered])
            return TensorEntry(name, first[0].dtype, shape, first[0].role, stand_in, (name,), derived=derived)
        pieces: list[Piece] = []
        pos = 0
        for i in range(count):
            for s in range(per):
                entry = members[(i, s)]
                pieces += [Piece(FlatRange(pos + start, length), piece.data, local) for start, length, piece, local in entry.runs()]
                pos += entry.numel
        return TensorEntry(name, first[0].dtype, shape, first[0].role, pieces, (name,))
