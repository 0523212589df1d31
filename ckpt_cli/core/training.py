"""A run's training state in one framework-neutral form, and the rules that carry it between layouts.

A `TrainingState` names everything by the model's parameter FQN: the weights, the optimizer state
of each parameter (`exp_avg`, `exp_avg_sq`, `step`), the param groups (hyper-parameters and the
FQNs they hold), the step, and the rest (LR scheduler, dataloader, RNG, client state) by its
top-level key. Each training format reads its checkpoints into one and lays one out as its own
files (formats/deepspeed/training.py, formats/dcp/training.py); `NameMap` renames parameters on
the way, and the per-rank rule re-keys values saved once per data-parallel rank for a new world
size. Tensor data is never read here (but for `scalar`, a step stored as a tensor): entries keep pointing at the
source's stored bytes.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ckpt_cli import store
from ckpt_cli.core import structured
from ckpt_cli.core.model import Checkpoint, ObjectEntry, PathKey, TensorEntry
from ckpt_cli.core.names.reshape import Reshape
from ckpt_cli.core.names.row_split import RowSplit
from ckpt_cli.core.names.scale import Scale
from ckpt_cli.core.names.stack import Stack
from ckpt_cli.core.names.unstack import Unstack
from ckpt_cli.core.paths import read_regular_text
from ckpt_cli.core.structured import Optional
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError, UsageError

# Module wrappers that put a segment into parameter names but are not part of the model:
# torch.compile, activation checkpointing, FSDP1. get_state_dict drops them the same way.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
PER_RANK_RULES = ("wrap", "first", "drop")
_RANK_KEY = re.compile(r"^((?:.*[_.-])?(?:dp_)?rank_?)(\d+)$")  # rank_3, dp_rank_3, rng_rank3
# Rank keys of other parallel dimensions or none at all: never re-keyed by the data-parallel world size.
_NOT_DP_RANK = re.compile(r"(?:^|[_.-])(?:tp|pp|mp|ep|sp|cp|expert|lora|low)_?rank_?$")


NAME_MAP_SCHEMA = {
    "strip_segments": Optional([str]),
    "rename": Optional([{"from": str, "to": str}]),
    "tied": Optional({str: str}),
    "split": Optional([{"from": str, "to": (str, list, dict), "groups": Optional((int, str)), "layers": Optional((bool, int))}]),
    "permute": Optional([{"from": str, "rope": str, "heads": (int, str)}]),
    "stack": Optional([{"from": str, "to": str, "parts": Optional([str])}]),
    "transpose": Optional([str]),
    "zero": Optional([str]),
    "reshape": Optional([{"from": str, "shape": list}]),
    "unstack": Optional([{"from": str, "axis": int, "to": str}]),
    "scale": Optional([{"from": str, "by": (int, float, str)}]),
}


@dataclass(frozen=True)
class Permute:
    """A name map's `permute`: the rows of the tensors `pattern` matches moved to the `rope` layout (core/names/rope.py),
    per head; `heads` is a number or the config.json key that holds it (num_attention_heads, num_key_value_heads)."""

    pattern: str
    rope: str
    heads: int | str

    @classmethod
    def parse(cls, item: Any, where: str) -> Permute:
        from ckpt_cli.core.names.rope import LAYOUTS

        if item["rope"] not in LAYOUTS:
            raise UsageError(f"{where}: permute '{item['from']}': rope is {' or '.join(LAYOUTS)}, not {item['rope']!r}")
        heads = item["heads"]
        if isinstance(heads, bool) or not (isinstance(heads, str) and heads or isinstance(heads, int) and heads > 0):
            raise UsageError(f"{where}: permute '{item['from']}': heads is a positive number or a config.json key")
        structured.regex(str(item["from"]), where)
        return cls(str(item["from"]), str(item["rope"]), heads)

    def head_count(self, config: dict[str, Any] | None, tensor: str) -> int:
        if isinstance(self.heads, int):
            return self.heads
        if config is None:
            raise UsageError(
                f"permuting '{tensor}' per head needs the head count ({self.heads}) from the model's config.json: "
                "pass --hf-config DIR (the folder of the Hugging Face config), or the source has none"
            )
        value = config.get(self.heads)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"permuting '{tensor}' per head: config.json has no positive integer '{self.heads}' ({value!r})")
        return value

    def describe(self) -> str:
        return f"permute /{self.pattern}/ to rope {self.rope} ({self.heads} heads)"


@dataclass(frozen=True)
class NameMap:
    """How parameter names change on the way: wrapper segments dropped, regex renames applied in order,
    and tied weights (alias -> owner) that the source does not record. Weight exports also split fused
    tensors by rows (core/names/row_split.py): a tensor a split matches is split instead of renamed."""

    strip_segments: tuple[str, ...] = WRAPPER_SEGMENTS
    renames: tuple[tuple[str, str], ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    splits: tuple[RowSplit, ...] = ()
    permutes: tuple[Permute, ...] = ()
    stacks: tuple[Stack, ...] = ()
    transposes: tuple[str, ...] = ()  # regular expressions: 2-D tensors written transposed (core/names/rope.py)
    zeros: tuple[str, ...] = ()  # regular expressions: tensors the target has no place for, left out only while all zero
    reshapes: tuple[Reshape, ...] = ()  # tensors viewed in another shape of the same element count (core/names/reshape.py)
    unstacks: tuple[Unstack, ...] = ()  # tensors stacked on an axis made one per index (core/names/unstack.py)
    scales: tuple[Scale, ...] = ()  # tensors multiplied by a constant as they are read (core/names/scale.py)

    @classmethod
    def from_yaml(cls, path: Path) -> NameMap:
        """`strip_segments: [...]`, `rename: [{from: REGEX, to: REPL}, ...]`, `tied: {alias: owner}`,
        `split: [{from: REGEX, to: NAMES, groups: N, layers: BOOL}, ...]`, `permute: [{from: REGEX, rope: LAYOUT, heads: N}]`,
        `reshape: [{from: REGEX, shape: [N, ...]}]`, `unstack: [{from: REGEX, axis: K, to: NAME}]`,
        `scale: [{from: REGEX, by: NUMBER}]`."""
        path = store.location(path)  # a local file or an object (s3://)
        try:
            text = read_regular_text(path, max_bytes=16 << 20)
        except OSError as exc:
            raise UsageError(f"{path}: cannot read the name map ({exc.strerror})") from exc
        except DataError as exc:
            raise UsageError(f"{path}: cannot read the name map ({exc})") from exc
        return cls.from_data(structured.load_yaml(text, str(path), UsageError) or {}, str(path))

    @classmethod
    def from_data(cls, data: Any, where: str) -> NameMap:
        """A name map from its parsed YAML (a file's, or a preset's)."""
        structured.check(data, NAME_MAP_SCHEMA, where, UsageError)  # each section's type, each item's keys and types
        return cls(
            tuple(data.get("strip_segments", WRAPPER_SEGMENTS) or ()),
            tuple((item["from"], item["to"]) for item in data.get("rename") or []),
            tuple((data.get("tied") or {}).items()),
            tuple(RowSplit.parse(item, where) for item in data.get("split") or []),
            tuple(Permute.parse(item, where) for item in data.get("permute") or []),
            tuple(Stack.parse(item, where) for item in data.get("stack") or []),
            tuple(str(p) for p in data.get("transpose") or []),
            tuple(str(p) for p in data.get("zero") or []),
            reshapes=tuple(Reshape.parse(item, where) for item in data.get("reshape") or []),
            unstacks=tuple(Unstack.parse(item, where) for item in data.get("unstack") or []),
            scales=tuple(Scale.parse(item, where) for item in data.get("scale") or []),
        ).checked(where)

    def with_renames(self, pairs: list[str]) -> NameMap:
        """Add `--rename REGEX=REPLACEMENT` options."""
        extra = []
        for pair in pairs:
            pattern, sep, repl = pair.partition("=")
            if not sep or not pattern:
                raise UsageError(f"--rename takes REGEX=REPLACEMENT, got '{pair}'")
            extra.append((pattern, repl))
        return dataclasses.replace(self, renames=self.renames + tuple(extra)).checked("--rename")

    def checked(self, where: str) -> NameMap:
        for pattern in [p for p, _ in self.renames] + list(self.transposes) + list(self.zeros):
            structured.regex(pattern, where)
        return self

    def changes_tensors(self) -> bool:
        """Whether the map does more than rename (a training-state conversion renames only: the moments would not follow)."""
        return any((self.splits, self.permutes, self.stacks, self.unstacks, self.transposes, self.zeros, self.reshapes, self.scales))

    def strip(self, name: str) -> str:
        return ".".join(p for p in name.split(".") if p not in self.strip_segments)

    def apply(self, name: str) -> str:
        out = self.strip(name)
        for pattern, repl in self.renames:
            try:
                out = re.sub(pattern, repl, out)
            except re.error as exc:
                raise UsageError(f"rename /{pattern}/ -> '{repl}': {exc}") from exc
        return out

    def describe(self) -> str:
        rules = [f"drop segments {', '.join(self.strip_segments)}" if self.strip_segments else "keep every segment"]
        rules += [f"rename /{p}/ -> '{r}'" for p, r in self.renames]
        rules += [f"tie {a} -> {o}" for a, o in self.tied]
        rules += [s.describe() for s in self.splits]
        rules += [p.describe() for p in self.permutes]
        rules += [s.describe() for s in self.stacks]
        rules += [f"transpose /{p}/" for p in self.transposes]
        rules += [f"leave out /{p}/ while all zero" for p in self.zeros]
        rules += [r.describe() for r in self.reshapes]
        rules += [u.describe() for u in self.unstacks]
        rules += [s.describe() for s in self.scales]
        return "; ".join(rules)


@dataclass
class TrainingState:
    """A run's state by parameter FQN, independent of how a framework lays it out."""

    weights: dict[str, TensorEntry]  # model state dict: params, frozen params, buffers, tied aliases
    moments: dict[str, dict[str, TensorEntry]]  # FQN -> optimizer state (exp_avg, exp_avg_sq, step)
    groups: list[dict[str, Any]]  # hyper-parameters and "params": [FQN]
    step: int | None
    extra_objects: list[ObjectEntry] = field(default_factory=list)  # by their top-level key
    extra_tensors: list[TensorEntry] = field(default_factory=list)  # (an RNG state saved as a tensor)
    buffers: set[str] = field(default_factory=set)  # weights that are not parameters (replicated by FSDP2)
    tied: dict[str, str] = field(default_factory=dict)  # alias -> owner
    world_size: int = 1
    notes: list[str] = field(default_factory=list)
    containers: dict[PathKey, str] = field(default_factory=dict)  # which extras' paths were lists or tuples
    layout: str = ""  # the source's key layout (TrainingFormat.layout_of)
    run_config: dict[str, Any] | None = None  # the DeepSpeed config the source run saved (its ds_config), if any

    def trainable(self) -> list[str]:
        return [p for g in self.groups for p in g["params"] if p in self.moments]


