"""Ranged GETs shared by the output files of one write: bytes of a source object that several files read at about the
same time are fetched once, as one span, and held until each file took its runs.

Each output file reads its runs in its own order (store/prefetch.py's Prefetch fetches them ahead, merging only runs
that follow each other). But neighbours in a source object are often read by different files, or far apart in one:
`dcp.save` with a thread per file puts tensor i in file i mod 29, so the hf shards, in name order, read every 4 MiB
tensor from another object than the one before (one GET per tensor), and an FSDP rank file holds its shard of every
tensor in turn, read by each output file between the other ranks' (one GET per tensor and rank). Here the runs of
every file are known before the write: the runs of each object, in offset order, are joined into spans of about
PIECE_BYTES (gaps under GAP_BYTES; a span grows while under PIECE_BYTES, to at most twice that) when the files read
them at about the same time (a run longer than 2 PIECE_BYTES stays alone and streams in pieces). The time model: a
write's `workers` threads take the files in order, so file k's run at byte `pos` of its data is read at about
(k // workers) * F + pos, F the mean bytes a file reads, and a span's runs must lie within F of one another. A span
is fetched by the first file to need it (AHEAD spans ahead of each file's position) and let go once its last run was
taken. The spans fetched and still wanted stay under LIVE_BYTES: a file that would pass it fetches its run alone, and
the files to come theirs (memory stays bounded whatever the files' real pace or the checkpoint's width: an FSDP
save of 64 ranks read into one hf shard would keep a span of every rank file otherwise).

A file whose runs at write time are not those announced (a segment the store copies instead) gives its runs back at
once, and a file read out of its announced order gives back the rest (`close`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

from ckpt_cli.store.prefetch import AHEAD, GAP_BYTES, PIECE_BYTES, ByteRun, Fetched, _fetch, refuse_short, stream

LIVE_BYTES = 256 << 20  # spans fetched and still wanted, at most: every file's reads ahead, and spans kept for files to come


class _Span:
    __slots__ = ("url", "start", "end", "left", "data", "dropped", "streamed")

    def __init__(self, url: str, start: int, end: int) -> None:
        self.url, self.start, self.end = url, start, end
        self.left = 0  # runs not taken yet
        self.data: Future[Fetched] | None = None
        self.dropped = False  # a run of it was fetched alone (no room): the files to come fetch theirs alone
        self.streamed = end - start > 2 * PIECE_BYTES  # a long run alone, streamed in pieces by the file that reads it


class SharedReads:
    """The spans of one write's reads in object storage, and a reader for each output file (`reader`)."""

    def __init__(self, files: list[list[ByteRun]], workers: int) -> None:
        self.runs = files
        self.spans_of: list[list[_Span]] = [[] for _ in files]  # per file, the span of each of its runs
        self.live = 0  # bytes of the spans fetched and still wanted
        self.lock = threading.Lock()
        totals = [sum(n for _, _, n in runs) for runs in files]
        mean = max(1, sum(totals) // max(1, len(files)))
        by_object: dict[str, list[tuple[int, int, int, int, int]]] = {}  # url -> (offset, bytes, time, file, run)
        for k, runs in enumerate(files):
            pos = 0
            for i, (url, offset, nbytes) in enumerate(runs):
                by_object.setdefault(url, []).append((offset, nbytes, (k // max(1, workers)) * mean + pos, k, i))
                pos += nbytes
        refuse_short(run for runs in files for run in runs)
        where: dict[tuple[int, int], _Span] = {}  # (file, run) -> its span
        for url, located in by_object.items():
            located.sort()
            span, first = None, 0
            for offset, nbytes, time, k, i in located:
                joins = (
                    span is not None
                    and not span.streamed
                    and nbytes <= 2 * PIECE_BYTES
                    and span.end <= offset <= span.end + GAP_BYTES
                    and span.end - span.start < PIECE_BYTES
                    and offset + nbytes - span.start <= 2 * PIECE_BYTES
                    and abs(time - first) <= mean
                )
                if not joins:
                    span, first = _Span(url, offset, offset + nbytes), time
                assert span is not None
                span.end = max(span.end, offset + nbytes)
                span.left += 1
                where[k, i] = span
        for k, runs in enumerate(files):
            self.spans_of[k] = [where[k, i] for i in range(len(runs))]

    def reader(self, k: int, runs: list[ByteRun]) -> SharedReader | None:
        """File k's reader of `runs`: the runs announced for it, but for those the store copies instead (given back
        now). None when they are not (its runs are all given back)."""
        announced, kept = self.runs[k], list[int]()
        for i, run in enumerate(announced):
            if len(kept) < len(runs) and run == runs[len(kept)]:
                kept.append(i)
        reader = SharedReader(self, k, kept)
        for i in sorted(set(range(len(announced))) - set(kept)):
            self._taken(self.spans_of[k][i])
        if len(kept) < len(runs):
            reader.close()
            return None
        return reader

    def _want(self, span: _Span) -> Future[Fetched] | None:
        """The span's bytes, its fetch started now if no file started it; None when it is a long run streamed in pieces,
        was let go, or would take the fetched spans past LIVE_BYTES (the caller then fetches its own run alone, and the
        span is let go: no file fetches it whole after a run of it was read alone)."""
        with self.lock:
            if span.data is None and not span.dropped and not span.streamed:
                if self.live + span.end - span.start > LIVE_BYTES:
                    return None
                span.data = _fetch(span.url, span.start, span.end)
                self.live += span.end - span.start
            return span.data

    def _alone(self, span: _Span) -> None:
        """A run of the span was fetched alone: the files to come fetch theirs alone too."""
        with self.lock:
            if span.data is None:
                span.dropped = True

    def _taken(self, span: _Span) -> None:
        """A file took (or gave back) one of the span's runs; its bytes are let go once no file wants them."""
        with self.lock:
            span.left -= 1
            if span.left == 0 and span.data is not None:
                span.data = None
                self.live -= span.end - span.start


class SharedReader:
    """One output file's reads (Prefetch's interface): `take` serves the next announced run, or None for another."""

    def __init__(self, shared: SharedReads, k: int, kept: list[int]) -> None:
        self.shared = shared
        runs, spans = shared.runs[k], shared.spans_of[k]
        self.runs, self.spans = [runs[i] for i in kept], [spans[i] for i in kept]
        self.next = 0  # the index of the next run to take

    def take(self, url: str, offset: int, nbytes: int) -> Iterator[memoryview] | None:
        if not nbytes:
            return iter(())
        if self.next >= len(self.runs) or self.runs[self.next] != (url, offset, nbytes):
            return None
        i = self.next
        self.next += 1
        return self._serve(i)

    def _serve(self, i: int) -> Iterator[memoryview]:
        url, offset, nbytes = self.runs[i]
        span = self.spans[i]
        for ahead in self._upcoming(i):
            self.shared._want(ahead)
        try:
            if span.streamed:  # pieces of PIECE_BYTES, AHEAD in flight: never held whole
                for piece in stream(url, offset, nbytes):
                    yield memoryview(piece)
                return
            wanted = self.shared._want(span)
            if wanted is None:  # no room for the span: this run alone
                self.shared._alone(span)
            future, base = (wanted, span.start) if wanted is not None else (_fetch(url, offset, offset + nbytes), offset)
            data = future.result()
            yield memoryview(data)[offset - base : offset - base + nbytes]
        finally:
            self.shared._taken(span)

    def _upcoming(self, i: int) -> list[_Span]:
        """The next AHEAD spans this file reads after run i (distinct from its own)."""
        found: list[_Span] = []
        for span in self.spans[i + 1 : i + 1 + 64 * AHEAD]:
            if span is not self.spans[i] and not span.streamed and all(span is not s for s in found):
                found.append(span)
                if len(found) == AHEAD:
                    break
        return found

    def close(self) -> None:
        """Give back the runs not taken (read out of order, or not read at all)."""
        for i in range(self.next, len(self.runs)):
            self.shared._taken(self.spans[i])
        self.next = len(self.runs)
