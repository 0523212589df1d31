"""One object written in order as parts: the shape every object store's writes share (an S3 multipart upload, an
Azure block blob's staged blocks). Bytes fill a part of a fixed size; IN_FLIGHT parts are sent at once while the next
is filled, so a writer holds at most (IN_FLIGHT + 1) parts. Nothing is visible until `commit()`, and `abort()` drops
what was sent. A backend says how a part goes (`_upload_part`), how an object that fits in one part goes
(`_put_whole`), how the parts become the object (`_finish`), and how sent parts are dropped (`_drop`).

Bytes that pass unchanged from an object of the same store arrive as `copy(url, offset, nbytes)` instead of `write`,
and the store copies them on its side where it can, so they never pass through this process: a whole source object
by one request (`_copy_whole`: S3 CopyObject, Azure Copy Blob From URL), a long range as parts copied from it
(`_copy_part`: S3 UploadPartCopy; RANGE_COPIES), COPIES_IN_FLIGHT of them at once (they hold no memory here). Runs of
one object that follow each other are joined first, and a small header written just before a run (a safetensors
header) or just after it is compared with the source's bytes there and joined too when equal: an output file equal to
a source object byte for byte becomes one copy request. What the store cannot copy is fetched (store/prefetch.py's
`stream`) and written as bytes. Each source's entity tag as the plan read it is named in the copy and checked again
before the object is completed: a source changed since is refused (DataError) and nothing is committed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckpt_cli.errors import DataError
from ckpt_cli.store.clients import count_copied, count_sent
from ckpt_cli.store.location import Location, RemoteFile, forget, is_remote, remote

IN_FLIGHT = 2  # parts of one object sent at once while the next is filled
COPIES_IN_FLIGHT = 8  # parts copied by the store at once (no bytes held here)
COPY_MIN = 8 << 20  # a range shorter than this (once a part before it is filled) is fetched and sent: one part's worth
COPY_PART = 64 << 20  # the most one copied part covers: a long range is cut so the store copies its parts in parallel
JOIN_BYTES = 1 << 20  # the most bytes written beside a copied range that are compared with the source to join it


def part_size(total: int, smallest: int, most: int) -> int:
    """`smallest`, or the next MiB multiple that keeps an object of `total` bytes within `most` parts."""
    need = -(-total // (most - 1))
    return max(smallest, -(-need // (1 << 20)) << 20)


def changed(source: Location, planned: str, now: str) -> DataError:
    return DataError(f"{source}: changed since it was read (entity tag {planned}, now {now}); nothing was written, run again")


class PartWriter:
    """A sequential write of one object in parts of `part` bytes (the descriptor-less sink of core/write/sinks.py)."""

    fd = None  # no descriptor: bytes go in order
    MIN_PART = 0  # the smallest part but the last (S3: 5 MiB)
    RANGE_COPIES = False  # the store copies a range of an object as a part (S3 UploadPartCopy)
    WHOLE_MOST = 0  # the largest object the store copies whole in one request (0: none)

    def __init__(self, path: Location, part: int, progress: Callable[[int], None] | None = None) -> None:
        self.path, self.part, self.progress = path, part, progress
        self.buffer = bytearray()
        self.sent: list[Future[Any]] = []  # every part, in order
        self.bodies: list[Future[Any]] = []  # the parts whose bytes are held until sent
        self.pool: ThreadPoolExecutor | None = None
        self.copy_pool: ThreadPoolExecutor | None = None  # copied parts (RANGE_COPIES), made at the first
        self.held: list[Any] | None = None  # [url, start, end]: a copied range not yet sent (the next may join it)
        self.copied: dict[str, str] = {}  # source url -> its entity tag as planned, for the check before commit
        self.same_store: dict[str, bool] = {}  # source url -> whether `copies` said yes
        self.done = False

    # what a backend gives
    def _start(self) -> None:
        """Before the first part (S3: create the multipart upload)."""

    def _upload_part(self, number: int, body: bytes) -> Any:
        """Send part `number` (from 1); what `_finish` needs to name it."""
        raise NotImplementedError

    def _copy_part(self, number: int, source: Location, start: int, end: int, etag: str) -> Any:
        """Part `number` copied by the store from bytes [start, end) of `source` (RANGE_COPIES)."""
        raise NotImplementedError

    def _copy_whole(self, source: Location, etag: str) -> None:
        """The object made a copy of `source` in one request, refused where its entity tag is no longer `etag`."""
        raise NotImplementedError

    def _current_etag(self, source: Location) -> str:
        """The entity tag `source` has now (a fresh request, not the command's cached probe)."""
        raise NotImplementedError

    def _put_whole(self, body: bytes) -> None:
        raise NotImplementedError

    def _finish(self, tokens: list[Any]) -> None:
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError

    def copies(self, url: str) -> bool:
        """Whether bytes of `url` may come as `copy`: an object of this very store and client (same endpoint and
        credentials), where the store copies at least whole objects."""
        if not (self.RANGE_COPIES or self.WHOLE_MOST):
            return False
        found = self.same_store.get(url)
        if found is None:  # asked for every run of the file: each object once
            found = is_remote(url) and remote(url).protocol == self.path.protocol and remote(url).fs is self.path.fs
            self.same_store[url] = found
        return found

    # the shared part
    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self.held is not None:
            if self._joins_after(view):
                return
            self._release()
        while len(view):
            take = min(len(view), self.part - len(self.buffer))
            self.buffer += view[:take]
            view = view[take:]
            if len(self.buffer) == self.part:
                self._send()
            if self.progress:
                self.progress(take)

    def copy(self, url: str, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of the object `url` (one `copies` said yes to), next in this object."""
        if not nbytes:
            return
        held = self.held
        if held is not None and held[0] == url and held[2] == offset:  # the run that follows: one range
            held[2] += nbytes
        else:
            self._release()
            self.copied.setdefault(url, remote(url).etag)  # as the plan read it (store/location.py keeps it)
            self.held = [url, offset, offset + nbytes]
            self._joins_before()
        if self.progress:
            self.progress(nbytes)

    def _source_bytes(self, url: str, start: int, end: int) -> bytes | None:
        source = remote(url)
        if start < 0 or end > source.stat().st_size:
            return None
        return RemoteFile(source).read_at(start, end - start)  # through the block cache: the reader read it already

    def _joins_before(self) -> None:
        """The bytes written so far (nothing sent yet: a header) joined to the range that follows, where the source
        holds the same bytes just before it: the object may then be the source whole."""
        assert self.held is not None
        url, start, end = self.held
        n = len(self.buffer)
        if not n or self.pool is not None or n > JOIN_BYTES or self._source_bytes(url, start - n, start) != bytes(self.buffer):
            return
        self.held = [url, start - n, end]
        self.buffer = bytearray()

    def _joins_after(self, view: memoryview) -> bool:
        """Small bytes written right after a held range, equal to the source's next bytes, joined to it."""
        assert self.held is not None
        url, start, end = self.held
        if start or self.buffer or self.pool is not None or len(view) > JOIN_BYTES or self._source_bytes(url, end, end + len(view)) != view:
            return False
        self.held[2] = end + len(view)
        if self.progress:
            self.progress(len(view))
        return True

    def _release(self) -> None:
        """Send the held range: copied by the store as parts where it can, else fetched and written as bytes."""
        held, self.held = self.held, None
        if held is None:
            return
        url, start, end = held
        fill = max(0, self.MIN_PART - len(self.buffer)) if self.buffer else 0  # parts before a copied one are full
        if not (self.RANGE_COPIES and end - start - fill >= COPY_MIN):
            self._fetch(url, start, end)
            return
        self._fetch(url, start, start + fill)
        start += fill
        if self.buffer:
            self._send()
        source = remote(url)
        count = -(-(end - start) // COPY_PART)
        cuts = [start + (end - start) * i // count for i in range(count + 1)]
        for a, b in zip(cuts, cuts[1:]):
            self._submit(self.sent, self._copied_part, len(self.sent) + 1, source, a, b, self.copied[url])

    def _fetch(self, url: str, start: int, end: int) -> None:
        """Bytes of a source fetched ahead in parallel ranged GETs and written (progress was counted by `copy`)."""
        from ckpt_cli.store.prefetch import stream

        progress, self.progress = self.progress, None
        try:
            for piece in stream(url, start, end - start):
                self.write(piece)
                if progress:
                    progress(0)  # lets a failing sibling or a SIGTERM stop this write (core/write/executor.py)
        finally:
            self.progress = progress

    def _submit(self, into: list[Future[Any]], fn: Callable[..., Any], *args: Any) -> None:
        if self.pool is None:
            self._start()
            self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="ckpt-upload")
        uploads = into is self.bodies
        if not uploads and self.copy_pool is None:  # its own threads: a streamed write keeps IN_FLIGHT of them
            self.copy_pool = ThreadPoolExecutor(COPIES_IN_FLIGHT, thread_name_prefix="ckpt-copy")
        pending = [f for f in (self.bodies if uploads else self.sent) if not f.done()]
        while len(pending) >= (IN_FLIGHT if uploads else COPIES_IN_FLIGHT):  # bounded memory and requests
            pending.pop(0).result()
        future = (self.pool if uploads else self.copy_pool).submit(fn, *args)  # type: ignore[union-attr]
        self.sent.append(future)
        if into is self.bodies:
            self.bodies.append(future)

    def _send(self) -> None:
        body, self.buffer = bytes(self.buffer), bytearray()
        self._submit(self.bodies, self._counted, len(self.sent) + 1, body)

    def _counted(self, number: int, body: bytes) -> Any:
        token = self._upload_part(number, body)
        count_sent(len(body))
        return token

    def _copied_part(self, number: int, source: Location, start: int, end: int, etag: str) -> Any:
        token = self._copy_part(number, source, start, end, etag)
        count_copied(end - start)
        return token

    def _whole_copy(self) -> bool:
        """Copy the object whole where it is exactly one source object: nothing else written, nothing sent yet."""
        if self.held is None or self.buffer or self.pool is not None:
            return False
        url, start, end = self.held
        source = remote(url)
        if start or end != source.stat().st_size or end > self.WHOLE_MOST:
            return False
        self.held = None
        self._check_source(url, self.copied[url])
        self._copy_whole(source, self.copied[url])
        count_copied(end)
        return True

    def _check_sources(self) -> None:
        """Every source copied from is the one the plan read: their entity tags asked at once, on the copy threads (a
        merge of 22 shards asked them one after another before its commit)."""
        checks = list(self.copied.items())
        if self.copy_pool is None or len(checks) < 2:
            for url, etag in checks:
                self._check_source(url, etag)
            return
        for future in [self.copy_pool.submit(self._check_source, url, etag) for url, etag in checks]:
            future.result()

    def _check_source(self, url: str, planned: str) -> None:
        now = self._current_etag(remote(url))
        if now != planned:
            raise changed(remote(url), planned, now)

    def commit(self) -> None:
        """Make the object visible: one request for a small object or a whole copy, else the last part and the parts
        joined, once every source copied from is checked to be the one the plan read."""
        if self._whole_copy():
            pass
        else:
            self._release()
            if self.pool is None:
                body, self.buffer = bytes(self.buffer), bytearray()
                self._put_whole(body)
                count_sent(len(body))
            else:
                if self.buffer:
                    self._send()
                tokens = [f.result() for f in self.sent]
                self._check_sources()
                self._finish(tokens)
                self._shutdown()
        self.done = True
        forget(self.path)

    def _shutdown(self, cancel: bool = False) -> None:
        for pool in (self.pool, self.copy_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=cancel)

    def abort(self) -> None:
        self.buffer = bytearray()
        self.held = None
        if self.pool is None:
            return
        self._shutdown(cancel=True)
        if not self.done:
            try:
                self._drop()
            except Exception:  # the store is unreachable: what was sent stays invisible (a lifecycle rule drops it)
                pass
