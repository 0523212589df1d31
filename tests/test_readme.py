"""The console examples of the README and of every page under docs/ run verbatim and print what they show.

Every ```console block of README.md and of the PAGES is a test. In a block, a line starting with `$ ` is a command and
the lines after it, up to the next command, are its expected output (stdout and stderr together, in the
order a terminal shows them). All blocks run in order (the README's, then each page's in PAGES order) in one temporary directory, as a
newcomer would type them after the README's **Try it** command (which writes `demo/`), so later blocks use what
earlier ones wrote.
Each command runs in its own `bash -c` with the venv's `ckpt` first on PATH and a fixed terminal width.

The output must match byte for byte, sizes and counts included; nothing is normalised, because nothing
shown varies: the demo trains from a fixed seed, and ckpt's writers are reproducible (the `save_id` of a
DCP checkpoint ckpt writes is a hash of its metadata). Keep it so: `torch.distributed.checkpoint` draws a
random `save_id` on every save, so the README does not show `inspect demo/dcp`, and it shows no timings.

```bash``` blocks (torchrun launches, a user's own DeepSpeed config) are documentation and are not run.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The manual, in the order its examples build on each other (usage's outputs are frameworks' inputs, ...).
PAGES = [README] + [ROOT / "docs" / f"{name}.md" for name in ("usage", "frameworks", "run-folders", "api", "scale", "safety", "design")]


@dataclass(frozen=True)
class Step:
    command: str
    expected: str  # every line newline-terminated, as the command prints it


def console_blocks(text: str) -> list[list[Step]]:
    """The ```console blocks of a markdown text, each as its commands and their expected output."""
    return [steps for _, steps in console_blocks_with_extras(text)]


def console_blocks_with_extras(text: str) -> list[tuple[tuple[str, ...], list[Step]]]:
    """Each ```console block with the extras it needs beyond the Try it install: a block right after a line
    `<!-- needs: EXTRA[,EXTRA] -->` (whose text says how to install them) may import what those extras bring."""
    blocks: list[tuple[tuple[str, ...], list[Step]]] = []
    pattern = r"^(?:<!-- needs: ([\w,-]+) -->\n)?```console\n(.*?)^```$"
    for needs, body in re.findall(pattern, text, flags=re.DOTALL | re.MULTILINE):
        steps: list[Step] = []
        for line in body.splitlines():
            if line.startswith("$ "):
                steps.append(Step(line[2:], ""))
            elif not steps:
                raise ValueError(f"README console block starts with output, not a '$ ' command: {line!r}")
            else:
                steps[-1] = Step(steps[-1].command, steps[-1].expected + line + "\n")
        blocks.append((tuple(filter(None, needs.split(","))), steps))
    return blocks


def _installed_closure(names: set[str]) -> set[str]:
    """The distributions `names` bring along (their installed requirements, followed), normalised."""
    from importlib.metadata import PackageNotFoundError, requires

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        for req in reqs:
            if "extra ==" not in req:
                todo.append(re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-"))
    return seen


def _requirement_names(extra: str | None, project: dict) -> set[str]:
    """Distribution names (normalised) that `pip install -e .[extra]` asks for by name (extra None: the base install),
    the project's own extras followed."""
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    names: set[str] = set()
    for req in reqs:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")
        if name == project["name"]:
            for inner in re.search(r"\[(.*)\]", req).group(1).split(","):
                names |= _requirement_names(inner.strip(), project)
        else:
            names.add(name)
    return names


@functools.cache
def blocked_modules(needs: tuple[str, ...] = ()) -> list[str]:
    """Top-level modules that only the test extra brings: absent on a machine where the Try it command ran (the base
    install and torch), plus the extras `needs` names."""
    from importlib.metadata import packages_distributions

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    had = _requirement_names(None, project) | _requirement_names("torch", project)
    for extra in needs:
        had |= _requirement_names(extra, project)
    test_only = _requirement_names("test", project) - _installed_closure(had)
    return sorted(
        module
        for module, dists in packages_distributions().items()
        if all(d.lower().replace("_", "-") in test_only for d in dists) and module.isidentifier()
    )


