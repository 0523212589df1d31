"""Generated docs stay current with the CLI; every command is documented."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from ckpt_cli.cli import docgen, scripts

ROOT = Path(__file__).resolve().parents[1]


def test_completions_and_man_page_are_current():
    for rel, text in docgen.render_all().items():
        assert (ROOT / rel).read_text() == text, f"{rel} is stale: run python -m ckpt_cli.cli.docgen"


def test_every_command_and_option_has_help():
    cmds = docgen.commands()
    assert {c.name for c in cmds} == {
        "inspect",
        "verify",
        "convert",
        "reshard",
        "merge",
        "split",
        "demo",
        "ls",
        "diff",
        "parity",
        "completion",
    }
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


@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "reshard", "merge", "split", "demo", "ls", "diff", "parity"])
def test_help_works(ckpt, command):
    res = ckpt(command, "--help")
    assert res.code == 0 and "Usage" in res.out


def test_help_names_values_by_what_they_are():
    """Every option that takes a value names it (GLOB, N, DTYPE, FILE...), not by its Python type or parameter name:
    `<str>`, `<list[str]>`, `FILTER_` read as noise in --help, the man page and the completions."""
    from typer.testing import CliRunner

    from ckpt_cli.cli.app import app

    for c in docgen.commands():
        for o in c.options:
            if o.takes_value:
                assert re.fullmatch(r"[A-Z][A-Z=]*", o.metavar), (c.name, o.names, o.metavar)  # not FILTER_, FORMAT_
                assert o.metavar not in {"TEXT", "STR", "INTEGER", "INT", "FLOAT", "PATH"}, (c.name, o.names)
        shown = CliRunner().invoke(app, [c.name, "--help"], env={"COLUMNS": "200"}).output
        assert not re.search(r"<(str|int|float|list)", shown), (c.name, shown)


def test_examples_are_commands_of_the_tested_tour():
    """Each command's --help ends with examples, every one a command the README/docs tour runs (tests/test_readme.py),
    so an example cannot drift from what the tool does; the man page lists them, and every description there and in
    the completions is whole sentences (the convert one was cut mid-sentence)."""
    from test_readme import PAGES, console_blocks, front_door_commands
    from typer.testing import CliRunner

    from ckpt_cli.cli.app import app
    from ckpt_cli.cli.examples import EXAMPLES

    toured = {step.command for page in PAGES for block in console_blocks(page.read_text()) for step in block}
    toured.update(front_door_commands())
    man = (ROOT / "man/ckpt.1").read_text()
    for c in docgen.commands():
        assert EXAMPLES[c.name], c.name
        shown = CliRunner().invoke(app, [c.name, "--help"], env={"COLUMNS": "200"}).output
        for line in EXAMPLES[c.name]:
            assert line in toured, f"{line!r} is not a command of the tested tour"
            assert f"$ {line}" in shown, (c.name, line)
            assert scripts._roff(line) in man
        assert c.help.endswith(".") and c.summary.endswith("."), c.name
    assert ".B 143" in man


def _bash_complete(line: str, cwd: Path) -> list[str]:
    """What the bash script offers for `line` in a bash without the bash-completion package (--norc)."""
    words = line.split(" ")
    program = (
        f"source {ROOT / 'completions/ckpt.bash'}; COMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); "
        f'COMP_CWORD={len(words) - 1}; _ckpt; printf "%s\\n" "${{COMPREPLY[@]}}"'
    )
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], cwd=cwd, capture_output=True, text=True, check=True)
    assert not done.stderr, done.stderr  # `_init_completion: command not found` before
    return sorted(done.stdout.split())


def test_bash_completion_works_without_the_bash_completion_package(tmp_path):
    (tmp_path / "demo").mkdir()
    assert _bash_complete("ckpt con", tmp_path) == ["convert"]
    assert _bash_complete("ckpt completion z", tmp_path) == ["zsh"]
    assert _bash_complete("ckpt convert demo out --to h", tmp_path) == ["hf"]
    assert _bash_complete("ckpt diff --format-a dc", tmp_path) == ["dcp", "dcp-hf"]
    assert _bash_complete("ckpt inspect --tr", tmp_path) == ["--tree", "--trust-pickle"]
    assert _bash_complete("ckpt inspect de", tmp_path) == ["demo"]


@pytest.mark.skipif(not shutil.which("fish"), reason="fish is not installed")
def test_fish_completion_offers_the_same(tmp_path):
    def complete(line: str) -> list[str]:
        program = f"source {ROOT / 'completions/ckpt.fish'}; complete -C '{line}'"
        out = subprocess.run(["fish", "--no-config", "-c", program], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
        return sorted(row.split("\t")[0] for row in out.splitlines())

    assert complete("ckpt completion z") == ["zsh"]
    assert complete("ckpt convert demo out --to h") == ["hf"]
    assert "convert" in complete("ckpt con")


@pytest.mark.skipif(not shutil.which("zsh"), reason="zsh is not installed")
def test_zsh_completion_offers_the_same(tmp_path):
    """In a real interactive zsh (zpty): the subcommand's own arguments are its first (before, `_arguments` took the
    subcommand's name for its first argument, so `ckpt completion z` offered nothing)."""
    functions = tmp_path / "functions"
    functions.mkdir()
    shutil.copy(ROOT / "completions/_ckpt", functions / "_ckpt")
    (tmp_path / "demo").mkdir()

    def complete(line: str) -> list[str]:
        script = Path(__file__).with_name("zsh_capture.zsh")
        done = subprocess.run(["zsh", str(script), str(functions), line], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        return sorted(done.stdout.split())

    assert complete("ckpt con") == ["convert"]
    assert complete("ckpt completion z") == ["zsh"]
    assert complete("ckpt convert demo out --to h") == ["hf"]
    assert complete("ckpt diff --format-a dc") == ["dcp", "dcp-hf"]
    assert complete("ckpt inspect --tr") == ["--tree", "--trust-pickle"]
    assert complete("ckpt inspect de") == ["demo"]


def test_completion_command_prints_the_generated_scripts():
    from typer.testing import CliRunner

    from ckpt_cli.cli.app import app

    for shell, rel in (("bash", "completions/ckpt.bash"), ("zsh", "completions/_ckpt"), ("fish", "completions/ckpt.fish")):
        done = CliRunner().invoke(app, ["completion", shell])
        assert done.exit_code == 0 and done.output == (ROOT / rel).read_text()
    assert CliRunner().invoke(app, ["completion", "tcsh"]).exit_code == 2
