"""--help tells the truth: each fact it states is checked against the code that decides it, so that a new format, store
or digest cannot leave the help behind, and an example cannot read what nothing has written.

- Examples: followed in order after `ckpt demo demo`, every path an example reads is one the demo writes or one an
  example above it writes; and in the tested tour (tests/test_readme.py) a command before the example writes it.
- `--world-size` names every format whose registry row reshards by world size (formats/registry.py).
- Path arguments name every URL scheme of the store's BACKENDS table (store/clients.py).
- `--write-manifest` names the digest the manifest code writes (ops/verify.py), and a manifest written says so.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import PurePosixPath
from typing import Any

import pytest
import typer
from safetensors.numpy import save_file

from ckpt_cli.cli.app import app
from ckpt_cli.cli.examples import EXAMPLES
from ckpt_cli.formats.registry import FORMATS
from ckpt_cli.ops.demo import DEMO_NAMES
from ckpt_cli.ops.verify import MANIFEST_HASH
from ckpt_cli.store.clients import BACKENDS

OUTPUTS = {"dest", "write_manifest"}  # the parameters a command writes; every other path parameter is read
DIGESTS = {"sha256", "sha-256", "sha1", "md5", "blake2", "blake3", "xxh3", "xxhash", "crc32"}


def _commands() -> dict[str, Any]:
    """name -> click command (click's classes by duck type: typer may vendor its own click)."""
    return dict(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def _is_path(param: Any) -> bool:
    return type(param.type).__name__.endswith("Path")


def _words(line: str) -> list[str]:
    """The words of the first command of a shell line (up to `;`, `|`, `>`, `&&`)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for word in lexer:
        if word and word[0] in ";|&<>()":
            break
        words.append(word)
    return words


def _paths(line: str) -> tuple[set[PurePosixPath], set[PurePosixPath]]:
    """(read, written) paths of a `ckpt` command line, by its command's own parameters; ((), ()) for any other line."""
    words = _words(line)
    commands = _commands()
    if len(words) < 2 or words[0] != "ckpt" or words[1] not in commands:
        return set(), set()
    command = commands[words[1]]
    ctx = command.make_context(words[1], words[2:], resilient_parsing=True)
    read, written = set(), set()
    for param in command.params:
        value = ctx.params.get(param.name or "")
        if value is None or not _is_path(param):
            continue
        if param.name not in OUTPUTS:
            read.add(PurePosixPath(value))
        elif not ctx.params.get("dry_run"):
            written.add(PurePosixPath(value))
    return read, written


def _made(path: PurePosixPath, made: set[PurePosixPath]) -> bool:
    return any(path == m or m in path.parents for m in made)


def _demo() -> set[PurePosixPath]:
    return {PurePosixPath("demo") / name for name in DEMO_NAMES}


def test_examples_parse_as_their_commands():
    """The parser below reads what the CLI reads: every example names its command and reads or writes a path."""
    for command, lines in EXAMPLES.items():
        for line in lines:
            assert _words(line)[:2] == ["ckpt", _words(line)[1]] and _words(line)[1] in _commands(), line
            if command != "completion":
                assert any(_paths(line)), line


@pytest.mark.parametrize("command", sorted(EXAMPLES))
def test_each_help_runs_in_order_after_the_demo(command):
    """`inspect --help` read `out/dcp2`, which neither the demo nor an example above it writes."""
    made = _demo()
    for line in EXAMPLES[command]:
        read, written = _paths(line)
        missing = [str(p) for p in read if not _made(p, made)]
        assert not missing, f"{command} --help: {line!r} reads {missing}, which no example above it (nor 'ckpt demo demo') writes"
        made |= written


def test_every_example_reads_what_the_tour_wrote_before_it():
    from test_readme import PAGES, console_blocks, front_door_commands

    tour = front_door_commands() + [step.command for page in PAGES for block in console_blocks(page.read_text()) for step in block]
    for lines in EXAMPLES.values():
        for line in lines:
            at = tour.index(line)
            made = set().union(*(_paths(earlier)[1] for earlier in tour[:at]))
            missing = [str(p) for p in _paths(line)[0] if not _made(p, made)]
            assert not missing, f"{line!r} reads {missing}, which no command of the tour before it writes"


def _option_help(name: str) -> dict[str, str]:
    """command -> the help of its option `name`, for each command that has it."""
    found = {}
    for command_name, command in _commands().items():
        for param in command.params:
            if param.param_type_name == "option" and name in param.opts:
                found[command_name] = param.help or ""
    return found


def test_world_size_help_names_every_format_that_reshards_by_world_size():
    by_world = [f.name for f in FORMATS.values() if f.reshard_by == "world_size"]
    assert {"dcp", "deepspeed", "dtensor"} <= set(by_world)
    helps = _option_help("--world-size")
    assert {"convert", "reshard"} <= set(helps)
    for command, text in helps.items():
        for name in by_world:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{command} --world-size help leaves out {name}: {text!r}"
    reshard = _commands()["reshard"].help or ""
    for f in FORMATS.values():
        if f.reshard_by == "world_size" and f.writable:
            assert re.search(rf"(?<![\w-]){re.escape(f.name)}(?![\w-])", reshard.split("--num-shards")[0]), f.name


def test_path_help_names_every_object_store_scheme():
    """A path argument that names object storage names every scheme ckpt has a backend for (az:// was left out)."""
    checked = set()
    for command_name, command in _commands().items():
        for param in command.params:
            text = getattr(param, "help", None) or ""
            if param.param_type_name == "argument" and "://" in text:
                checked.add((command_name, param.name))
                missing = [p for p in BACKENDS if f"{p}://" not in text]
                assert not missing, f"{command_name} {param.name}: help leaves out {missing}: {text!r}"
    assert {("inspect", "src"), ("verify", "src"), ("convert", "src"), ("convert", "dest"), ("merge", "dest")} <= checked


def test_manifest_help_names_the_digest_manifests_use(tmp_path, ckpt):
    """`verify --write-manifest` said SHA-256; manifests are BLAKE3 (ops/verify.MANIFEST_HASH), as one written says."""
    import numpy as np

    helps = _option_help("--write-manifest")
    assert {"verify", "convert", "reshard", "merge", "split"} <= set(helps)
    for command, text in helps.items():
        named = {d for d in DIGESTS if re.search(rf"\b{re.escape(d)}\b", text, re.IGNORECASE)}
        assert named == {MANIFEST_HASH}, f"{command} --write-manifest help names {named or 'no digest'}, manifests use {MANIFEST_HASH}"
    src = tmp_path / "w.safetensors"
    save_file({"w": np.arange(6, dtype=np.float32)}, str(src))
    assert ckpt("verify", src, "--write-manifest", tmp_path / "m.json", "--quiet").code == 0
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc.get("hash") == MANIFEST_HASH, doc.get("hash")