def scalar(entry: TensorEntry) -> Any:
    """The value of a one-element tensor (a step, an Adam count): a few bytes read from the source."""
    from ckpt_cli.core.reading import SourceFiles, read_elements

    with closing(SourceFiles()) as sources:
        return read_elements(entry, 0, 1, sources)[0]


def renamed(state: TrainingState, names: NameMap) -> TrainingState:
    rename = names.apply
    weights: dict[str, TensorEntry] = {}
    for fqn, entry in state.weights.items():
        new = rename(fqn)
        if new in weights:
            raise UsageError(f"two weights are both named '{new}' after renaming; adjust --rename/--name-map")
        weights[new] = entry
    changed = [(a, rename(a)) for a in state.weights if rename(a) != a]
    example = f" (e.g. {changed[0][0]} -> {changed[0][1]})" if changed else ""
    state.notes.append(f"names: {names.describe()}: {len(changed)} renamed{example}")
    state.weights = weights
    state.moments = {rename(k): v for k, v in state.moments.items()}
    state.groups = [{**g, "params": [rename(p) for p in g["params"]]} for g in state.groups]
    state.buffers = {rename(b) for b in state.buffers}
    state.tied = {rename(a): rename(o) for a, o in state.tied.items()} | dict(names.tied)
    for alias, owner in state.tied.items():
        if alias not in state.weights or owner not in state.weights:
            raise UsageError(f"tied weight {alias} -> {owner}: {'alias' if alias not in state.weights else 'owner'} not in the checkpoint")
    for fqn in [*state.moments, *(p for g in state.groups for p in g["params"])]:
        if fqn not in state.weights:
            raise DataError(
                f"the optimizer names '{fqn}', which is not among the model weights "
                "(saved with get_state_dict(..., ignore_frozen_params=True)? or renamed differently)"
            )
    return state


