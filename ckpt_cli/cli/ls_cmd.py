"""`ckpt ls ROOT`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ckpt_cli import store
from ckpt_cli.cli import output
from ckpt_cli.cli.options import Json, Quiet, TrustPickle
from ckpt_cli.core.sizes import human_bytes
from ckpt_cli.errors import UsageError
from ckpt_cli.formats import registry

Root = Annotated[
    Path, typer.Argument(metavar="ROOT", help="A run root: the folder a training run saves its checkpoints under.", show_default=False)
]


ListFormat = Annotated[
    Optional[str], typer.Option("--format", metavar="FORMAT", help=f"Only checkpoints of this format: {', '.join(registry.FORMATS)}.")
]
ListTag = Annotated[
    Optional[str],
    typer.Option(
        "--tag", metavar="TAG", help="Only the checkpoints this tag names: by name, name stem or step (100, step_100, global_step100)."
    ),
]


def ls(
    root: Root,
    json_: Json = False,
    format_: ListFormat = None,
    tag: ListTag = None,
    trust_pickle: TrustPickle = False,
    quiet: Quiet = False,
) -> None:
    """List every checkpoint under a run root, marking the newest complete one of each run.

    Each row: path, framework, format, step, world size, size, and whether the structural check passes.
    Exit 1 when none is complete."""
    from ckpt_cli.ops import runs
    from ckpt_cli.ops.resolve import not_found_message

    if format_ is not None:
        registry.get(format_)  # an unknown name: exit 2 before any listing

    root = store.location(root)  # s3://bucket/prefix too
    store.fresh()
    if not root.is_dir():
        raise UsageError(f"{root}: not a folder" if root.exists() else f"{root}: no such file or folder")
    with output.reading(f"ls {root.name}", quiet):
        rows = runs.listing(root, trust_pickle, format_, tag)
    if not rows and (format_ or tag):
        wanted = " and ".join(w for w in (f"--format {format_}" if format_ else "", f"--tag {tag}" if tag else "") if w)
        raise UsageError(f"{root}: no checkpoint matches {wanted} (ckpt ls {root} lists them all)")
    if not rows:
        raise UsageError(not_found_message(root, listing=True))
    if json_:
        output.emit_json({"root": str(root), "checkpoints": rows})
    else:
        output.emit(render(rows))
        chosen = [r["path"] for r in rows if r.get("chosen")]
        if chosen and sum(r["newest"] for r in rows) > 1:  # several runs marked: say which one the root itself means
            output.info(f"note: given {root} itself, every command uses '{chosen[0]}'; point at a run's folder for its own", quiet)
    if not any(r["complete"] for r in rows):
        raise typer.Exit(1)


def render(rows: list[dict[str, Any]]) -> str:
    width = max([len("path")] + [len(r["path"]) for r in rows])
    lines = [f"  {'path':<{width}}  {'framework':<10} {'format':<11} {'step':>6} {'world':>5} {'size':>10}  state"]
    for r in rows:
        state = "complete" if r["complete"] else f"{'UNSUPPORTED' if r.get('unsupported') else 'INCOMPLETE'}: {r['problem']}"
        cells = (r["framework"] or "-", r["format"], r["step"] if r["step"] is not None else "-", r["world_size"] or "-")
        mark = "*" if r["newest"] else " "
        size = human_bytes(r["bytes"])
        lines.append(f"{mark} {r['path']:<{width}}  {cells[0]:<10} {cells[1]:<11} {cells[2]!s:>6} {cells[3]!s:>5} {size:>10}  {state}")
    if any(r["newest"] for r in rows):
        lines.append("* the newest complete checkpoint of its run (what inspect, verify and convert use when given the run)")
    return "\n".join(lines)
