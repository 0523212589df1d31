"""Where an output file's bytes go, and how tensor data gets there.

A local file takes positional writes (FileSink: threads may fill different ranges of one file; small writes gathered
into blocks); an object in object storage takes them in order (a store write's File). Same-dtype contiguous
data moves with copy_file_range (in the kernel, no user-space copy) unless a CRC is wanted, for the output's zip
record or to check the source record it comes from (core/write/crc.py), or the run is read past the page cache
(core/direct.py: 1 MiB and more of a local file); anything that needs a cast goes through torch, one window at a time.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ckpt_cli import store
from ckpt_cli.core.copies import Copies, PlannedFlat, gather
from ckpt_cli.core.model import ZEROS, LazyPieces
from ckpt_cli.core.reading import (
    BLOCK_BYTES,
    ByteRun,
    SourceFiles,
    byte_runs,
    byte_runs_in,
    element_windows,
    read_runs,
    window_bytes,
)
from ckpt_cli.core.write.crc import crc32, crc32_combine
from ckpt_cli.core.write.plan import Literal, Segment, TensorData
from ckpt_cli.errors import DataError

COPY_BYTES = 64 << 20  # one copy_file_range call
SMALL_WRITE = 1 << 20  # a buffered FileSink gathers writes smaller than this
SPAN_ELEMENTS = 1 << 20  # a tensor made by range is streamed at most this many elements at a time
SPAN_PIECES = 1 << 14  # and about this many pieces (a piece and its runs: ~400 bytes)
FIRST_SPAN = 1 << 16  # elements: the first span, before its pieces tell the size of the next
WRITEBACK_BYTES = 64 << 20
Progress = Callable[[int], None]
Sink = Any  # FileSink (a local file, positional writes) or a store.File without a descriptor (an object, in order)


def _sync_file_range() -> Callable[[int], None]:
    """`sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`: start writing a file's dirty pages back, without
    waiting (Linux; Python's os module lacks it). A no-op where libc does not have it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
        call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    except (OSError, AttributeError):
        return lambda fd: None
    return lambda fd: call(fd, 0, 0, 2)


start_writeback = _sync_file_range()


def advancer(fd: int, progress: Progress | None) -> Progress:
    """What each block written calls: starts writeback every WRITEBACK_BYTES, then reports progress."""
    lock = threading.Lock()
    pending = 0

    def advance(nbytes: int) -> None:
        nonlocal pending
        with lock:
            pending += nbytes
            flush = pending >= WRITEBACK_BYTES
            if flush:
                pending = 0
        if flush:  # let the disk work while we produce the next bytes
            start_writeback(fd)
        if progress:
            progress(nbytes)

    return advance


class FileSink:
    """Positional writes into one output file from `offset` on (threads may fill other ranges of it). `buffered`:
    small writes are gathered into blocks of BLOCK_BYTES (a DCP rank file is thousands of small archives); a write of
    SMALL_WRITE or more goes out as it is (gathered, each block of a large tensor was copied once more, and the buffer
    grew to two blocks)."""

    def __init__(self, fd: int, offset: int, progress: Progress | None, buffered: bool = False) -> None:
        self.fd, self.offset, self.progress = fd, offset, progress
        self.buffer = bytearray() if buffered else None

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self.buffer is not None and len(view) < SMALL_WRITE:
            self.buffer += view
            if len(self.buffer) >= BLOCK_BYTES:
                self.flush()
            return
        self.flush()
        self._pwrite(view)

    def flush(self) -> None:
        if self.buffer:
            data, self.buffer = self.buffer, bytearray()
            self._pwrite(memoryview(data))

    def _pwrite(self, view: memoryview) -> None:
        while view:
            n = os.pwrite(self.fd, view, self.offset)
            view = view[n:]
            self.offset += n
            if self.progress:
                self.progress(n)

    def copy(self, src_fd: int, offset: int, nbytes: int, path: str) -> None:
        """`nbytes` of a source from `offset`, in the kernel (copy_file_range) where it can."""
        self.flush()
        while nbytes:
            try:
                n = os.copy_file_range(src_fd, self.fd, min(nbytes, COPY_BYTES), offset, self.offset)
            except OSError:
                n = -1
            if n < 0:  # not supported here (other filesystems): fall back to read/write
                chunk = os.pread(src_fd, min(nbytes, BLOCK_BYTES), offset)
                if not chunk:
                    raise DataError(f"{path}: truncated at offset {offset}")
                self.write(chunk)
                n = len(chunk)
            elif n == 0:
                raise DataError(f"{path}: truncated: expected {nbytes} more bytes at offset {offset}")
            else:
                self.offset += n
                if self.progress:
                    self.progress(n)
            offset += n
            nbytes -= n


def copy_runs(runs: list[ByteRun], out: Sink, sources: SourceFiles, with_crc: bool) -> int:
    """Copy byte runs to `out`: in the kernel when no CRC is wanted (by the output, or to check the source record
    they come from), both ends are local files and the run is not one read past the page cache (core/direct.py: one copy
    as well, and nothing for the memory cgroup to reclaim), else through the reusable buffer. Returns the CRC32 of all
    runs (0 when not wanted); each run's own CRC32 goes to the source check."""
    crc, first = 0, True
    check = sources.check
    for path, offset, nbytes in runs:
        checked = check is not None and check.wants(path, offset, nbytes)
        local = path != ZEROS and isinstance(out, FileSink) and store.mappable(path)
        if not with_crc and not checked and local and not sources.direct(path, nbytes):
            passing = sources.passing(path, offset, nbytes)
            out.copy(sources.fd(path), offset, nbytes, path)
            if passing:
                sources.let_go(path, offset, nbytes)
            continue
        run_crc = 0
        for view in read_runs([(path, offset, nbytes)], sources):
            if with_crc or checked:
                run_crc = crc32(view, run_crc)
            out.write(view)
        if checked and check is not None:  # (checked implies it: the checker cannot tell)
            check.add(path, offset, nbytes, run_crc)
        if with_crc:  # a tensor of one run (most DCP chunks) needs no combining
            crc = run_crc if first else crc32_combine(crc, run_crc, nbytes)
            first = False
    return crc


def stream_tensor(seg: TensorData, out: Sink, sources: SourceFiles) -> int:
    """Write the tensor's elements in order; return their CRC32 (0 when not asked for).

    Stored bytes that are already what the output needs are copied as bytes; anything else (casts,
    strided pieces) goes through torch, one window at a time.
    """
    if not seg.tensor.numel:  # nothing to write (a ZeRO-3 model-states file's 2,000 placeholders): CRC32 of no bytes
        return 0
    if seg.tensor.made_by_range():
        return _stream_by_range(seg, out, sources)
    runs = byte_runs(seg.tensor, seg.dtype)
    if runs is None:
        return _stream_converted(seg, out, sources)
    return copy_runs(runs, out, sources, seg.crc_key is not None)


def _stream_by_range(seg: TensorData, out: Sink, sources: SourceFiles) -> int:
    """A tensor whose pieces are made for the range asked (core/model.LazyPieces), up to SPAN_ELEMENTS at a time
    and about SPAN_PIECES pieces: each span is sized from the last one's pieces. A ZeRO-3 partition gathered from
    64 ranks' 1-element slices of 64-element experts made a piece per element, 164,000 a span (+200 MB)."""
    entry, dst, crc = seg.tensor, seg.dtype, 0
    start, span = 0, FIRST_SPAN
    while start < entry.numel:
        count = min(span, entry.numel - start)
        layout = entry.pieces.layout if isinstance(entry.pieces, LazyPieces) else None
        copies = layout.copies(start, count) if isinstance(layout, PlannedFlat) and dst == entry.dtype else None
        if copies is not None and copies.gathered() and all(store.mappable(p) for p in copies.paths):
            part = _copy_gathered(copies, out, sources, seg.crc_key is not None)
            span = min(SPAN_ELEMENTS, max(1, count * SPAN_PIECES // max(1, len(copies.nbytes))))
            if seg.crc_key is not None:
                crc = part if not start else crc32_combine(crc, part, count * dst.itemsize)
            start += count
            continue
        runs = copies.byte_runs() if copies is not None else byte_runs_in(entry, dst, start, count)
        if runs is None:  # a cast, read through torch: its pieces are not counted and the span keeps its size
            data = window_bytes(entry, dst, start, count, sources)
            part = crc32(data) if seg.crc_key is not None else 0
            out.write(data)
        else:
            part = copy_runs(runs, out, sources, seg.crc_key is not None)
            span = min(SPAN_ELEMENTS, max(1, count * SPAN_PIECES // max(1, len(runs))))
        if seg.crc_key is not None:
            crc = part if not start else crc32_combine(crc, part, count * dst.itemsize)
        start += count
    return crc


def _copy_gathered(copies: Copies, out: Sink, sources: SourceFiles, with_crc: bool) -> int:
    """A window of small copies gathered by numpy from memory maps of their files (core/copies.py), written at once.
    The source records they come from are checked whole, once (read in slivers, a record is checked so anyway)."""
    if sources.check is not None:
        for array in copies.arrays:
            if array.record is not None:
                sources.check.whole(array.path, array.record)
    data = gather(copies, sources.mapped)
    out.write(data)
    return crc32(data) if with_crc else 0


def _stream_converted(seg: TensorData, out: Sink, sources: SourceFiles) -> int:
    entry, dst = seg.tensor, seg.dtype
    crc = 0
    for start, count in element_windows(entry, max(dst.itemsize, entry.dtype.itemsize)):
        data = window_bytes(entry, dst, start, count, sources)
        if seg.crc_key is not None:
            crc = crc32(data, crc)
        out.write(data)
        del data  # before the next window is read: a window may be a whole decoded chunk (an Orbax array's, ~46 MB)
    return crc


def split_runs(runs: list[ByteRun], size: int) -> list[list[ByteRun]]:
    """Consecutive pieces of about `size` bytes (a run may be cut in two), for threads to copy at once."""
    chunks: list[list[ByteRun]] = [[]]
    room = size
    for path, offset, nbytes in runs:
        while nbytes:
            take = min(nbytes, room)
            chunks[-1].append((path, offset, take))
            offset, nbytes, room = offset + take, nbytes - take, room - take
            if not room:
                chunks.append([])
                room = size
    return [c for c in chunks if c]


def write_segments(segments: list[Segment], sink: Sink, sources: SourceFiles) -> None:
    """A file's bytes in order: CRC-dependent trailers (Deferred) follow the data they cover."""
    crcs: dict[str, int] = {}
    for seg in segments:
        if isinstance(seg, Literal):
            sink.write(seg.data)
        elif isinstance(seg, TensorData):
            crc = stream_tensor(seg, sink, sources)
            if seg.crc_key is not None:
                crcs[seg.crc_key] = crc
        else:
            data = seg.build(crcs)
            assert len(data) == seg.size, "deferred segment size differs from its plan"
            sink.write(data)