Entry = TypeVar("Entry", bound="ObjectEntry | TensorEntry")  # a list of either, or of both


def per_rank_entries(entries: list[Entry]) -> dict[tuple[PathKey, int], dict[int, Entry]]:
    """Values saved once per data-parallel rank, recognised by a `rank_R` / `dp_rank_R` / `..._rank_R` key
    whose ranks run 0, 1, ... without a gap: (path template, position) -> rank -> entry. `lora_rank_16`,
    `tp_rank_1` and the like are not data-parallel ranks."""
    found: dict[tuple[PathKey, int], dict[int, Entry]] = {}
    for entry in entries:
        for i, part in enumerate(entry.path):
            m = _RANK_KEY.match(str(part))
            if m and not _NOT_DP_RANK.search(m.group(1)):
                width = len(m.group(2)) if m.group(2).startswith("0") and len(m.group(2)) > 1 else 0
                slot = "{:0" + str(width) + "d}" if width else "{}"  # keeps zero padding: rank_01 -> rank_02
                template = (*entry.path[:i], m.group(1) + slot, *entry.path[i + 1 :])
                found.setdefault((template, i), {})[int(m.group(2))] = entry
                break
    return {key: ranks for key, ranks in found.items() if sorted(ranks) == list(range(len(ranks)))}


