"""One object written in order as parts: the shape every object store's writes share (an S3 multipart upload, an
Azure block blob's staged blocks). Bytes fill a part of a fixed size; IN_FLIGHT parts are sent at once while the next
is filled, so a writer holds at most (IN_FLIGHT + 1) parts. Nothing is visible until `commit()`, and `abort()` drops
what was sent. A backend says how a part goes (`_upload_part`), how an object that fits in one part goes
(`_put_whole`), how the parts become the object (`_finish`), and how sent parts are dropped (`_drop`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckpt_cli.store.clients import count_sent
from ckpt_cli.store.location import Location, forget

IN_FLIGHT = 2  # parts of one object sent at once while the next is filled


def part_size(total: int, smallest: int, most: int) -> int:
    """`smallest`, or the next MiB multiple that keeps an object of `total` bytes within `most` parts."""
    need = -(-total // (most - 1))
    return max(smallest, -(-need // (1 << 20)) << 20)


class PartWriter:
    """A sequential write of one object in parts of `part` bytes (the descriptor-less sink of core/write/sinks.py)."""

    fd = None  # no descriptor: bytes go in order

    def __init__(self, path: Location, part: int, progress: Callable[[int], None] | None = None) -> None:
        self.path, self.part, self.progress = path, part, progress
        self.buffer = bytearray()
        self.sent: list[Future[Any]] = []
        self.pool: ThreadPoolExecutor | None = None
        self.done = False

    # what a backend gives
    def _start(self) -> None:
        """Before the first part (S3: create the multipart upload)."""

    def _upload_part(self, number: int, body: bytes) -> Any:
        """Send part `number` (from 1); what `_finish` needs to name it."""
        raise NotImplementedError

    def _put_whole(self, body: bytes) -> None:
        raise NotImplementedError

    def _finish(self, tokens: list[Any]) -> None:
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError

    # the shared part
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
        if self.pool is None:
            self._start()
            self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="ckpt-upload")
        while sum(not f.done() for f in self.sent) >= IN_FLIGHT:  # bounded memory: wait for the oldest part
            next(f for f in self.sent if not f.done()).result()
        body, self.buffer = bytes(self.buffer), bytearray()
        self.sent.append(self.pool.submit(self._counted, len(self.sent) + 1, body))

    def _counted(self, number: int, body: bytes) -> Any:
        token = self._upload_part(number, body)
        count_sent(len(body))
        return token

    def commit(self) -> None:
        """Make the object visible: one request for a small object, else the last part and the parts joined."""
        if self.pool is None:
            body, self.buffer = bytes(self.buffer), bytearray()
            self._put_whole(body)
            count_sent(len(body))
        else:
            if self.buffer:
                self._send()
            self._finish([f.result() for f in self.sent])
            self.pool.shutdown()
        self.done = True
        forget(self.path)

    def abort(self) -> None:
        self.buffer = bytearray()
        if self.pool is None:
            return
        self.pool.shutdown(wait=True, cancel_futures=True)
        if not self.done:
            try:
                self._drop()
            except Exception:  # the store is unreachable: what was sent stays invisible (a lifecycle rule drops it)
                pass
