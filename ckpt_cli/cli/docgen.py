"""Generate `completions/` (bash, zsh, fish) and `man/ckpt.1` from the CLI itself (cli/scripts.py renders them).

python -m ckpt_cli.cli.docgen          # rewrite the files
python -m ckpt_cli.cli.docgen --check  # exit 1 when they are stale (the test suite does this)
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer.main

from ckpt_cli.cli import scripts
from ckpt_cli.cli.app import app
from ckpt_cli.cli.scripts import Cmd

ROOT = Path(__file__).resolve().parents[2]


def commands() -> list[Cmd]:
    return scripts.commands(typer.main.get_command(app))


def render_all() -> dict[str, str]:
    return scripts.render_all(commands())


def main() -> None:
    check = "--check" in sys.argv[1:]
    stale = []
    for rel, text in render_all().items():
        path = ROOT / rel
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        sys.stderr.write(f"stale: {', '.join(stale)}; run python -m ckpt_cli.cli.docgen\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
