"""Writing objects to S3: each output file streams into one multipart upload, completed only once every byte
is sent, and aborted on any failure, so an object is either whole or absent.

Object storage has no rename: there is no temporary sibling to move into place as a local write does
(core/atomic.py). The executor (core/executor.py) uploads every data object first and the commit markers
(DCP `.metadata`, the hf index, DeepSpeed `latest`) last, after all data objects completed; a write that
fails or is interrupted aborts its uploads and deletes the objects it completed, and one killed outright
leaves at most data objects without a marker, which `verify` reports as an incomplete checkpoint.

Memory is bounded: a writer holds one part being filled and at most IN_FLIGHT parts being sent, so a
write holds about (IN_FLIGHT + 1) x part size x workers. Parts are PART_BYTES (S3 needs at least 5 MiB
but for the last), larger only when an object would need more than MAX_PARTS of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckpt_cli.core import storage
from ckpt_cli.core.filesystems import call, count_sent
from ckpt_cli.core.storage import RemotePath
from ckpt_cli.errors import UsageError

PART_BYTES = 8 << 20
MAX_PARTS = 10_000
IN_FLIGHT = 2  # parts of one object sent at once while the next is filled


def part_size(total: int) -> int:
    """PART_BYTES, or the next MiB multiple that keeps an object of `total` bytes within MAX_PARTS parts."""
    need = -(-total // (MAX_PARTS - 1))
    return max(PART_BYTES, -(-need // (1 << 20)) << 20)


def bucket_and_key(path: RemotePath) -> tuple[str, str]:
    if path.protocol not in ("s3", "s3a"):
        raise UsageError(f"{path}: ckpt writes to s3:// object storage only (reads work for any fsspec protocol)")
    if len(path.parts) < 3:
        raise UsageError(f"{path}: a destination needs a key under the bucket (s3://bucket/name)")
    return path.parts[1], "/".join(path.parts[2:])


class ObjectWriter:
    """A sequential write of one object of `total` bytes. Nothing is visible until `commit()`; `abort()` (or
    an exception inside `with`) leaves nothing behind. An object that fits in one part is one PUT."""

    def __init__(self, path: RemotePath, total: int, progress: Callable[[int], None] | None = None) -> None:
        self.path, self.progress = path, progress
        self.bucket, self.key = bucket_and_key(path)
        self.part = part_size(total)
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.sent: list[Future[dict[str, Any]]] = []
        self.pool: ThreadPoolExecutor | None = None
        self.done = False

    def _s3(self, method: str, **kwargs: Any) -> Any:
        return call(self.path, self.path.fs.call_s3, method, Bucket=self.bucket, Key=self.key, **kwargs)

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.part - len(self.buffer))
            self.buffer += view[:take]
            view = view[take:]
            if len(self.buffer) == self.part:
                self._send()
            if self.progress:
                self.progress(take)

    def _send(self) -> None:
        if self.upload_id is None:
            self.upload_id = self._s3("create_multipart_upload")["UploadId"]
            self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="ckpt-upload")
        while sum(not f.done() for f in self.sent) >= IN_FLIGHT:  # bounded memory: wait for the oldest part
            next(f for f in self.sent if not f.done()).result()
        body, self.buffer = bytes(self.buffer), bytearray()
        number = len(self.sent) + 1
        self.sent.append(self.pool.submit(self._part, number, body))  # type: ignore[union-attr]

    def _part(self, number: int, body: bytes) -> dict[str, Any]:
        reply = self._s3("upload_part", UploadId=self.upload_id, PartNumber=number, Body=body)
        count_sent(len(body))
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def commit(self) -> None:
        """Make the object visible: one PUT, or the last part and the completion of the multipart upload."""
        if self.upload_id is None:
            body, self.buffer = bytes(self.buffer), bytearray()
            self._s3("put_object", Body=body)
            count_sent(len(body))
        else:
            if self.buffer:
                self._send()
            parts = [f.result() for f in self.sent]
            self._s3("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": parts})
            self.pool.shutdown()  # type: ignore[union-attr]
        self.done = True
        storage.forget(self.path)

    def abort(self) -> None:
        """Drop the upload: parts not sent are cancelled, the multipart upload aborted (best effort)."""
        self.buffer = bytearray()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.upload_id is not None and not self.done:
            try:
                self._s3("abort_multipart_upload", UploadId=self.upload_id)
            except Exception:  # the store is unreachable: the upload stays listed, never visible as an object
                pass

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is not None or not self.done:
            self.abort()


def remove(paths: list[RemotePath]) -> None:
    """Delete objects (best effort: used to clean up after a failed write)."""
    for path in paths:
        try:
            call(path, path.fs.rm_file, path.key)
        except Exception:
            pass
        storage.forget(path)


def clear(dest: RemotePath, keep_object: bool) -> None:
    """Delete an existing checkpoint at `dest` before it is replaced: the objects under the prefix, and the object
    named `dest` itself unless `keep_object` (a one-object output replaces it when its upload completes)."""
    fs = dest.fs
    if dest.is_dir():
        keys = [k for k in call(dest, fs.find, dest.key) if k.startswith(dest.key + "/")]
        if keys:
            call(dest, fs.rm, keys)
    if not keep_object and dest.is_file():
        call(dest, fs.rm_file, dest.key)
    abort_unfinished(dest)  # a killed write's parts
    storage.forget(dest)


def _uploads(dest: RemotePath) -> list[tuple[str, str]]:
    """(key, upload id) of the multipart uploads at `dest` or under the prefix `dest/`, neither completed nor aborted."""
    if dest.protocol not in ("s3", "s3a") or len(dest.parts) < 3:
        return []
    bucket, key = dest.parts[1], "/".join(dest.parts[2:])
    found: list[tuple[str, str]] = []
    for prefix in (key, key + "/"):
        reply = call(dest, dest.fs.call_s3, "list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        found += [(u["Key"], u["UploadId"]) for u in reply.get("Uploads", []) if u["Key"] == key or u["Key"].startswith(key + "/")]
    return sorted(set(found))


def unfinished_uploads(dest: RemotePath) -> list[str]:
    """Keys at or under `dest` with a multipart upload started and neither completed nor aborted (a write killed
    outright, or one running now): invisible, but stored (and billed) until aborted."""
    return sorted({key for key, _ in _uploads(dest)})


def abort_unfinished(dest: RemotePath) -> None:
    for key, upload in _uploads(dest):
        call(dest, dest.fs.call_s3, "abort_multipart_upload", Bucket=dest.parts[1], Key=key, UploadId=upload)


class Cleanup:
    """The objects one write completed, deleted if the write fails before its commit markers are written."""

    def __init__(self) -> None:
        self.written: list[RemotePath] = []
        self.lock = threading.Lock()

    def add(self, path: RemotePath) -> None:
        with self.lock:
            self.written.append(path)

    def undo(self) -> None:
        remove(self.written)
