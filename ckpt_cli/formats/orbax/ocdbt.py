"""What an item's OCDBT database references: its B-tree nodes and the values too large to sit inline in them (above
1 KiB by Orbax's default) lie in data files (`d/<hash>` under the item, or under a process's `ocdbt.process_N/`),
each at an offset and length. Read from the manifest down (tensorstore's `ocdbt.dump`), without reading a value, so
`verify` names a missing or truncated data file without decoding an array."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.errors import DataError
from ckpt_cli.formats.orbax.arrays import context, kvstore_spec, tensorstore, what_failed


@dataclass(frozen=True)
class Ref:
    """`length` bytes at `offset` of the data file `file` (under the item), holding `what` (a value: its `key`)."""

    file: str
    offset: int
    length: int
    what: str
    key: str | None = None


def _ref(location: str, what: str, where: Path, key: str | None = None) -> Ref:
    """`btreenode:<base>:<file>:<offset>:<length>` or `value:...` (tensorstore's dump of an OCDBT reference)."""
    parts = location.split(":")
    if len(parts) != 5 or not parts[3].isdigit() or not parts[4].isdigit():
        raise DataError(f"{where}: an OCDBT reference {location[:80]!r} that ckpt cannot parse")
    _, base, rel, offset, length = parts
    file = base + rel
    if file.startswith("/") or ".." in file.split("/"):
        raise DataError(f"{where}: an OCDBT reference to {file[:80]!r}, outside the item")
    return Ref(file, int(offset), int(length), what, key)


def references(item: Path) -> Iterator[Ref]:
    """Every B-tree node and out-of-line value of the latest version, depth first (one node in memory at a time
    per level)."""
    ts = tensorstore()
    try:
        base = ts.KvStore.open(kvstore_spec(item, None, False), context=context()).result()
        manifest: Any = ts.ocdbt.dump(base).result()
    except (ValueError, RuntimeError, OSError) as exc:
        raise DataError(f"{item / 'manifest.ocdbt'}: not a readable OCDBT manifest: {what_failed(exc)}") from exc
    versions = manifest.get("versions") or []
    if not versions:
        raise DataError(f"{item / 'manifest.ocdbt'}: an OCDBT manifest with no version")
    root = versions[-1].get("root") or {}
    if "location" not in root:
        return  # an empty tree
    stack = [root["location"]]
    while stack:
        location = stack.pop()
        node_ref = _ref(location, "a B-tree node", item)
        yield node_ref
        try:
            node = ts.ocdbt.dump(base, location).result()
        except (ValueError, RuntimeError, OSError) as exc:
            raise DataError(f"{item / node_ref.file}: an OCDBT B-tree node cannot be read: {what_failed(exc)}") from exc
        for entry in node.get("entries", []):
            if "node" in entry:
                stack.append(entry["node"])
            elif "indirect_value" in entry:
                key = bytes(entry.get("key", b"")).decode("utf-8", "replace")
                yield _ref(entry["indirect_value"], f"'{key}'", item, key)


def problems(item: Path) -> list[str]:
    """A data file the database references that is missing or shorter than what it holds (one line per file)."""
    sizes: dict[str, int] = {}
    out: dict[str, str] = {}
    for ref in references(item):
        if ref.file not in sizes:
            path = item / ref.file
            sizes[ref.file] = path.stat().st_size if path.is_file() else -1
        size = sizes[ref.file]
        if ref.file in out:
            continue
        if size < 0:
            out[ref.file] = f"{item / ref.file}: missing (an OCDBT data file holding {ref.what})"
        elif ref.offset + ref.length > size:
            out[ref.file] = f"{item / ref.file}: truncated: {ref.what} needs bytes up to {ref.offset + ref.length}, the file has {size}"
    return list(out.values())
