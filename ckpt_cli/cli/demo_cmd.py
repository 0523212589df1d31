"""`ckpt demo DIR`."""

from __future__ import annotations

from ckpt_cli.cli import output
from ckpt_cli.cli.options import Dest, Overwrite


def demo(dest: Dest, overwrite: Overwrite = False) -> None:
    """Write small, real sample checkpoints in every format into DIR, to try every command on."""
    from ckpt_cli.ops.demo import write_demo

    for path in write_demo(dest, overwrite):
        output.emit(str(path))
    output.info(
        f"try: ckpt inspect {dest / 'training_state.pt'}   ckpt verify --deep {dest / 'hf'}   "
        f"ckpt merge {dest / 'hf'} {dest / 'merged.safetensors'}"
    )
