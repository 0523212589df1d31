"""Tensor data from object storage: parallel ranged GETs, fetched ahead of the reader, memory bounded.

`stream` reads one byte range in pieces of PIECE_BYTES with AHEAD of them in flight. `Prefetch` serves the
byte runs a whole output file will read, in the order it reads them (core/write/executor.py knows them from the
plan): runs of one object that follow each other with gaps under GAP_BYTES (zip headers between DCP chunks, a
skipped tensor) are fetched as one span cut in pieces, so a checkpoint of many small tensors costs a few large
GETs, not one round trip per tensor. Memory: AHEAD + 1 pieces per reader.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ckpt_cli.errors import DataError
from ckpt_cli.store.location import fetch_view, location, remote

PIECE_BYTES = 8 << 20
AHEAD = 3
GAP_BYTES = 1 << 20
ByteRun = tuple[str, int, int]  # (url, byte offset, byte count), as core/reading.py
Fetched = bytes | memoryview  # a GET's bytes, or a view of the longer bytes a checked GET took (store/predicted.py)

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _fetch(url: str, start: int, end: int) -> Future[Fetched]:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(32, thread_name_prefix="ckpt-read")
    return _pool.submit(fetch_view, remote(url), start, end)


def stream(url: str, offset: int, nbytes: int) -> Iterator[Fetched]:
    """Bytes [offset, offset + nbytes) of an object, piece by piece; DataError if the object ends first."""
    if offset + nbytes > location(url).stat().st_size:
        raise DataError(f"{url}: truncated: expected {nbytes} bytes at offset {offset}, file ends first")
    pending: deque[Future[Fetched]] = deque()
    pos, end = offset, offset + nbytes
    try:
        while pos < end or pending:
            while pos < end and len(pending) < AHEAD:
                n = min(PIECE_BYTES, end - pos)
                pending.append(_fetch(url, pos, pos + n))
                pos += n
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def refuse_short(runs: Iterable[ByteRun]) -> None:
    """DataError naming the first object that ends before the runs' data (each object's size asked once)."""
    ends: dict[str, int] = {}
    for url, offset, nbytes in runs:
        ends[url] = max(ends.get(url, 0), offset + nbytes)
    for url, end in ends.items():
        if end > location(url).stat().st_size:
            raise DataError(f"{url}: truncated: the object ends before the data it should hold")


@dataclass
class _Piece:
    url: str
    start: int
    end: int
    data: Future[Fetched]


def pieces(runs: list[ByteRun]) -> list[tuple[str, int, int]]:
    """(url, start, end) pieces covering the runs in order: close runs of one object fetched together, about
    PIECE_BYTES a piece (eight 4 MiB DCP chunks with their zip headers between are four GETs, not four and a sliver).
    A piece ends where a run ends: a run of at most 2 PIECE_BYTES is never cut, so a DCP chunk laid out by prediction
    is fetched whole once, with its headers (store/predicted.py); a longer run is cut in pieces of about PIECE_BYTES."""
    found: list[tuple[str, int, int]] = []
    current: list = []  # [url, start, end] of the piece being gathered
    for url, offset, nbytes in runs:
        end = offset + nbytes
        joins = current and current[0] == url and current[2] <= offset <= current[2] + GAP_BYTES
        if joins and end - current[1] <= 2 * PIECE_BYTES:
            current[2] = end
        else:
            if current:
                found.append((current[0], current[1], current[2]))
            if nbytes > 2 * PIECE_BYTES:
                count = (nbytes + PIECE_BYTES // 2) // PIECE_BYTES  # about PIECE_BYTES each, no sliver at the end
                cuts = [offset + nbytes * i // count for i in range(count + 1)]
                found += [(url, a, b) for a, b in zip(cuts[:-1], cuts[1:-1])]
                offset = cuts[-2]
            current = [url, offset, end]
        if current[2] - current[1] >= PIECE_BYTES:
            found.append((current[0], current[1], current[2]))
            current = []
    if current:
        found.append((current[0], current[1], current[2]))
    return found


class Prefetch:
    """The runs a reader will read, in order, fetched AHEAD pieces in advance. `take` serves the next run, or
    None when asked for another one (the reader then reads it directly: nothing is assumed)."""

    def __init__(self, runs: list[ByteRun]) -> None:
        self.runs = deque(r for r in runs if r[2] > 0)
        self.todo = deque(pieces(list(self.runs)))
        self.inflight: deque[_Piece] = deque()
        self.current: tuple[str, int, int, Fetched] | None = None
        refuse_short(self.runs)

    def take(self, url: str, offset: int, nbytes: int) -> Iterator[memoryview] | None:
        if not nbytes:
            return iter(())
        if not self.runs or self.runs[0] != (url, offset, nbytes):
            return None
        self.runs.popleft()
        return self._serve(url, offset, offset + nbytes)

    def _serve(self, url: str, pos: int, end: int) -> Iterator[memoryview]:
        while pos < end:
            cur = self.current
            while cur is None or cur[0] != url or not cur[1] <= pos < cur[2]:
                cur = self.current = self._next()
            take = min(end, cur[2]) - pos
            yield memoryview(cur[3])[pos - cur[1] : pos - cur[1] + take]
            pos += take

    def _fill(self) -> None:
        while len(self.inflight) < AHEAD and self.todo:
            url, start, end = self.todo.popleft()
            self.inflight.append(_Piece(url, start, end, _fetch(url, start, end)))

    def _next(self) -> tuple[str, int, int, Fetched]:
        self._fill()
        if not self.inflight:
            raise AssertionError("prefetch schedule ran out before the runs it planned")
        piece = self.inflight.popleft()
        self._fill()  # AHEAD pieces in flight while this one is consumed
        return piece.url, piece.start, piece.end, piece.data.result()

    def close(self) -> None:
        for piece in self.inflight:
            piece.data.cancel()
        self.inflight.clear()
        self.todo.clear()
        self.current = None
