"""The package's shape: layers import downwards only, no import cycle, small files, no paths outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckpt_cli"
# What each layer may not import: the store is the lowest floor, core is pure, formats know nothing of commands,
# ops nothing of the CLI.
FORBIDDEN = {
    "store": ("ckpt_cli.core", "ckpt_cli.formats", "ckpt_cli.ops", "ckpt_cli.cli", "ckpt_cli.api"),
    "core": ("ckpt_cli.formats", "ckpt_cli.ops", "ckpt_cli.cli"),
    "formats": ("ckpt_cli.ops", "ckpt_cli.cli"),
    "ops": ("ckpt_cli.cli",),
}
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ckpt_cli module this file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ckpt_cli")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckpt_cli"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from ckpt_cli.formats import dcp`
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_downwards_only(layer):
    wrong = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name.startswith(f"ckpt_cli.{layer}.")
        for target in targets
        if target.startswith(FORBIDDEN[layer])
    ]
    assert not wrong, wrong


def test_no_import_cycle():
    # Package __init__ files only re-export; an edge into a package is an edge into what it names.
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(GRAPH[name]):
            if MODULES[target].name == "__init__.py":
                continue
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(target) :] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in GRAPH:
        if name not in state:
            visit(name)


# The modules every format family may build on: the one-file formats that rank files are made of, the table, and a
# release's companion files. Anything else under formats/ is a family (a package, or one module) of its own.
SHARED_FORMAT_MODULES = ("registry", "safetensors", "torch_save", "companions")
MAX_FORMATS_ENTRIES = 12


def _family(module: str) -> str | None:
    """The format family a module belongs to (its package or module under formats/), None outside formats/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "formats" else None


def test_a_format_family_imports_another_only_through_the_shared_modules():
    wrong = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if (family := _family(name)) and family not in SHARED_FORMAT_MODULES
        for target in targets
        if (other := _family(target)) and other != family and other not in SHARED_FORMAT_MODULES
    ]
    assert not wrong, wrong


def test_formats_and_core_are_grouped_by_concept():
    """formats/: a package per family (a few one-module families and the shared modules beside them); core/: its
    subsystems in packages (pickle and zip safety, the write engine, a name map's transforms)."""
    entries = [p.name for p in (PACKAGE / "formats").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= MAX_FORMATS_ENTRIES, sorted(entries)
    for family in ("dcp", "deepspeed", "dtensor", "runs"):
        assert (PACKAGE / "formats" / family / "__init__.py").exists(), family
        assert not list((PACKAGE / "formats").glob(f"{family}_*.py")), f"a {family} module outside formats/{family}/"
    for package in ("pickles", "write", "names"):
        assert (PACKAGE / "core" / package / "__init__.py").exists(), package


def test_no_file_over_the_size_limit():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_nothing_points_outside_the_repository():
    tracked = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), ROOT / "README.md"]
    tracked += list((ROOT / "docs").rglob("*.md"))
    needle = "/".join(("..", "shared"))  # spelled apart so that this file does not match itself
    hits = [str(p.relative_to(ROOT)) for p in tracked if needle in p.read_text()]
    assert not hits, hits


def test_build_outputs_are_not_tracked():
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in files if ".egg-info/" in f]


def _modules_after(args: list[str], cwd: Path) -> set[str]:
    """The ckpt_cli modules a fresh process has imported after running the CLI with `args`."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom ckpt_cli.cli.entry import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(' '.join(m for m in sys.modules if m.startswith('ckpt_cli')), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, check=True)
    return set(proc.stderr.strip().splitlines()[-1].split())


def test_help_imports_no_format_and_inspect_no_writer(tmp_path):
    """Start-up pays only for what the command uses: the format table names modules that load on first use."""
    import numpy as np
    from safetensors.numpy import save_file

    help_modules = _modules_after(["--help"], tmp_path)
    assert not [m for m in help_modules if m.startswith("ckpt_cli.formats.") and m != "ckpt_cli.formats.registry"], help_modules
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    inspect_modules = _modules_after(["inspect", "m.safetensors"], tmp_path)
    writers = {"ckpt_cli.formats.dcp.writer", "ckpt_cli.formats.deepspeed.writer"}
    assert not inspect_modules & writers, inspect_modules & writers
    # detection asks only the rows that can claim a file of this name: no folder format's reader is imported
    folder_readers = {"ckpt_cli.formats.dcp.reader", "ckpt_cli.formats.deepspeed.reader", "ckpt_cli.formats.dcp.megatron"}
    folder_readers.add("ckpt_cli.formats.hf.folder")
    assert not inspect_modules & folder_readers, inspect_modules & folder_readers
    assert "ckpt_cli.formats.safetensors" in inspect_modules


def test_only_the_store_tells_local_from_object_storage():
    """Where a checkpoint lives is the store's business: no module outside ckpt_cli/store/ asks for a protocol, and
    none but the store and its backends imports an object-storage client."""
    asking = re.compile(r"\bis_remote\b|\bprotocol_of\b|\.protocol\b|\bs3fs\b|\badlfs\b|\bbotocore\b|\bfsspec\b")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for name, path in MODULES.items()
        if not name.startswith("ckpt_cli.store")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asking.search(line.split("#", 1)[0])
    ]
    assert not found, found
