"""Untrusted names and files: what a checkpoint says becomes a path only when it is one plain file name,
and a file is read only when it is a regular file.

A tag in DeepSpeed's `latest`, a step number, an index's shard name or a DCP storage path comes from
inside a checkpoint; joined to a folder, `../x` or `/x` would read or write elsewhere. A FIFO, socket
or device in place of a checkpoint file would block on open or never end; files are opened with
O_NONBLOCK and refused unless fstat says they are regular (no race between a check and the open).
Files the user names on the command line (a config, a policy) are not checkpoint files and are read
as given: `--ds-config <(...)` is a pipe on purpose.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TypeGuard

from ckpt_cli.errors import DataError

# formats open and size files through core.paths; open_regular refuses a FIFO, socket, device or folder without
# blocking, and opens an object in object storage for ranged reads
from ckpt_cli.store import file_size, present  # noqa: F401
from ckpt_cli.store import open_read as open_regular
from ckpt_cli.store.local import open_regular_fd  # noqa: F401

SHOWN_CHARS = 60
_DRIVE = re.compile(r"^[A-Za-z]:")
# An object in object storage (s3://...) is read through ckpt_cli.store: it is always a plain object, never a
# FIFO or device, so the checks below are for local files only.


def shown(value: object) -> str:
    """`value` for an error message: repr() (no raw bytes or control characters reach the terminal), cut short."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def is_plain(name: object) -> TypeGuard[str]:
    """One plain file name: a non-empty string without separators, not `.` or `..`, no drive letter, no control
    character, encodable as a file name."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or _DRIVE.match(name):
        return False
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return False
    try:
        os.fsencode(name)
    except UnicodeError:
        return False
    return True


def plain_component(name: object, where: str) -> str:
    """`name` when it is one plain file name; else DataError naming `where` (the file that holds the name)."""
    if not is_plain(name):
        raise DataError(f"{where}: names {shown(name)}, which is not a plain file name; refusing to use it as a path")
    return name


def inside(root: Path, relpath: str, where: str) -> Path:
    """`root / relpath` when every `/`-separated part of `relpath` is a plain file name, so the path stays under
    `root`; DataError otherwise (a writer joined a name it should have refused)."""
    if not all(is_plain(part) for part in relpath.split("/")):
        raise DataError(f"{where}: output path {shown(relpath)} would leave the destination; nothing was written")
    return root / relpath


def step_number(value: object, where: str) -> int | None:
    """A saved step (None when absent): a non-negative int, since writers turn it into a folder name."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise DataError(f"{where}: the step is {shown(value)}, not a non-negative integer")
    return value


def read_regular_bytes(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file; DataError when it is not one, or holds more than `max_bytes`."""
    with open_regular(path) as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise DataError(f"{path}: larger than the {max_bytes} bytes such a file holds")
    return data


def read_regular_text(path: str | Path, max_bytes: int | None = None) -> str:
    """The UTF-8 text of a regular file; DataError when it is not one, is too large, or is not UTF-8."""
    data = read_regular_bytes(path, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start})") from None
