"""`diff`: two checkpoints compared tensor by tensor and by training state, in any two formats.

Tensors are matched by name; when the two key layouts differ (a DeepSpeed and a DCP save of one run, a
training checkpoint and a weights export), by parameter name as `verify --against` does
(crossframework.comparable). Tensors left unmatched on both sides with the same dtype, shape and
bytes (a streamed SHA-256) are reported as renamed. Values stream through ops/values.py, a window
at a time; identical bytes cost one read of each side and no arithmetic. Nothing else is read: the
training state comes from what inspect already parsed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Container
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core import meter, roles
from ckpt_cli.core.model import Checkpoint, LazyPieces, TensorEntry
from ckpt_cli.core.reading import WINDOW_BUDGET, SourceFiles, tensor_bytes
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.ops import crossframework
from ckpt_cli.ops.digests import tensor_digest
from ckpt_cli.ops.source import open_checkpoint
from ckpt_cli.ops.transform import matches
from ckpt_cli.ops.values import ValueDiff, compare_values
from ckpt_cli.options import DiffOptions

STATE_SECTIONS = ("optimizer", "lr_scheduler", "dataloader", "rng")
ONE_SIDED_QUIET = ("param_groups",)  # held by one side only: the optimizer entry says so already


@dataclass(slots=True)  # one per tensor compared, kept for the report: 82,000 of an MoE model's
class TensorDiff:
    name: str
    group: str
    dtype_a: str
    dtype_b: str
    shape: tuple[int, ...]  # the tensor's own (not a list per tensor)
    values: ValueDiff
    within: bool  # equal within the tolerance (bit-exact without one)

    def to_json(self) -> dict[str, Any]:
        v = self.values
        return {
            "name": self.name,
            "group": self.group,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "shape": list(self.shape),
            "identical": v.identical,
            "equal": self.within,
            "max_abs": _finite(v.max_abs),
            "rel_l2": _finite(v.rel_l2),
            "cosine": v.cosine,
            "mismatched": v.mismatched,
        }


@dataclass
class GroupDiff:
    group: str
    tensors: int
    differ: int  # outside the tolerance (without one: not bit-identical)
    max_abs: float
    rel_l2: float  # the group's worst tensor
    cosine: float | None  # the group's lowest
    worst: str  # the tensor with the largest relative L2

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "max_abs": _finite(self.max_abs), "rel_l2": _finite(self.rel_l2)}


@dataclass
class Side:
    path: str
    format: str
    tag: str | None
    step: int | None
    tensors: int

    @classmethod
    def of(cls, ckpt: Checkpoint) -> Side:
        return cls(ckpt.path, ckpt.format, ckpt.tag, ckpt.step, len(ckpt.tensors))


@dataclass
class DiffReport:
    a: Side
    b: Side
    atol: float
    rtol: float
    matched_by: str = "name"  # or "parameter name (X vs Y key layouts)"
    tensors: list[TensorDiff] = field(default_factory=list)  # matched, same shape: worst first
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)  # (name in A, name in B)
    shape_changed: list[dict[str, Any]] = field(default_factory=list)  # {name, a, b}
    dtype_changed: list[dict[str, Any]] = field(default_factory=list)  # {name, a, b}
    tied: list[dict[str, Any]] = field(default_factory=list)  # {side, name, tied_to}: aliases one side stores once
    training_state: list[dict[str, Any]] = field(default_factory=list)  # {key, a, b}
    notes: list[str] = field(default_factory=list)
    depth: int | None = None

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0

    @property
    def differing(self) -> list[TensorDiff]:
        return [t for t in self.tensors if not t.within]

    @property
    def equal(self) -> bool:
        """Same names, shapes, values within the tolerance and training state; without one, dtypes and bytes too."""
        dtypes_count = self.exact and bool(self.dtype_changed)
        lists = self.only_in_a or self.only_in_b or self.renamed or self.shape_changed or self.training_state
        return not (self.differing or lists or dtypes_count)

    def groups(self) -> list[GroupDiff]:
        """Per module prefix: the compared tensors, how many differ, the worst figures; worst first."""
        by: dict[str, list[TensorDiff]] = {}
        for t in self.tensors:
            by.setdefault(t.group, []).append(t)
        out = []
        for group, items in by.items():
            worst = max(items, key=_badness)
            cosines = [t.values.cosine for t in items if t.values.cosine is not None]
            out.append(
                GroupDiff(
                    group,
                    len(items),
                    sum(not t.within for t in items),
                    max(t.values.max_abs for t in items),
                    worst.values.rel_l2,
                    min(cosines) if cosines else None,
                    worst.name,
                )
            )
        out.sort(key=lambda g: (g.differ > 0, _order(g.rel_l2), _order(g.max_abs)), reverse=True)
        return out

    def counts(self) -> dict[str, int]:
        identical = sum(t.values.identical for t in self.tensors)
        return {
            "matched": len(self.tensors) + len(self.shape_changed),
            "identical": identical,
            "within_tolerance": sum(t.within and not t.values.identical for t in self.tensors),
            "differ": len(self.differing),
            "only_in_a": len(self.only_in_a),
            "only_in_b": len(self.only_in_b),
            "renamed": len(self.renamed),
            "shape_changed": len(self.shape_changed),
            "dtype_changed": len(self.dtype_changed),
            "training_state": len(self.training_state),
        }

    def to_json(self) -> dict[str, Any]:
        """The stable `diff --json` document (keys listed in the README)."""
        return {
            "a": vars(self.a),
            "b": vars(self.b),
            "equal": self.equal,
            "atol": self.atol,
            "rtol": self.rtol,
            "matched_by": self.matched_by,
            "counts": self.counts(),
            "groups": [g.to_json() for g in self.groups()],
            "tensors": [t.to_json() for t in self.tensors],
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "renamed": [{"a": a, "b": b} for a, b in self.renamed],
            "shape_changed": self.shape_changed,
            "dtype_changed": self.dtype_changed,
            "tied": self.tied,
            "training_state": self.training_state,
            "notes": self.notes,
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _order(x: float) -> float:
    return x if not math.isnan(x) else math.inf


_IDENTICAL_BADNESS = (False, 0.0, 0.0)  # shared: sorting 82,000 identical tensors made a tuple for each


def _badness(t: TensorDiff) -> tuple[bool, float, float]:
    if t.values.identical:
        return _IDENTICAL_BADNESS
    return (not t.within, _order(t.values.rel_l2), _order(t.values.max_abs))


def group_of(name: str, depth: int | None = None) -> str:
    """The module prefix a tensor is summarised under: the first `depth` name components; by default the
    module up to its first numeric component (`model.layers.3`), else the module holding the tensor
    (`model.norm`). Optimizer state (`optimizer.state.FQN.KEY`) groups as its parameter, under its prefix."""
    parts = name.split(".")
    if depth:
        return ".".join(parts[:depth])
    if len(parts) > 3 and roles.is_optimizer_key(parts[0].lower()) and parts[1] == "state":
        return ".".join(parts[:2]) + "." + group_of(".".join(parts[2:-1]))
    module = parts[:-1] or parts
    for i, part in enumerate(module):
        if part.isdigit():
            return ".".join(module[: i + 1])
    return ".".join(module)


def diff(path_a: str | Path, path_b: str | Path, options: DiffOptions) -> DiffReport:
    if options.atol < 0 or options.rtol < 0 or not (math.isfinite(options.atol) and math.isfinite(options.rtol)):
        raise UsageError("--atol and --rtol take finite values >= 0")
    if options.depth is not None and options.depth < 1:
        raise UsageError("--depth takes a number >= 1")
    # Pieces located as each tensor is compared and forgotten after: two wide checkpoints' pieces at once took 490 MB
    a = open_checkpoint(path_a, options.format_a, options.tag_a, options.trust_pickle, pieces_when_read=True)
    b = open_checkpoint(path_b, options.format_b, options.tag_b, options.trust_pickle, pieces_when_read=True)
    return pair(a, b, options)[0]


def pair(a: Checkpoint, b: Checkpoint, options: DiffOptions) -> tuple[DiffReport, Checkpoint, Checkpoint]:
    """Two open checkpoints compared tensor by tensor and by training state: the pairing `diff` reports and `verify
    --against` judges (ops/verify.py). Also the two sides as matched (crossframework.comparable), for their roles."""
    report = DiffReport(Side.of(a), Side.of(b), options.atol, options.rtol, depth=options.depth)
    report.notes += [f"A: {n}" for n in a.notes] + [f"B: {n}" for n in b.notes]
    mine, theirs, matched = crossframework.comparable(a, b)
    if matched:
        report.matched_by = matched.removeprefix("by ")
        report.notes += _left_out(a, mine, "A") + _left_out(b, theirs, "B")
    names_a = [n for n in mine.tensors if matches(n, options.filter)]
    names_b = [n for n in theirs.tensors if matches(n, options.filter)]
    if options.filter and not names_a and not names_b:  # as inspect and the writers: an empty selection is a wrong call
        raise UsageError(f"--filter {' '.join(options.filter)} matches no tensor of {a.path} or {b.path}")
    # The two sides' read-ahead windows together hold half what one reader's may: diff holds two sources' metadata
    # already (an MoE ZeRO-2 diff peaked 6 MB over its bound with 8 MB a side), and compares a tensor at a time.
    quarter = WINDOW_BUDGET // 4
    with closing(SourceFiles(window_budget=quarter)) as sources_a, closing(SourceFiles(window_budget=quarter)) as sources_b:
        _compare(report, mine, theirs, names_a, names_b, options, sources_a, sources_b)
    if options.filter:
        report.notes.append("training state not compared (--filter narrows the diff to tensors)")
    else:
        report.training_state = training_state_diff(a, b)
    return report, mine, theirs


def _left_out(original: Checkpoint, view: Checkpoint, side: str) -> list[str]:
    """Tensors of a side that matching by parameter name leaves out (RNG states, a framework's own copies)."""
    kept = {id(t.pieces) for t in view.tensors.values()}
    out = [n for n, t in original.tensors.items() if id(t.pieces) not in kept]
    if not out:
        return []
    few = ", ".join(out[:3]) + (f", ... ({len(out) - 3} more)" if len(out) > 3 else "")
    return [f"{side}: {len(out)} tensor{'s' if len(out) > 1 else ''} outside the weights and optimizer state not compared: {few}"]


def _compare(
    report: DiffReport,
    a: Checkpoint,
    b: Checkpoint,
    names_a: list[str],
    names_b: list[str],
    options: DiffOptions,
    sources_a: SourceFiles,
    sources_b: SourceFiles,
) -> None:
    # Without a filter the names are every tensor's: the tensors' own dicts answer membership (sets of an MoE
    # checkpoint's 82,000 names took 4 MB each).
    in_a: Container[str] = set(names_a) if options.filter else a.tensors
    in_b: Container[str] = set(names_b) if options.filter else b.tensors
    meter.stage("comparing values", sum(a.tensors[n].nbytes for n in names_a if n in in_b))
    for name in names_a:
        if name not in in_b:
            continue
        x, y = a.tensors[name], b.tensors[name]
        if x.shape != y.shape:
            report.shape_changed.append({"name": name, "a": list(x.shape), "b": list(y.shape)})
            continue
        if x.dtype != y.dtype:
            report.dtype_changed.append({"name": name, "a": x.dtype.name, "b": y.dtype.name})
        values = compare_values(x, y, options.atol, options.rtol, sources_a, sources_b)
        meter.advance(x.nbytes)
        for pieces in (x.pieces, y.pieces):
            if isinstance(pieces, LazyPieces):
                pieces.release()
        group = sys.intern(group_of(name, options.depth))  # a few hundred groups, not a string per tensor
        report.tensors.append(
            TensorDiff(name, group, x.dtype.name, y.dtype.name, x.shape, values, values.within(options.atol, options.rtol))
        )
    report.tensors.sort(key=_badness, reverse=True)
    only_a, only_b = [n for n in names_a if n not in in_b], [n for n in names_b if n not in in_a]
    both = {n for n in names_a if n in in_b} if only_a or only_b else set()  # what tied_aliases needs, when it runs
    for side, ckpt, only, sources in (("a", a, only_a, sources_a), ("b", b, only_b, sources_b)):
        ties = tied_aliases(ckpt, only, both)
        ties.update(tied_copies(ckpt, [n for n in only if n not in ties], both, sources))
        for alias, owner in ties.items():
            report.tied.append({"side": side, "name": alias, "tied_to": owner})
            only.remove(alias)
    report.renamed = find_renamed([a.tensors[n] for n in only_a], [b.tensors[n] for n in only_b], sources_a, sources_b)
    moved_a, moved_b = {x for x, _ in report.renamed}, {y for _, y in report.renamed}
    report.only_in_a = [n for n in only_a if n not in moved_a]
    report.only_in_b = [n for n in only_b if n not in moved_b]


def tied_aliases(ckpt: Checkpoint, only: list[str], both: set[str]) -> dict[str, str]:
    """Names one side holds alone that are tied there (the same stored data) to a weight both sides hold: alias ->
    that weight. The other side stores the tie once (safetensors does), so they are no difference."""
    out = {}
    for group in ckpt.tied_groups():
        owner = next((n for n in group if n in both), None)
        if owner is not None:
            out.update({n: owner for n in group if n in only})
    return out


def tied_copies(ckpt: Checkpoint, only: list[str], both: set[str], sources: SourceFiles) -> dict[str, str]:
    """Names one side holds alone whose data is byte for byte a weight both sides hold (same dtype and shape, two or
    more dims, not one repeated value): alias -> that weight. A tied weight saved twice (torch DCP writes each name's
    copy, a weights export stores it once). A constant tensor (zeros, ones) is no evidence of a tie and is left alone."""
    alone = [t for t in (ckpt.tensors[n] for n in only) if t.role == "model" and len(t.shape) >= 2 and t.numel]
    if not alone:
        return {}
    key = lambda t: (t.dtype.name, t.shape)  # noqa: E731
    wanted = {key(t) for t in alone}
    owners: dict[Any, list[TensorEntry]] = {}
    for name, t in ckpt.tensors.items():
        if name in both and t.role == "model" and key(t) in wanted:
            owners.setdefault(key(t), []).append(t)
    digests: dict[str, str] = {}

    def digest(t: TensorEntry) -> str:
        if t.name not in digests:
            digests[t.name] = tensor_digest(t, sources)
        return digests[t.name]

    out = {}
    for t in alone:
        if key(t) in owners and not _constant(t, sources):
            owner = next((o for o in owners[key(t)] if digest(o) == digest(t)), None)
            if owner is not None:
                out[t.name] = owner.name
    return out


def _constant(t: TensorEntry, sources: SourceFiles) -> bool:
    """The tensor's first block is one value repeated (an initialisation, not trained data)."""
    block = bytes(next(iter(tensor_bytes(t, sources)), b""))
    size = t.dtype.itemsize or 1
    return block[:size] * (len(block) // size) == block[: len(block) // size * size]


def find_renamed(
    only_a: list[TensorEntry], only_b: list[TensorEntry], sources_a: SourceFiles, sources_b: SourceFiles
) -> list[tuple[str, str]]:
    """Pairs (A name, B name) of unmatched tensors with the same dtype, shape and bytes. Only tensors whose dtype and
    shape occur on both sides are hashed (streamed SHA-256 of their logical bytes); each pairs at most once."""
    key = lambda t: (t.dtype.name, t.shape)  # noqa: E731
    shared = {key(t) for t in only_a} & {key(t) for t in only_b}
    if not shared:
        return []
    hashes_b: dict[tuple[Any, str], list[str]] = {}
    for t in only_b:
        if key(t) in shared:
            hashes_b.setdefault((key(t), tensor_digest(t, sources_b)), []).append(t.name)
    pairs = []
    for t in only_a:
        if key(t) in shared:
            candidates = hashes_b.get((key(t), tensor_digest(t, sources_a)))
            if candidates:
                pairs.append((t.name, candidates.pop(0)))
    return pairs


# ---------------------------------------------------------------------------------------- training state


def training_summary(ckpt: Checkpoint) -> dict[str, dict[str, Any] | None]:
    """What a resume reads beyond the tensors, by section: the step, the optimizer (kind, states, param groups and
    their hyper-parameters), the LR scheduler, the dataloader, whether RNG states are saved. From the parsed metadata."""
    state = roles.describe_training_state(ckpt)
    out: dict[str, dict[str, Any] | None] = {"step": {"": ckpt.step} if ckpt.step is not None else None}
    for section in STATE_SECTIONS:
        value = state.get(section)
        if section == "rng":
            out[section] = {"": "saved"} if value else None
        elif isinstance(value, dict):
            out[section] = {k: v for k, v in value.items() if isinstance(v, (int, float, str, bool, list)) or v is None}
        else:
            out[section] = None
    hyper = {}
    for i, group in enumerate(_param_groups(ckpt) if out["optimizer"] is not None else []):
        for k, v in group.items():
            if k != "params" and (isinstance(v, (int, float, str, bool, list, tuple)) or v is None):
                hyper[f"{i}.{k}"] = list(v) if isinstance(v, tuple) else v
    out["param_groups"] = hyper or None
    return out


def _param_groups(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """As saved: one pickled list (torch files, DeepSpeed, a Trainer's optimizer.pt), else as the format's training
    reader finds them (DCP's flattened leaves, torchtitan's per-parameter ones)."""
    for obj in ckpt.objects.values():
        if obj.path and str(obj.path[-1]) == "param_groups" and isinstance(obj.value, list):
            return [g for g in obj.value if isinstance(g, dict)]
    try:
        return crossframework.training_format(ckpt).read_state(ckpt, need_optimizer=False).groups
    except CkptError:
        return []


def training_state_diff(a: Checkpoint, b: Checkpoint) -> list[dict[str, Any]]:
    """Entries {key, a, b}: a section held by one side only (its summary against null), else the values of the keys
    both sides hold that differ (keys one format records and the other does not, such as DeepSpeed's optimizer
    wrapper, are not differences)."""
    sa, sb = training_summary(a), training_summary(b)
    out: list[dict[str, Any]] = []
    for section in sa:
        x, y = sa[section], sb[section]
        if x is None and y is None:
            continue
        if x is None or y is None:
            if section not in ONE_SIDED_QUIET:
                out.append({"key": section, "a": _whole(x), "b": _whole(y)})
            continue
        for k in [k for k in x if k in y]:
            if not _same(x[k], y[k]):
                out.append({"key": f"{section}.{k}" if k else section, "a": x[k], "b": y[k]})
    return out


def _whole(summary: dict[str, Any] | None) -> Any:
    if summary is None or set(summary) != {""}:
        return summary
    return summary[""]


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return bool(x == y)
