"""Generated docs stay current with the CLI; every command is documented."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ckpt_cli.cli import docgen

ROOT = Path(__file__).resolve().parents[1]


def test_completions_and_man_page_are_current():
    for rel, text in docgen.render_all().items():
        assert (ROOT / rel).read_text() == text, f"{rel} is stale: run python -m ckpt_cli.cli.docgen"


def test_every_command_and_option_has_help():
    cmds = docgen.commands()
    assert {c.name for c in cmds} == {"inspect", "verify", "convert", "reshard", "merge", "split", "demo", "ls", "diff"}
    for c in cmds:
        assert c.help, c.name
        for o in c.options:
            assert o.help, (c.name, o.names)
    man = (ROOT / "man/ckpt.1").read_text()
    readme = (ROOT / "README.md").read_text()
    for c in cmds:
        assert f"ckpt {c.name}" in man
        assert f"ckpt {c.name}" in readme, f"README lacks a tour entry for {c.name}"


def test_completion_scripts_parse():
    subprocess.run(["bash", "-n", str(ROOT / "completions/ckpt.bash")], check=True)
    if shutil.which("zsh"):
        subprocess.run(["zsh", "-n", str(ROOT / "completions/_ckpt")], check=True)
    if shutil.which("fish"):
        subprocess.run(["fish", "--no-execute", str(ROOT / "completions/ckpt.fish")], check=True)


@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "reshard", "merge", "split", "demo", "ls", "diff"])
def test_help_works(ckpt, command):
    res = ckpt(command, "--help")
    assert res.code == 0 and "Usage" in res.out
