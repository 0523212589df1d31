"""Each option of the writing commands is declared once (ckpt_cli/options.py): the CLI's flags, the API's keyword
arguments, the requests and the completions all come from those declarations, and nothing else spells them."""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import inspect
import re

import pytest
import typer
from test_architecture import PACKAGE

import ckpt_cli
from ckpt_cli import options
from ckpt_cli.cli import scripts
from ckpt_cli.cli.app import app
from ckpt_cli.errors import UsageError

COMMANDS = sorted(options.COMMANDS)


def _click(command: str):
    return typer.main.get_command(app).commands[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_the_cli_takes_exactly_the_declared_options(command):
    flags = [options.flag_of(f) for _, f in options.fields(command)]
    declared = {flag.flag for flag in flags} | {flag.short for flag in flags if flag.short}
    shown = {opt for p in _click(command).params if p.param_type_name == "option" and not p.hidden for opt in p.opts}
    extra = {"--to"} if options.COMMANDS[command].takes_to else set()
    assert shown == declared | extra


@pytest.mark.parametrize("command", COMMANDS)
def test_the_cli_help_and_choices_are_the_declarations(command):
    """Help text, metavar and bounds as declared; the completions offer each declared option's choices."""
    params = {p.name: p for p in _click(command).params}
    for _, f in options.fields(command):
        flag = options.flag_of(f)
        param = params[f.name]
        assert param.help == flag.text()
        if flag.metavar:
            assert param.metavar == flag.metavar
        if flag.choices is not None:
            assert scripts.VALUE_CHOICES[flag.flag] == list(flag.choices())
        assert param.default == (list(f.default) if isinstance(f.default, tuple) else f.default)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_api_takes_the_cli_names(command):
    """The API's keyword arguments are the fields: the CLI's flags with _ for - (how it prints aside)."""
    for function, runs in ((getattr(ckpt_cli, command), True), (getattr(ckpt_cli, f"{command}_request"), False)):
        names = set(inspect.signature(function).parameters) - {"src", "dest", "to", "progress"}
        want = {
            f.name for group, f in options.fields(command) if f.name not in options.API_SKIPS and (runs or group is not options.RunOptions)
        }
        assert names == want
        assert {f.name.replace("_", "-") for _, f in options.fields(command)} == {
            options.flag_of(f).flag[2:] for _, f in options.fields(command)
        }


def test_an_unknown_or_former_api_name_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="'keep_all' is now 'all'"):
        ckpt_cli.merge_request("x.safetensors", tmp_path / "m.safetensors", keep_all=True)
    with pytest.raises(UsageError, match="'select' is now 'filter'"):
        ckpt_cli.split_request("x.safetensors", tmp_path / "s", select=["a*"])
    with pytest.raises(UsageError, match="takes no option 'world_sise' \\(did you mean 'world_size'"):
        ckpt_cli.reshard_request("x", tmp_path / "r", world_sise=2)
    with pytest.raises(UsageError, match="merge takes no option 'world_size'"):
        ckpt_cli.merge_request("x.safetensors", tmp_path / "m.safetensors", world_size=2)


def test_every_field_declares_a_flag_and_no_flag_twice():
    flags = [flag.flag for _, flag in options.every_flag()]
    assert len(flags) == len(set(flags))
    for group in options.GROUPS:
        for f in dataclasses.fields(group):
            flag = options.flag_of(f)
            assert flag.flag == "--" + f.name.replace("_", "-")
            assert flag.text() and flag.kind in ("str", "path", "int", "bool", "strs", "float")


