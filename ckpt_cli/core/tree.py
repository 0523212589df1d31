"""Nested state dicts <-> flat entries with key paths.

Dicts are always flattened; lists and tuples only when they hold a tensor somewhere inside (as DCP
does), so `param_groups` stays one readable object. Key paths keep their Python types (optimizer
state uses int keys); `containers` remembers which prefixes were lists or tuples.
"""

from __future__ import annotations

import marshal
from collections.abc import Callable
from typing import Any

from ckpt_cli.core.model import PathKey
from ckpt_cli.errors import DataError


def holds_tensor(value: Any, is_tensor: Callable[[Any], bool]) -> bool:
    """Whether a tensor sits anywhere inside nested dicts, lists and tuples."""
    if is_tensor(value):
        return True
    if isinstance(value, dict):
        return any(holds_tensor(v, is_tensor) for v in value.values())
    if isinstance(value, (list, tuple)):
        if PLAIN.issuperset(map(type, value)):  # a list of 20,000 numbers (param_alignment_paddings), in C
            return False
        return any(holds_tensor(v, is_tensor) for v in value)
    return False


PLAIN = frozenset({int, float, str, bool, type(None)})


def is_plain(value: Any) -> bool:
    """Whether `value` is a number, string, bool or None, or lists, tuples and dicts (plain keys) of them."""
    if isinstance(value, (list, tuple)):
        return PLAIN.issuperset(map(type, value)) or all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(type(k) in PLAIN and is_plain(v) for k, v in value.items())
    return type(value) in PLAIN


def share_equal(values: Any, like: Any) -> None:
    """Point the plain lists of dict `values` (and of the dicts inside it) that equal those of dict `like` under the
    same keys at `like`'s objects (in place; equal, so nothing a reader sees changes). Every rank file of a ZeRO-1/2
    checkpoint repeats one zero per parameter (param_alignment_paddings: 160 KB a rank of a 20,000-param model, 1,024
    ranks) and the optimizer's param_groups (~40 objects a rank)."""
    if not isinstance(values, dict) or not isinstance(like, dict) or values is like:
        return
    for key, value in list(values.items()):
        other = like.get(key)
        if value is other:
            continue
        if isinstance(value, list) and value == other and _same_plain(value, other):
            values[key] = other
        elif isinstance(value, dict):
            share_equal(value, other)


def _same_plain(value: list[Any], other: list[Any]) -> bool:
    """Whether two equal lists hold the same types too (True == 1 == 1.0), and only plain values. marshal writes each
    value's type (and refuses subclasses), so equal bytes are equal types; `other`'s bytes and plainness are found once
    for all the ranks compared with it. 0.14 ms for 20,000 numbers, where a walk of their types took 0.28."""
    cached = _MARSHALED.get(id(other))
    if cached is None or cached[0] is not other:
        try:
            cached = (other, marshal.dumps(other, 2) if is_plain(other) else None)
        except ValueError:
            cached = (other, None)
        if len(_MARSHALED) >= 8:
            _MARSHALED.pop(next(iter(_MARSHALED)))
        _MARSHALED[id(other)] = cached
    if cached[1] is None:
        return False
    try:
        return marshal.dumps(value, 2) == cached[1]
    except ValueError:  # a type marshal does not write: not plain
        return False


_MARSHALED: dict[int, tuple[list[Any], bytes | None]] = {}  # id -> (the list, kept so that its id stays its own; bytes)


MAX_NODES = 10_000_000  # entries a state dict may flatten to (shared references count each time they are reached)


def flatten(
    tree: Any, is_tensor: Callable[[Any], bool], where: str
) -> tuple[list[tuple[PathKey, Any]], list[tuple[PathKey, Any]], dict[PathKey, str]]:
    """(tensor leaves, object leaves, container kinds) of a nested structure, in traversal order."""
    tensors: list[tuple[PathKey, Any]] = []
    objects: list[tuple[PathKey, Any]] = []
    containers: dict[PathKey, str] = {}
    visited = 0

    def walk(value: Any, path: PathKey) -> None:
        nonlocal visited
        visited += 1
        if visited > MAX_NODES:
            raise DataError(f"{where}: too many nested references (more than {MAX_NODES:,} entries)")
        if is_tensor(value):
            tensors.append((path, value))
        elif isinstance(value, dict) and value and all(isinstance(k, (str, int)) for k in value):
            for key, child in value.items():
                walk(child, (*path, key))
        elif isinstance(value, (list, tuple)) and path and holds_tensor(value, is_tensor):
            containers[path] = "tuple" if isinstance(value, tuple) else "list"
            for i, child in enumerate(value):
                walk(child, (*path, i))
        elif not path:
            raise DataError(f"{where}: holds a {type(value).__name__}, not a state dict")
        else:
            objects.append((path, value))

    walk(tree, ())
    return tensors, objects, containers


def path_name(path: PathKey) -> str:
    try:
        return ".".join(path)  # type: ignore[arg-type]  # all strings: the common case, once per tensor of a wide checkpoint
    except TypeError:
        return ".".join(str(p) for p in path)


def unique_names(paths: list[PathKey], where: str) -> list[str]:
    names = [path_name(p) for p in paths]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for dup in names:  # the first name met twice
            if dup in seen:
                raise DataError(f"{where}: two entries flatten to the same name '{dup}'")
            seen.add(dup)
    return names


def unflatten(items: list[tuple[PathKey, Any]], containers: dict[PathKey, str]) -> dict[Any, Any]:
    """Rebuild the nested structure from (path, leaf) pairs."""
    root: dict[Any, Any] = {}
    for path, leaf in items:
        node = root
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise DataError(f"cannot nest under '{path_name(path)}': its parent is a value")
            node = child
        node[path[-1]] = leaf

    def finish(node: Any, prefix: PathKey) -> Any:
        if not isinstance(node, dict):
            return node
        done = {k: finish(v, (*prefix, k)) for k, v in node.items()}
        kind = containers.get(prefix)
        if kind and all(isinstance(k, int) for k in done):
            seq = [done[k] for k in sorted(done)]
            return tuple(seq) if kind == "tuple" else seq
        return done

    return finish(root, ())
