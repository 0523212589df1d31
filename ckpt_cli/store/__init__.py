"""Where checkpoints live: the local filesystem or object storage (s3://, az://, any fsspec URL for reads).

Everything else in ckpt asks this package, never a protocol: a location (`location`), what it can do
(`mappable`: read by descriptor and memory map; `renames`: a write commits by renaming a finished temporary, where
object storage commits with markers written last), its bytes (`size`, `exists`, `present`, `open_read`,
`read_into`, `prefetch_heads`), and writes as one transaction (`begin`, `join`): create a file as a sink, sync,
commit, abort, and the unfinished writes a killed one left (`unfinished`).

Each function finds the backend of its path once (`backend_of`: store/local.py's LOCAL for a local path, the
protocol's row in store/clients.py's BACKENDS for a URL) and asks it; a backend implements the `Backend` protocol of
store/backend.py.

Modules: backend.py (the Backend and ObjectBackend protocols), location.py (Location, ranged reads and their cache),
clients.py (one client per protocol, the BACKENDS table, error words, request counts), s3.py / azure.py (one backend
class per object store: client, writer, unfinished writes), fsspec_any.py (other fsspec protocols, read-only),
objects.py (what the object stores share: object writes with data first and markers last, cleanup), local.py (local
storage: the temporary sibling and rename), guard.py (what --overwrite must keep), prefetch.py (tensor data fetched
ahead), predicted.py (items a reader laid out by prediction, checked whole when their data is fetched).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, cast

from ckpt_cli.store.backend import Backend, File, ObjectBackend, PathLike, Write
from ckpt_cli.store.clients import backend
from ckpt_cli.store.guard import Guard, check_destination
from ckpt_cli.store.local import LOCAL
from ckpt_cli.store.location import Location, RemoteFile, fresh, location, prefetch_heads, protocol_of, read_into

__all__ = ["Backend", "File", "Guard", "Location", "Write", "backend_of", "begin", "check_destination", "check_writable", "exists"]
__all__ += ["fresh", "is_bucket", "join", "lexists", "location", "mappable", "open_read", "prefetch_heads", "present"]
__all__ += ["put", "read_into", "renames", "size", "unfinished", "files_under", "tensorstore_kvstore"]


def backend_of(path: object) -> Backend:
    """The backend that holds `path`: local storage for a local path, else the object store its protocol names (any
    fsspec protocol without a row in BACKENDS is read through store/fsspec_any.py)."""
    protocol = protocol_of(path)
    # a BACKENDS row names an ObjectBackend class (tests/test_store_backends.py checks each)
    return LOCAL if protocol is None else cast(ObjectBackend, backend(protocol))


def mappable(path: object) -> bool:
    """Whether the bytes at `path` are read by descriptor (pread, memory maps, kernel copies): a local file."""
    return backend_of(path).mappable


def renames(path: object) -> bool:
    """Whether a write to `path` commits by renaming a finished temporary (locally). In object storage it commits
    with its markers written last, objects carry upload times, and links do not exist."""
    return backend_of(path).renames


def is_bucket(path: PathLike) -> bool:
    """The root of an object store (a bucket, a container): its listing may be of any size."""
    return backend_of(path).is_bucket(path)


def size(path: PathLike) -> int:
    """The size of a file or object (OSError when missing, as os.path.getsize)."""
    return backend_of(path).size(path)


def exists(path: PathLike) -> bool:
    return backend_of(path).exists(path)


def lexists(path: PathLike) -> bool:
    """Something is at `path`, a link that points nowhere included."""
    return backend_of(path).lexists(path)


def present(path: Path) -> bool:
    """Something other than a folder is at `path`: a file, or a FIFO or device that reading will refuse by name
    (`is_file()` would pass over it silently). In object storage: an object (not a prefix) is there."""
    return backend_of(path).present(path)


def open_read(path: PathLike) -> BinaryIO:
    """A checkpoint file opened for reading: a local regular file (a FIFO, socket, device or folder refused without
    blocking), or an object (ranged reads, cached in small blocks)."""
    return backend_of(path).open_read(path)


def file_size(f: BinaryIO) -> int:
    """The size of a file opened by open_read."""
    if isinstance(f, RemoteFile):
        return f.size
    return os.fstat(f.fileno()).st_size


def check_writable(path: Path) -> None:
    """Refuse (exit 2) a destination ckpt cannot write: a protocol it only reads, an object store's root."""
    backend_of(path).check_writable(path)


def begin(dest: Path, is_dir: bool, overwrite: bool, guard: Guard, owner: str | None = None) -> Write:
    """Start a write at `dest`: the destination checked (--overwrite and what it must keep), a fresh temporary
    sibling made (locally; `owner` names it, default this process) or the old objects cleared (with --overwrite)."""
    return backend_of(dest).begin(dest, is_dir, overwrite, guard, owner)


def join(dest: Path, owner: str) -> Write:
    """Take part in the write `owner` began in another process (torchrun ranks): files go where its files go."""
    return backend_of(dest).join(dest, owner)


def put(path: Path, data: bytes) -> None:
    """A small file written whole or not at all (a temporary sibling and one rename; in object storage one PUT)."""
    backend_of(path).put(path, data)


def unfinished(dest: Path) -> list[str]:
    """One line for each write at `dest` that did not finish: a local temporary sibling whose process is gone (or a
    torchrun job's), an object upload never completed."""
    return backend_of(dest).unfinished(dest)


def files_under(folder: PathLike) -> list[tuple[Path, int]]:
    """Every file (object) below a folder (prefix) with its size, by path."""
    return backend_of(folder).files_under(folder)


def tensorstore_kvstore(folder: PathLike) -> dict[str, Any] | None:
    """tensorstore's kvstore spec for a folder (a library that reads the files itself: Orbax's arrays); None where
    ckpt does not point tensorstore at that store."""
    return backend_of(folder).tensorstore_kvstore(folder)