def _string_constants(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_declared_option_is_spelled_again():
    """Outside ckpt_cli/options.py no typer.Option copies a declared option (its flag with its help): commands that
    share one (inspect's --format, verify's --json) take it from the declaration (cli/options.declared). A flag of the
    same name with a meaning of its own (ls --format: which checkpoints to list) is that command's option. The writing
    commands' module spells none but --to."""
    declared = {(flag.flag, flag.text()) for _, flag in options.every_flag()}
    copies, writing = [], []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "options.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Option":
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                helps = [k.value.value for k in node.keywords if k.arg == "help" and isinstance(k.value, ast.Constant)]
                copies += [f"{path.name}: {n}" for n in names for h in helps if (n, h) in declared]
                if path.name == "convert_cmd.py":
                    writing += [n for n in names if n != "--to"]
    assert not copies and not writing, (copies, writing)


def test_the_writing_commands_pass_no_option_by_hand():
    """No module lists the writing commands' options as parameters again (the CLI, the API and the requests are made
    from the declarations): no function outside options.py has more than a few of their names as parameters."""
    names = {f.name for group in options.GROUPS for f in dataclasses.fields(group)}
    crowded = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "options.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}
                if len(args & names) > 6:
                    crowded.append(f"{path.relative_to(PACKAGE)}:{node.name} {sorted(args & names)}")
    assert not crowded, crowded


def test_help_mentions_the_declared_flags_only(tmp_path):
    """What a writing command's --help shows is made of the declarations (a flag in the help is a declared one)."""
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["convert", "--help"], terminal_width=200)
    shown = set(re.findall(r"(--[a-z][a-z-]+)", result.output))
    declared = {flag.flag for _, flag in options.every_flag()} | {flag.secondary for _, flag in options.every_flag() if flag.secondary}
    assert shown <= declared | {"--to", "--help"}, shown - declared


def _loaded(path) -> dict:
    from safetensors.torch import load_file

    files = [path] if path.suffix == ".safetensors" else sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("globs", [["*.mlp.*"], ["*.mlp.*", "model.norm.weight"], ["*layers.1.*"]])
def test_exclude_leaves_out_what_it_names_in_every_writing_command(ckpt, tiny_llama, tmp_path, command, globs):
    """--exclude, the option added by one declaration (options.SelectOptions) and its use (ops/transform.py): every
    writing command leaves out the tensors it names and writes the rest bit for bit (safetensors' own loader reads
    them); the API takes it under the same name."""
    from conftest import assert_same_tensors

    _, root = tiny_llama
    src = root / "sharded"
    source = _loaded(src)
    want = {k: v for k, v in source.items() if not any(fnmatch.fnmatchcase(k, g) for g in globs)}
    assert 0 < len(want) < len(source)
    dest = tmp_path / ("out.safetensors" if command == "merge" else "out")
    extra = {"convert": ["--to", "hf"], "reshard": ["--num-shards", "2"], "merge": [], "split": []}[command]
    res = ckpt(command, src, dest, *extra, *[a for g in globs for a in ("--exclude", g)], "--quiet")
    assert res.code == 0, res.err
    assert_same_tensors(_loaded(dest), want)
    kwargs = {"convert": {"to": "hf"}, "reshard": {"num_shards": 2}}.get(command, {})
    report = getattr(ckpt_cli, command)(src, tmp_path / ("api.safetensors" if command == "merge" else "api"), exclude=globs, **kwargs)
    assert sum(f["tensors"] for f in report.files) == len(want)


def test_exclude_of_everything_is_refused(ckpt, tiny_llama, tmp_path):
    _, root = tiny_llama
    res = ckpt("merge", root / "single", tmp_path / "m.safetensors", "--exclude", "*")
    assert res.code == 2 and res.err.strip() == "ckpt: error: --exclude * leaves no tensor to write"
    assert not (tmp_path / "m.safetensors").exists()


def test_run_options_belong_to_the_run_and_a_string_is_one_glob(tiny_llama, tmp_path):
    """A request carries what is written; how it runs goes to ckpt_cli.write (a dry_run given to a request is refused,
    not dropped). A bare string for a repeatable option is one value, not its characters."""
    _, root = tiny_llama
    src = root / "single"
    with pytest.raises(UsageError, match="'dry_run' here: pass it to ckpt_cli.write"):
        ckpt_cli.split_request(src, tmp_path / "s", num_shards=2, dry_run=True)
    with pytest.raises(UsageError, match="'quiet' here"):
        ckpt_cli.split(src, tmp_path / "s", quiet=True)
    report = ckpt_cli.convert(src, tmp_path / "one", to="safetensors", filter="model.norm.weight")
    assert sum(f["tensors"] for f in report.files) == 1
    report = ckpt_cli.convert(src, tmp_path / "most", to="safetensors", exclude="model.norm.weight")
    assert sum(f["tensors"] for f in report.files) == len(ckpt_cli.open(src)) - 1
    assert not (tmp_path / "s").exists()
