"""`ckpt diff A B`: exit 0 when equal (within --atol/--rtol), 1 when not."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import PATH, declared_command
from ckpt_cli.options import DiffOptions, RunOptions

if TYPE_CHECKING:
    from ckpt_cli.ops.diff import DiffReport

MAX_GROUPS = 20  # group rows shown (--json lists all)
MAX_NAMES = 4  # names shown per list

# A and B stay strings as every SRC does (an s3:// URL is no Path); shown as paths in --help
SideA = Annotated[
    str, typer.Argument(metavar="A", click_type=PATH, help="The first checkpoint (any format, or a run folder).", show_default=False)
]
SideB = Annotated[
    str, typer.Argument(metavar="B", click_type=PATH, help="The second checkpoint (any format, or a run folder).", show_default=False)
]


def diff(a: str, b: str, **values: Any) -> None:
    """Compare two checkpoints: tensors added, removed, renamed or changed (max |a-b|, relative L2, cosine), training state."""
    from ckpt_cli.ops.diff import diff as diff_op

    json_, quiet = values.pop("json"), values.pop("quiet")
    with output.reading(f"diff {PurePosixPath(a).name} {PurePosixPath(b).name}", quiet):
        report = diff_op(a, b, DiffOptions(**values))
    if json_:
        output.emit_json(report.to_json())
    else:
        output.emit(render(report))
    if not report.equal:
        raise typer.Exit(1)


OPTIONS = ("atol", "rtol", "filter", "depth", "json", "format_a", "format_b", "tag_a", "tag_b", "trust_pickle", "quiet")
declared_command(diff, [("a", SideA), ("b", SideB)], OPTIONS, DiffOptions, RunOptions)  # in the order --help lists them


def _num(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k}={val}" for k, val in v.items())
    return str(v)


def _verdict(report: DiffReport) -> str:
    tolerance = "bit-exact" if report.exact else f"within atol={report.atol:g} rtol={report.rtol:g}"
    if report.equal:
        return f"equal ({tolerance})"
    c = report.counts()
    parts = [f"{c['differ']} tensors differ ({tolerance})"] if c["differ"] else []
    labels = {
        "only_in_a": "only in A",
        "only_in_b": "only in B",
        "renamed": "renamed",
        "shape_changed": "shape changed",
        "dtype_changed": "dtype changed",
        "training_state": "training-state values differ",
    }
    parts += [f"{c[k]} {label}" for k, label in labels.items() if c[k] and (k != "dtype_changed" or report.exact)]
    return "different: " + ", ".join(parts)


def render(report: DiffReport) -> str:
    c = report.counts()
    head = f"{c['matched']} tensors by {report.matched_by}: {c['identical']} identical"
    if not report.exact:
        head += f", {c['within_tolerance']} within tolerance"
    head += f", {c['differ']} differ" if c["differ"] else ""
    lines = [
        f"A        {report.a.path} ({report.a.format}, {report.a.tensors} tensors)",
        f"B        {report.b.path} ({report.b.format}, {report.b.tensors} tensors)",
        f"matched  {head}",
        f"result   {_verdict(report)}",
    ]
    changed = {t.group for t in report.tensors if not t.values.identical}
    groups = [g for g in report.groups() if g.group in changed]
    if groups:
        width = max([len(g.group) for g in groups[:MAX_GROUPS]] + [5])
        lines += ["", f"{'group':<{width}}  tensors  differ  max |a-b|     rel L2      cosine  worst tensor"]
        for g in groups[:MAX_GROUPS]:
            lines.append(
                f"{g.group:<{width}}  {g.tensors:>7}  {g.differ:>6}  {_num(g.max_abs):>9}  {_num(g.rel_l2):>9}"
                f"  {_num(g.cosine, '.6f'):>10}  {g.worst}"
            )
        if len(groups) > MAX_GROUPS:
            lines.append(f"... and {len(groups) - MAX_GROUPS} more groups (--json lists all)")
    lists = [
        ("only in A", report.only_in_a),
        ("only in B", report.only_in_b),
        ("renamed", [f"{x} -> {y}" for x, y in report.renamed]),
        ("shape changed", [f"{d['name']} {d['a']} -> {d['b']}" for d in report.shape_changed]),
    ]
    casts: dict[str, list[str]] = {}
    for d in report.dtype_changed:
        casts.setdefault(f"{d['a']} -> {d['b']}", []).append(d["name"])
    shown = [f"{label} ({len(items)}): {output.few(items, MAX_NAMES)}" for label, items in lists if items]
    shown += [f"dtype changed ({len(names)}): {cast}: {output.few(names, MAX_NAMES)}" for cast, names in casts.items()]
    if shown:
        lines += ["", *shown]
    if report.training_state:
        lines += ["", "training state (A -> B)"]
        width = max(len(d["key"]) for d in report.training_state)
        lines += [f"  {d['key']:<{width}}  {_value(d['a'])} -> {_value(d['b'])}" for d in report.training_state]
    lines += [f"note: {t['side'].upper()}: {t['name']} is tied to {t['tied_to']} (the same data): not a difference" for t in report.tied]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
