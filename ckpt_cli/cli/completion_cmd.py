"""`ckpt completion SHELL`: the shell's completion script, made from the CLI itself (the files under completions/)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from ckpt_cli.cli import output


class ShellName(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


Shell = Annotated[ShellName, typer.Argument(metavar="SHELL", help="bash, zsh or fish.", show_default=False)]


def completion(ctx: typer.Context, shell: Shell) -> None:
    """Print the completion script for bash, zsh or fish.

    bash: `ckpt completion bash > ~/.local/share/bash-completion/completions/ckpt` (or source it from ~/.bashrc; it
    works without the bash-completion package). zsh: write it as `_ckpt` in a folder of your $fpath. fish:
    `ckpt completion fish > ~/.config/fish/completions/ckpt.fish`."""
    from ckpt_cli.cli import scripts  # it names every format: imported only for this command (`ckpt --help` imports none)

    tree = scripts.commands(ctx.find_root().command)
    output.emit(scripts.render_all(tree)[scripts.SHELLS[shell.value]].rstrip("\n"))