def _rekeyed(entry: Entry, path: PathKey) -> Entry:
    return dataclasses.replace(entry, name=path_name(path), path=path)  # a DCP value's saved bytes hold no key


def apply_per_rank_rule(entries: list[Entry], world: int, rule: str) -> tuple[list[Entry], str | None]:
    """Re-key per-rank values (objects or tensors, e.g. RNG states) for `world` ranks: 'wrap' (new rank r
    takes old rank r mod W), 'first' (every rank takes rank 0's) or 'drop'. Returns the new list and the
    rule as printed (None when nothing changes)."""
    groups = {key: ranks for key, ranks in per_rank_entries(entries).items() if not (rule == "wrap" and len(ranks) == world)}
    if not groups:
        return entries, None  # nothing per rank, or (wrap at the same world size) every rank keeps its own
    ids = {id(e) for ranks in groups.values() for e in ranks.values()}
    out = [e for e in entries if id(e) not in ids]
    for (template, pos), ranks in groups.items():
        if rule == "drop":
            continue
        for r in range(world):
            src = ranks[r % len(ranks) if rule == "wrap" else 0]
            if src is ranks.get(r):
                out.append(src)  # this rank keeps its own value (as saved)
                continue
            out.append(_rekeyed(src, (*template[:pos], str(template[pos]).format(r), *template[pos + 1 :])))
    olds = sorted({len(ranks) for ranks in groups.values()})
    old = "/".join(map(str, olds))
    names = sorted({re.sub(r"\{[^}]*\}", "{}", path_name(t)) for t, _ in groups})
    how = {
        "wrap": f"new rank r takes old rank r mod {old}",
        "first": "every new rank takes old rank 0's",
        "drop": "left out",
    }[rule]
    return out, f"per-rank state {', '.join(names)} ({old} ranks -> {world}): rule '{rule}': {how}"


@dataclass(frozen=True)
class StateOptions:
    """How a training state is laid out in a target framework."""

    world_size: int
    per_rank: str = "wrap"  # rule for per-rank values under a new world size
    layout: str | None = None  # DCP key layout: get_state_dict or torchtitan
    zero_stage: int | None = None  # DeepSpeed target
    ds_config: Path | None = None  # DeepSpeed target: the run's config (precision, clipping, batch size)


class TrainingFormat(Protocol):
    """What a format that holds a whole training run (weights, optimizer, step, the rest) implements."""

    def layout_of(self, ckpt: Checkpoint) -> str:
        """The name of the checkpoint's key layout ('deepspeed', 'get_state_dict', 'torchtitan', 'flat')."""
        ...

    def read_state(self, ckpt: Checkpoint, need_optimizer: bool) -> TrainingState:
        """The checkpoint's training state by parameter FQN (UsageError when it holds none and one is needed)."""
        ...

    def changes_layout(self, ckpt: Checkpoint, options: StateOptions) -> bool:
        """Whether writing this format's own checkpoint with `options` re-lays its training state (stage, key layout)."""
        ...

    def write_state(self, state: TrainingState, options: StateOptions) -> Checkpoint:
        """A checkpoint view that this format's writer lays out as the framework saves it."""
        ...
