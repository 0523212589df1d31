"""`ckpt ls ROOT`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import Json, TrustPickle
from ckpt_cli.core import storage
from ckpt_cli.core.sizes import human_bytes
from ckpt_cli.errors import UsageError

Root = Annotated[
    Path, typer.Argument(metavar="ROOT", help="A run root: the folder a training run saves its checkpoints under.", show_default=False)
]


def ls(root: Root, json_: Json = False, trust_pickle: TrustPickle = False) -> None:
    """List every checkpoint under a run root, marking the newest complete one of each run.

    Each row: path, framework, format, step, world size, size, and whether the structural check passes.
    Exit 1 when none is complete."""
    from ckpt_cli.ops import runs

    root = storage.location(root)  # s3://bucket/prefix too
    if storage.is_remote(root):
        storage.fresh()
    if not root.is_dir():
        raise UsageError(f"{root}: not a folder" if root.exists() else f"{root}: no such file or folder")
    rows = runs.listing(root, trust_pickle)
    if not rows:
        raise UsageError(runs.not_found_message(root, listing=True))
    if json_:
        output.emit_json({"root": str(root), "checkpoints": rows})
    else:
        output.emit(render(rows))
    if not any(r["complete"] for r in rows):
        raise typer.Exit(1)


def render(rows: list[dict[str, Any]]) -> str:
    width = max([len("path")] + [len(r["path"]) for r in rows])
    lines = [f"  {'path':<{width}}  {'framework':<10} {'format':<11} {'step':>6} {'world':>5} {'size':>10}  state"]
    for r in rows:
        state = "complete" if r["complete"] else f"INCOMPLETE: {r['problem']}"
        cells = (r["framework"] or "-", r["format"], r["step"] if r["step"] is not None else "-", r["world_size"] or "-")
        mark = "*" if r["newest"] else " "
        size = human_bytes(r["bytes"])
        lines.append(f"{mark} {r['path']:<{width}}  {cells[0]:<10} {cells[1]:<11} {cells[2]!s:>6} {cells[3]!s:>5} {size:>10}  {state}")
    if any(r["newest"] for r in rows):
        lines.append("* the newest complete checkpoint of its run (what inspect, verify and convert use when given the run)")
    return "\n".join(lines)
