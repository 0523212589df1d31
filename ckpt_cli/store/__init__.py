"""Where checkpoints live: the local filesystem or object storage (s3://, az://, any fsspec URL for reads).

Everything else in ckpt asks this package, never a protocol: a location (`location`), what it can do
(`mappable`: read by descriptor and memory map; `renames`: a write commits by renaming a finished temporary, where
object storage commits with markers written last), its bytes (`size`, `exists`, `present`, `open_read`,
`read_into`, `prefetch_heads`), and writes as one transaction (`begin`, `join`): create a file as a sink, sync,
commit, abort, and the unfinished writes a killed one left (`unfinished`).

Modules: location.py (Location, ranged reads and their cache), clients.py (one client per protocol, the BACKENDS
table, error words, request counts), s3.py / azure.py (one module per object store: client, writer, unfinished
writes), fsspec_any.py (other fsspec protocols, read-only), guard.py (what --overwrite must keep), local.py (the
temporary sibling and rename), objects.py (object writes: data first, markers last, cleanup), prefetch.py (tensor
data fetched ahead).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ckpt_cli.store import local, objects
from ckpt_cli.store.guard import Guard, check_destination
from ckpt_cli.store.location import Location, RemoteFile, fresh, is_remote, location, prefetch_heads, read_into

__all__ = ["Guard", "Location", "Write", "begin", "check_destination", "check_writable", "exists", "fresh", "is_bucket"]
__all__ += ["join", "lexists", "location", "mappable", "open_read", "prefetch_heads", "present", "put", "read_into", "renames"]
__all__ += ["size", "unfinished"]


class File(Protocol):
    fd: int | None  # a local file: positional writes from threads; None: bytes in order through `write`

    def write(self, data: Any) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class Write(Protocol):
    """One write of a checkpoint: files created under `root`, synced, then committed (or aborted)."""

    root: Path

    def create(self, target: Path, total: int, progress: Callable[[int], None] | None = None) -> File: ...
    def sync(self) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


def _object(path: object) -> Location:
    """`path` as the Location it is (the caller asked is_remote first)."""
    found = location(path)  # type: ignore[arg-type]
    assert isinstance(found, Location)
    return found


def mappable(path: object) -> bool:
    """Whether the bytes at `path` are read by descriptor (pread, memory maps, kernel copies): a local file."""
    return not is_remote(path)


def renames(path: object) -> bool:
    """Whether a write to `path` commits by renaming a finished temporary (locally). In object storage it commits
    with its markers written last, objects carry upload times, and links do not exist."""
    return not is_remote(path)


def is_bucket(path: object) -> bool:
    """The root of an object store (a bucket, a container): its listing may be of any size."""
    return is_remote(path) and len(_object(path).parts) <= 2


def size(path: str | os.PathLike[str]) -> int:
    """The size of a file or object (OSError when missing, as os.path.getsize)."""
    return location(path).stat().st_size if is_remote(path) else os.path.getsize(path)


def exists(path: str | os.PathLike[str]) -> bool:
    return location(path).exists() if is_remote(path) else os.path.exists(path)


def lexists(path: str | os.PathLike[str]) -> bool:
    """Something is at `path`, a link that points nowhere included."""
    return location(path).exists() if is_remote(path) else os.path.lexists(path)


def present(path: Path) -> bool:
    """Something other than a folder is at `path`: a file, or a FIFO or device that reading will refuse by name
    (`is_file()` would pass over it silently). In object storage: an object (not a prefix) is there."""
    if is_remote(path):
        return location(path).is_file()
    return os.path.lexists(path) and not path.is_dir()


def open_read(path: str | os.PathLike[str]) -> BinaryIO:
    """A checkpoint file opened for reading: a local regular file (a FIFO, socket, device or folder refused without
    blocking), or an object (ranged reads, cached in small blocks)."""
    if is_remote(path):
        return _object(path).open("rb")  # type: ignore[return-value]  # a RemoteFile reads as a binary file does
    return os.fdopen(local.open_regular_fd(path), "rb")


def file_size(f: object) -> int:
    """The size of a file opened by open_read."""
    if isinstance(f, RemoteFile):
        return f.size
    return os.fstat(f.fileno()).st_size  # type: ignore[attr-defined]


def check_writable(path: Path) -> None:
    """Refuse (exit 2) a destination ckpt cannot write: a protocol it only reads, an object store's root."""
    if is_remote(path):
        objects.writer_backend(_object(path))


def begin(dest: Path, is_dir: bool, overwrite: bool, guard: Guard, owner: str | None = None) -> Write:
    """Start a write at `dest`: the destination checked (--overwrite and what it must keep), a fresh temporary
    sibling made (locally; `owner` names it, default this process) or the old objects cleared (with --overwrite)."""
    if is_remote(dest):
        return objects.begin(_object(dest), is_dir, overwrite, guard)
    return local.begin(dest, is_dir, overwrite, guard, owner or str(os.getpid()))


def join(dest: Path, owner: str) -> Write:
    """Take part in the write `owner` began in another process (torchrun ranks): files go where its files go."""
    if is_remote(dest):
        return objects.join(_object(dest))
    return local.join(dest, owner)


def put(path: Path, data: bytes) -> None:
    """A small file written whole or not at all (a temporary sibling and one rename; in object storage one PUT)."""
    if is_remote(path):
        objects.put(_object(path), data)
        return
    with local.staged(path, is_dir=False, overwrite=True) as tmp:
        tmp.write_bytes(data)


def unfinished(dest: Path) -> list[str]:
    """One line for each write at `dest` that did not finish: a local temporary sibling whose process is gone (or a
    torchrun job's), an object upload never completed."""
    if is_remote(dest):
        return objects.unfinished(_object(dest))
    return [
        f"{p}: temporary output of a ckpt write that did not finish (its process is gone, or a torchrun job); remove it"
        for p in local.leftovers(dest)
    ]
