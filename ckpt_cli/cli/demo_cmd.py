"""`ckpt demo DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import Json, Quiet

DemoDir = Annotated[
    Path,
    typer.Argument(metavar="DIR", help="Folder to write the samples into (refused if it exists, unless --overwrite).", show_default=False),
]
DemoOverwrite = Annotated[bool, typer.Option("--overwrite", help="Write the samples afresh into an existing folder.")]


def demo(dest: DemoDir, overwrite: DemoOverwrite = False, json_: Json = False, quiet: Quiet = False) -> None:
    """Write small, real sample checkpoints in every format into DIR, to try every command on."""
    from ckpt_cli.ops.demo import write_demo

    with output.reading("demo", quiet, "training a tiny model and saving it"):
        written = write_demo(dest, overwrite)
    if json_:
        output.emit_json({"dest": str(dest), "checkpoints": [str(path) for path in written]})
    else:
        output.emit("\n".join(str(path) for path in written))
    output.info(
        f"try: ckpt inspect {dest / 'training_state.pt'}   ckpt verify --deep {dest / 'hf'}   "
        f"ckpt merge {dest / 'hf'} {dest / 'merged.safetensors'}",
        quiet,
    )
