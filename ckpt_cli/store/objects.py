"""Writes to object storage: each output file streams into one object through its backend's writer (an S3
multipart upload, Azure staged blocks), visible only once every byte is sent and dropped on any failure.

Object storage has no rename: there is no temporary sibling to move into place as a local write does
(store/local.py). The executor (core/write/executor.py) writes every data object first and the commit markers (DCP
`.metadata`, the hf index, DeepSpeed `latest`) last, after all data objects completed; a write that fails or is
interrupted aborts its uploads and deletes the objects it completed, and one killed outright leaves at most data
objects without a marker, which `verify` reports as an incomplete checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_cli.errors import UsageError
from ckpt_cli.store.backend import MakeWriter, ObjectWriter, PathLike
from ckpt_cli.store.clients import call
from ckpt_cli.store.guard import Guard, check_destination
from ckpt_cli.store.location import Location, forget, location, remote


class ObjectStore:
    """What every object store shares (the store-level half of the ObjectBackend protocol): reads through `Location`,
    writes as objects with data first and markers last. A subclass gives the client (`make`, `ENVIRONMENT`), the error
    words (`translate`, `CREDENTIALS`, `INSTALL_HINT`) and, if ckpt writes there, `Writer`, `check_key`,
    `unfinished_keys`, `drop_unfinished` and `UNFINISHED`; the defaults here are a store ckpt only reads."""

    mappable = False
    renames = False
    INSTALL_HINT: str
    CREDENTIALS: str
    ENVIRONMENT: tuple[str, ...] = ()
    UNFINISHED = ""
    DESTINATION = ""  # what a destination must name under the root, "{protocol}" filled in: "a key under the bucket"
    Writer: MakeWriter | None = None

    def translate(self, exc: BaseException, where: object) -> Exception | None:
        return None

    def check_key(self, path: Location) -> None:
        """A store ckpt writes to (`DESTINATION` set) refuses the root of a bucket or container; any key is a destination."""
        if self.DESTINATION and len(path.parts) < 3:
            raise UsageError(f"{path}: a destination needs {self.DESTINATION.format(protocol=path.protocol)}")

    def unfinished_keys(self, dest: Location) -> list[str]:
        return []

    def drop_unfinished(self, dest: Location) -> None:
        """Nothing is left unfinished where nothing is written."""

    # ---- the Backend protocol, shared ----

    def is_bucket(self, path: PathLike) -> bool:
        return len(remote(path).parts) <= 2

    def size(self, path: PathLike) -> int:
        return remote(path).stat().st_size

    def exists(self, path: PathLike) -> bool:
        return remote(path).exists()

    lexists = exists  # object storage has no links

    def present(self, path: Path) -> bool:
        return remote(path).is_file()

    def open_read(self, path: PathLike) -> BinaryIO:
        return remote(path).open("rb")  # type: ignore[return-value]  # a RemoteFile reads as a binary file does

    def check_writable(self, path: Path) -> None:
        self.writer(remote(path))

    def files_under(self, folder: PathLike) -> list[tuple[Path, int]]:
        """Every object under the prefix with its size: one listing with sizes, not a request per object."""
        where = remote(folder)
        found = call(where, where.fs.find, where.key, detail=True)
        files = [(location(f"{where.protocol}://{k}"), int(v.get("size") or 0)) for k, v in found.items() if v.get("type") != "directory"]
        return sorted(files, key=lambda f: str(f[0]))

    def tensorstore_kvstore(self, folder: PathLike) -> dict[str, Any] | None:
        """A store tensorstore has no driver for (or that ckpt does not point it at): None."""
        return None

    def writer(self, path: Location) -> MakeWriter:
        """The writer of objects at `path` (UsageError where ckpt only reads: gs://, memory://..., or where `path` names
        no key under the bucket or container: every write, put and join passes here before a Writer is made)."""
        if self.Writer is None:
            raise UsageError(f"{path}: ckpt reads {path.protocol}:// but writes only to s3:// and az:// object storage")
        self.check_key(path)
        return self.Writer

    def begin(self, dest: Path, is_dir: bool, overwrite: bool, guard: Guard, owner: str | None = None) -> ObjectWrite:
        """Refuse an existing destination unless --overwrite, and with it delete what is there (and drop what a killed
        write left unfinished). A one-object output replaces the old object when its upload completes."""
        root = remote(dest)
        make = self.writer(root)
        check_destination(dest, overwrite, is_dir, guard)
        if overwrite:
            self.clear(root, keep_object=not is_dir)
        return ObjectWrite(location(dest), make)

    def join(self, dest: Path, owner: str) -> ObjectWrite:
        return ObjectWrite(location(dest), self.writer(remote(dest)))

    def put(self, path: Path, data: bytes) -> None:
        """One small object, whole or not at all."""
        where = remote(path)
        out = self.writer(where)(where, len(data))
        try:
            out.write(data)
            out.commit()
        except BaseException:
            out.abort()
            raise

    def unfinished(self, dest: Path) -> list[str]:
        """One line for each write at or under `dest` that started and never completed (invisible, but stored)."""
        where = remote(dest)
        if self.Writer is None or len(where.parts) < 3:  # no key: a bucket's root holds no write of ckpt's
            return []
        return [f"{where.protocol}://{where.parts[1]}/{key}: {self.UNFINISHED}" for key in self.unfinished_keys(where)]

    def clear(self, dest: Location, keep_object: bool) -> None:
        """Delete an existing checkpoint at `dest` before it is replaced: the objects under the prefix, and the object
        named `dest` itself unless `keep_object`."""
        fs = dest.fs
        if dest.is_dir():
            keys = [k for k in call(dest, fs.find, dest.key) if k.startswith(dest.key + "/")]
            if keys:
                call(dest, fs.rm, keys)
        if not keep_object and dest.is_file():
            call(dest, fs.rm_file, dest.key)
        self.drop_unfinished(dest)  # a killed write's parts
        forget(dest)


class ObjectFile:
    """One object being written, in order (`fd` is None: no positional writes); `commit` makes it visible."""

    fd = None

    def __init__(self, inner: ObjectWriter, done: Callable[[Location], None]) -> None:
        self.inner, self._done = inner, done

    def write(self, data: Any) -> None:
        self.inner.write(data)

    def copies(self, url: str) -> bool:
        """Whether unchanged bytes of `url` may come as `copy` (the store copies them on its side: store/parts.py)."""
        return self.inner.copies(url)

    def copy(self, url: str, offset: int, nbytes: int) -> None:
        self.inner.copy(url, offset, nbytes)

    @property
    def copies_ranges(self) -> bool:
        """Whether the store copies a range of an object into this one (S3), not only a whole object (Azure)."""
        return self.inner.RANGE_COPIES

    def commit(self) -> None:
        self.inner.commit()
        self._done(self.inner.path)

    def abort(self) -> None:
        self.inner.abort()


class ObjectWrite:
    """A write under `root` (the destination itself). `abort` deletes the objects this process completed; `commit`
    has nothing left to do (the markers written last were the commit)."""

    def __init__(self, root: Path, make: MakeWriter) -> None:
        self.root, self.make = root, make  # a Location, typed as the Path it stands for (store/location.py)
        self.written: list[Location] = []
        self.lock = threading.Lock()

    def create(self, target: Path, total: int, progress: Callable[[int], None] | None = None) -> ObjectFile:
        return ObjectFile(self.make(remote(target), total, progress), self._add)

    def _add(self, path: Location) -> None:
        with self.lock:
            self.written.append(path)

    def sync(self) -> None:
        """Nothing: a completed object is stored durably."""

    def commit(self) -> None:
        """Nothing: the commit markers, written last, made the checkpoint complete."""

    def abort(self) -> None:
        remove(self.written)


def remove(paths: list[Location]) -> None:
    """Delete objects (best effort: used to clean up after a failed write)."""
    for path in paths:
        try:
            call(path, path.fs.rm_file, path.key)
        except Exception:
            pass
        forget(path)
