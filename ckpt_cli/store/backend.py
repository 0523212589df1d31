"""What a store backend provides, as typed Protocols: `Backend` is what `ckpt_cli.store` dispatches to (local storage,
store/local.py's `LOCAL`, is one backend; each object store another), `ObjectBackend` what an object store adds for
its client, its errors and its object writes (store/s3.py, store/azure.py, store/fsspec_any.py; the shared part is
store/objects.py's `ObjectStore`). `store.backend_of(path)` finds the backend of a location once.

A new object store is one class implementing `ObjectBackend` (an `ObjectStore` subclass) and one row per URL scheme in
store/clients.py's `BACKENDS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeAlias, runtime_checkable

from ckpt_cli.store.clients import Client

if TYPE_CHECKING:  # only for annotations: nothing here runs code of the store
    from ckpt_cli.store.guard import Guard
    from ckpt_cli.store.location import Location

PathLike: TypeAlias = "str | os.PathLike[str]"


class File(Protocol):
    @property
    def fd(self) -> int | None:
        """A local file's descriptor (positional writes from threads); None: bytes go in order through `write`."""
        ...

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


@runtime_checkable
class Backend(Protocol):
    """Where checkpoints live: how bytes at a path are sized, found and read, and how a write to it is a transaction.
    Each method does what the function of its name in `ckpt_cli.store` says (that function finds the backend and asks
    it)."""

    mappable: bool  # read by descriptor (pread, memory maps, kernel copies): a local file
    renames: bool  # a write commits by renaming a finished temporary; object storage commits with markers written last

    def is_bucket(self, path: PathLike) -> bool: ...
    def size(self, path: PathLike) -> int: ...
    def exists(self, path: PathLike) -> bool: ...
    def lexists(self, path: PathLike) -> bool: ...
    def present(self, path: Path) -> bool: ...
    def open_read(self, path: PathLike) -> BinaryIO: ...
    def check_writable(self, path: Path) -> None: ...
    def begin(self, dest: Path, is_dir: bool, overwrite: bool, guard: Guard, owner: str | None) -> Write: ...
    def join(self, dest: Path, owner: str) -> Write: ...
    def put(self, path: Path, data: bytes) -> None: ...
    def unfinished(self, dest: Path) -> list[str]: ...
    def files_under(self, folder: PathLike) -> list[tuple[Path, int]]: ...
    def tensorstore_kvstore(self, folder: PathLike) -> dict[str, Any] | None: ...


class ObjectWriter(File, Protocol):
    """One object being written in order (store/parts.py's PartWriter; `fd` None): visible only after `commit`."""

    path: Location
    RANGE_COPIES: bool  # the store copies a range of another object as a part (S3), not only whole objects

    def copies(self, url: str) -> bool:
        """Whether bytes of the object `url` may come as `copy` (the store copies them on its side)."""
        ...

    def copy(self, url: str, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of the object `url`, next in this object, unchanged."""
        ...


class MakeWriter(Protocol):
    """An object store's writer class: one object of `total` bytes at `path`."""

    def __call__(self, path: Location, total: int, progress: Callable[[int], None] | None = None) -> ObjectWriter: ...


@runtime_checkable
class ObjectBackend(Backend, Client, Protocol):
    """An object store: its fsspec client and its errors in one line (`Client`: INSTALL_HINT, CREDENTIALS,
    ENVIRONMENT, make, translate), and (where ckpt writes there) its object writes."""

    UNFINISHED: str  # how an unfinished write reads in `verify`

    @property
    def Writer(self) -> MakeWriter | None:  # the writer class, named as one
        """The class that writes one object (store/parts.py's PartWriter); None where ckpt only reads the protocol."""
        ...

    def check_key(self, path: Location) -> None:
        """Refuse (UsageError) a destination that names no object (the root of a bucket or container)."""
        ...

    def unfinished_keys(self, dest: Location) -> list[str]:
        """Keys at or under `dest` (a key, never a root) whose write started and never completed (invisible, but stored)."""
        ...

    def drop_unfinished(self, dest: Location) -> None:
        """Drop what `unfinished_keys` lists (before --overwrite replaces `dest`)."""
        ...
