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
from types import ModuleType
from typing import Any

from ckpt_cli.errors import UsageError
from ckpt_cli.store.clients import backend, call
from ckpt_cli.store.guard import Guard, check_destination
from ckpt_cli.store.location import Location, forget, location


def writer_backend(path: Location) -> ModuleType:
    """The backend that writes `path` (UsageError where ckpt only reads: gs://, memory://..., or where `path` names no
    key under the bucket or container: every write, put and join passes here before a Writer is made)."""
    module = backend(path.protocol)
    if module.Writer is None:
        raise UsageError(f"{path}: ckpt reads {path.protocol}:// but writes only to s3:// and az:// object storage")
    module.check_key(path)
    return module


class ObjectFile:
    """One object being written, in order (`fd` is None: no positional writes); `commit` makes it visible."""

    fd = None

    def __init__(self, inner: Any, done: Callable[[Location], None]) -> None:
        self.inner, self._done = inner, done

    def write(self, data: Any) -> None:
        self.inner.write(data)

    def commit(self) -> None:
        self.inner.commit()
        self._done(self.inner.path)

    def abort(self) -> None:
        self.inner.abort()


class ObjectWrite:
    """A write under `root` (the destination itself). `abort` deletes the objects this process completed; `commit`
    has nothing left to do (the markers written last were the commit)."""

    def __init__(self, root: Location, module: ModuleType) -> None:
        self.root, self.module = root, module
        self.written: list[Location] = []
        self.lock = threading.Lock()

    def create(self, target: Path, total: int, progress: Callable[[int], None] | None = None) -> ObjectFile:
        return ObjectFile(self.module.Writer(location(target), total, progress), self._add)

    def _add(self, path: Location) -> None:
        with self.lock:
            self.written.append(path)

    def sync(self) -> None:
        """Nothing: a completed object is stored durably."""

    def commit(self) -> None:
        """Nothing: the commit markers, written last, made the checkpoint complete."""

    def abort(self) -> None:
        remove(self.written)


def begin(dest: Location, is_dir: bool, overwrite: bool, guard: Guard) -> ObjectWrite:
    """Refuse an existing destination unless --overwrite, and with it delete what is there (and drop what a killed
    write left unfinished). A one-object output replaces the old object when its upload completes."""
    module = writer_backend(dest)
    check_destination(dest, overwrite, is_dir, guard)
    if overwrite:
        clear(dest, keep_object=not is_dir)
    return ObjectWrite(dest, module)


def join(dest: Location) -> ObjectWrite:
    return ObjectWrite(dest, writer_backend(dest))


def remove(paths: list[Location]) -> None:
    """Delete objects (best effort: used to clean up after a failed write)."""
    for path in paths:
        try:
            call(path, path.fs.rm_file, path.key)
        except Exception:
            pass
        forget(path)


def clear(dest: Location, keep_object: bool) -> None:
    """Delete an existing checkpoint at `dest` before it is replaced: the objects under the prefix, and the object
    named `dest` itself unless `keep_object`."""
    fs = dest.fs
    if dest.is_dir():
        keys = [k for k in call(dest, fs.find, dest.key) if k.startswith(dest.key + "/")]
        if keys:
            call(dest, fs.rm, keys)
    if not keep_object and dest.is_file():
        call(dest, fs.rm_file, dest.key)
    backend(dest.protocol).drop_unfinished(dest)  # a killed write's parts
    forget(dest)


def put(path: Location, data: bytes) -> None:
    """One small object, whole or not at all."""
    out = writer_backend(path).Writer(path, len(data))
    try:
        out.write(data)
        out.commit()
    except BaseException:
        out.abort()
        raise


def unfinished(dest: Location) -> list[str]:
    """One line for each write at or under `dest` that started and never completed (invisible, but stored)."""
    module = backend(dest.protocol)
    if module.Writer is None:
        return []
    bucket = dest.parts[1]
    return [f"{dest.protocol}://{bucket}/{key}: {module.UNFINISHED}" for key in module.unfinished(dest)]
