"""The CLI's options: those of the writing commands made from their declarations (ckpt_cli/options.py), and the
arguments and flags the other commands share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from inspect import Parameter, Signature
from typing import Annotated, Any, Optional

import typer

try:  # typer >= 0.28 vendors click
    from typer._click import types as click_types
except ImportError:  # pragma: no cover
    from click import types as click_types  # type: ignore[no-redef]  # the same module, unvendored

from ckpt_cli.options import GROUPS, Flag, flag_of


def _schemes() -> str:
    """The object stores' URL schemes, from the store's BACKENDS table: 's3://, s3a://, az://, abfs:// or abfss://'."""
    from ckpt_cli.store.clients import BACKENDS  # a table of names: no client imported

    names = [f"{protocol}://" for protocol in BACKENDS]
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


# SRC and DST stay strings (an s3:// URL is no Path: Path("s3://b/k") is "s3:/b/k"); shown as paths in --help.
class _TextPath(click_types.ParamType):
    name = "path"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        return str(value)


PATH = _TextPath()
_TYPES: dict[str, Any] = {
    "str": Optional[str],
    "path": Optional[str],
    "int": Optional[int],
    "float": Optional[float],
    "bool": bool,
    "strs": Optional[list[str]],
}


def typer_option(flag: Flag, default: Any) -> Any:
    """The Annotated type typer reads for a declared option."""
    names = [f"{flag.flag}/{flag.secondary}" if flag.secondary else flag.flag] + ([flag.short] if flag.short else [])
    kind = str if flag.kind == "str" and isinstance(default, str) else _TYPES[flag.kind]
    how: dict[str, Any] = {"help": flag.text()}
    if flag.metavar:
        how["metavar"] = flag.metavar
    if flag.kind == "path":
        how["click_type"] = PATH
    if flag.minimum is not None:
        how["min"] = flag.minimum
    if flag.maximum is not None:
        how["max"] = flag.maximum
    if default is None:
        how["show_default"] = False
    return Annotated[kind, typer.Option(*names, **how)]


def declared_command(command: Callable[..., None], arguments: Sequence[tuple[str, Any]], names: Sequence[str], *groups: type) -> None:
    """Give `command` (its arguments, then `**values`) the typer signature of its `arguments` (name, CLI type) and of
    its options `names`, in that order, each from its declaration: the first of `groups` declaring it; a former
    spelling (--select) as the hidden option NAME_former."""
    fields: dict[str, dataclasses.Field] = {}
    for group in reversed(groups):
        fields |= {f.name: f for f in dataclasses.fields(group)}
    params = [Parameter(name, Parameter.POSITIONAL_OR_KEYWORD, annotation=kind) for name, kind in arguments]
    for n in names:
        flag, default = flag_of(fields[n]), fields[n].default
        params.append(Parameter(n, Parameter.KEYWORD_ONLY, default=default, annotation=typer_option(flag, default)))
        if flag.former:
            former = typer.Option(flag.former, metavar=flag.metavar, hidden=True, help=f"The former name of {flag.flag}.")
            params.append(Parameter(f"{n}_former", Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[_TYPES[flag.kind], former]))
    command.__signature__ = Signature(params)  # type: ignore[attr-defined]  # inspect's hook, not in typeshed
    command.__annotations__ = {p.name: p.annotation for p in params}


def declared(name: str) -> Any:
    """The CLI type of the declared option `name` (a field of one of options.GROUPS), for commands that share it."""
    declared = next(f for group in GROUPS for f in dataclasses.fields(group) if f.name == name)
    return typer_option(flag_of(declared), declared.default)


Source = Annotated[
    str,
    typer.Argument(
        metavar="SRC",
        click_type=PATH,
        help=f"Checkpoint file or folder (or a run folder holding several); in object storage too: {_schemes()}bucket/prefix.",
        show_default=False,
    ),
]
Dest = Annotated[
    str,
    typer.Argument(
        metavar="DST",
        click_type=PATH,
        help=f"Destination, a path or {_schemes()}bucket/prefix (refused if it exists, unless --overwrite).",
        show_default=False,
    ),
]
Format = declared("format")
Tag = declared("tag")
TrustPickle = declared("trust_pickle")
Json = declared("json")
Quiet = declared("quiet")