def shell_env(needs: tuple[str, ...] | None = ()) -> dict[str, str]:
    """A newcomer's shell: the venv's `ckpt` on PATH, a fixed width, no colours, no debug tracebacks, and only what the
    README's Try it command installs importable (plus the extras `needs` names; None: everything installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if needs is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "tryit"), env.get("PYTHONPATH")]))
        env["TOUR_BLOCKED_MODULES"] = ",".join(blocked_modules(needs))
    # stdout unbuffered, so that stdout and stderr interleave as they do on a terminal
    env.update(COLUMNS="100", LINES="50", NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")
    return env


def run_command(command: str, cwd: Path, needs: tuple[str, ...] = ()) -> str:
    """What the command prints, stdout and stderr together, in a newcomer's shell (shell_env)."""
    proc = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=shell_env(needs), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )
    return proc.stdout


def front_door_commands() -> list[str]:
    """The ckpt commands of the README's **Try it** line (after its pip installs): the state the tour starts from."""
    block = re.search(r"\*\*Try it\*\*.*?```bash\n(.*?)\n```", README.read_text(), flags=re.DOTALL)
    assert block, "the README has no Try it command"
    return [part.strip() for part in block.group(1).split("&&") if part.strip().startswith("ckpt ")]


PAGE_BLOCKS = [(page, steps) for page in PAGES for steps in console_blocks(page.read_text())]
BLOCKS = [steps for _, steps in PAGE_BLOCKS]
NEEDS = [needs for page in PAGES for needs, _ in console_blocks_with_extras(page.read_text())]


class Tour:
    """The shared working directory; blocks run in README order, each at most once."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.done = 0

    def run_block(self, index: int) -> list[tuple[str, str, str]]:
        """Run the blocks before `index` that have not run (their files are needed), then block `index`:
        (command, expected, actual) for each of its commands."""
        while self.done < index:
            for step in BLOCKS[self.done]:
                run_command(step.command, self.cwd, NEEDS[self.done])
            self.done += 1
        results = [(s.command, s.expected, run_command(s.command, self.cwd, NEEDS[index])) for s in BLOCKS[index]]
        self.done = index + 1
        return results


@pytest.fixture(scope="session")
def tour(tmp_path_factory) -> Tour:
    """A newcomer's folder after the README's Try it command (the tour starts where the front door leaves)."""
    cwd = tmp_path_factory.mktemp("readme")
    for command in front_door_commands():
        run_command(command, cwd)
    return Tour(cwd)


def _block_id(index: int) -> str:
    page, steps = PAGE_BLOCKS[index]
    return f"{index:02d} {page.stem} {steps[0].command[:60]}"


def test_readme_has_console_examples():
    assert front_door_commands()[0] == "ckpt demo demo", "the Try it command writes the demo"
    assert BLOCKS and BLOCKS[0][0].command == "ckpt demo demo --overwrite", "the tour starts by writing the demo afresh"
    assert all(BLOCKS), "an empty console block"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=_block_id)
def test_console_block(tour, index):
    if tour.done > index:
        pytest.skip("ran already, as a prerequisite of a later block (blocks run once, in README order)")
    for command, expected, actual in tour.run_block(index):
        assert actual == expected, f"{PAGE_BLOCKS[index][0].name} command: $ {command}"


def test_the_tour_has_only_what_try_it_installs(tmp_path):
    """The gate the tour runs behind: what only the test extra brings does not import, unless a block names its extra."""
    probe = "python -c 'import transformers' 2>&1 | tail -1; python -c 'import deepspeed' 2>&1 | tail -1"
    probe += "; python -c 'import importlib.util as u; print(u.find_spec(\"accelerate\"))'"
    assert run_command(probe, tmp_path).splitlines() == [
        "ModuleNotFoundError: import of transformers halted; None in sys.modules",
        "ModuleNotFoundError: import of deepspeed halted; None in sys.modules",
        "None",
    ]
    assert run_command(probe, tmp_path, ("parity",)).splitlines() == [
        "ModuleNotFoundError: import of deepspeed halted; None in sys.modules",
        "None",
    ]
    assert {"torch", "numpy", "safetensors", "typer"}.isdisjoint(blocked_modules())
    assert {"transformers", "deepspeed", "s3fs", "adlfs", "lightning", "accelerate", "peft"} <= set(blocked_modules())
    assert "transformers" not in blocked_modules(("parity",))
