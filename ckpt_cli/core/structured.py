"""One loader for every structured text ckpt reads (YAML and JSON: name maps, policies, manifests, DeepSpeed
configs, and a checkpoint's own JSON files), bounded, with a small schema per file kind.

The bounds are what an attacker reaches first: nesting (a JSON file 100,000 levels deep overflows any
recursive walk), YAML aliases (600 bytes of anchors expand to billions of nodes when anything walks them),
integers (a 5,000-digit step; Python refuses to print one), and size (callers read at most a stated number
of bytes). A schema names the first field that is wrong, so a mistake in a user's file reads as one line.

`error` says whose file it is: UsageError (exit 2) for the user's files, DataError (exit 1) for a
checkpoint's own.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ckpt_cli.errors import CkptError, UsageError

MAX_DEPTH = 64  # nesting of mappings and lists; configs, manifests and trainer states use a handful
MAX_NODES = 2_000_000  # scalars and containers after YAML aliases are expanded
MAX_INT_DIGITS = 20  # every count, size and step fits 64 bits (20 digits covers uint64)

Spec = Any  # a schema: see check()


def load_json(text: str, where: str, error: type[CkptError]) -> Any:
    """JSON, with nesting and integer size bounded (NaN and Infinity accepted, as Python's json writes them)."""

    def bounded_int(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise error(f"{where}: an integer of {len(digits)} digits; ckpt reads integers of up to {MAX_INT_DIGITS}")
        return int(digits)

    try:
        doc = json.loads(text, parse_int=bounded_int)
    except RecursionError:
        raise error(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    _bounded(doc, where, error)
    return doc


def load_yaml(text: str, where: str, error: type[CkptError]) -> Any:
    """YAML (safe constructors only), with nesting, alias expansion and integer size bounded before any value
    is built: the composed node graph is measured as if every alias were expanded."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise error(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if node is None:
        return None
    _measure(node, where, error)
    try:
        return yaml.SafeLoader(text).get_single_data()
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except (ValueError, RecursionError) as exc:  # an integer Python will not convert, a date out of range
        raise error(f"{where}: a value ckpt cannot read ({str(exc).splitlines()[0]})") from None


def _measure(root: Any, where: str, error: type[CkptError]) -> None:
    """Depth and expanded size of a composed YAML node graph, without expanding it (sizes memoised per node)."""
    import yaml

    sizes: dict[int, int] = {}
    stack: list[tuple[Any, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise error(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, yaml.ScalarNode):
            if node.tag.endswith(":int") and len(node.value.lstrip("+-").replace("_", "")) > MAX_INT_DIGITS:
                raise error(f"{where}: an integer of {len(node.value)} digits; ckpt reads integers of up to {MAX_INT_DIGITS}")
            sizes[id(node)] = 1
            continue
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else list(node.value)
        if done:
            total = 1 + sum(sizes[id(c)] for c in children)
            if total > MAX_NODES:
                raise error(f"{where}: expands to more than {MAX_NODES:,} values (YAML aliases); refusing to build it")
            sizes[id(node)] = total
            continue
        if id(node) in sizes:
            continue
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def _bounded(doc: Any, where: str, error: type[CkptError]) -> None:
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise error(f"{where}: nested deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


# ---- schemas -------------------------------------------------------------------------------------------------
# A spec is: a type or tuple of types (int never matches a bool); [spec] a list of such; {"key": spec, ...} a mapping
# with those keys only (each required unless Optional); {str: spec} a mapping of any string keys; Any for anything;
# Optional(spec) for spec, empty or absent; or a callable that returns an error text (or None) for checks a type
# cannot say.

_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "a mapping", list: "a list"}


def check(value: Any, spec: Spec, where: str, error: type[CkptError], field: str = "") -> None:
    """Raise `error` naming the first field of `value` that `spec` does not allow."""
    at = field or "the document"
    if spec is Any or (isinstance(spec, Optional) and value is None):
        return
    if isinstance(spec, Optional):
        spec = spec.spec
    if isinstance(spec, type) or isinstance(spec, tuple):
        kinds = spec if isinstance(spec, tuple) else (spec,)
        if not _is(value, kinds):
            raise error(f"{where}: {at} must be {' or '.join(_NAMES.get(k, k.__name__) for k in kinds)}, not {_kind(value)}")
        return
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise error(f"{where}: {at} must be a list, not {_kind(value)}")
        for i, item in enumerate(value):
            check(item, spec[0], where, error, f"{field}[{i}]")
        return
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise error(f"{where}: {at} must be a mapping, not {_kind(value)}")
        if list(spec) == [str]:
            for key, item in value.items():
                if not isinstance(key, str):
                    raise error(f"{where}: {at} has the key {key!r}; keys are strings")
                check(item, spec[str], where, error, _join(field, key))
            return
        unknown = [k for k in value if k not in spec]
        if unknown:
            raise error(f"{where}: {at} has the unknown key {str(unknown[0])!r} (known: {', '.join(map(str, spec))})")
        missing = [k for k, s in spec.items() if k not in value and not isinstance(s, Optional)]
        if missing:
            raise error(f"{where}: {_join(field, str(missing[0]))} is missing")
        for key, item in value.items():
            check(item, spec[key], where, error, _join(field, str(key)))
        return
    if callable(spec):
        problem = spec(value)
        if problem:
            raise error(f"{where}: {at} {problem}")
        return
    raise TypeError(f"not a schema: {spec!r}")


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


def _kind(value: Any) -> str:
    if value is None:
        return "empty"
    return _NAMES.get(type(value), type(value).__name__)


def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def regex(pattern: str, where: str) -> re.Pattern[str]:
    """A regular expression from a user's file or flag, compiled; UsageError naming `where` when it is none."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"{where}: bad regular expression '{pattern}' ({exc})") from exc


def non_negative(value: Any) -> str | None:
    """A spec for counts and steps: a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"must be a non-negative integer, not {value!r}"[:120]
    return None


class Optional:
    """`spec`, or empty (YAML's `key:` with nothing after it), or (in a mapping) absent."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
