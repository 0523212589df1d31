"""CRC32 arithmetic, and the check that every zip record a conversion copies still has its recorded CRC32.

A conversion reads a source record (a tensor's storage in a torch file, a DeepSpeed rank file, a DCP
chunk archive) whole or in pieces, in any order, over several threads. Each piece's CRC32 is computed
as its bytes pass on their way to the output (no second read); `RecordCheck` puts the pieces of a
record together with crc32_combine and compares the result with the CRC the archive records, as soon
as the pieces cover the record, or at the end after reading the parts nobody copied. A mismatch is a
DataError naming the file and the record, raised before the output is committed.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
import threading
import zlib
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckpt_cli import store
from ckpt_cli.core.pickles.zipio import Record
from ckpt_cli.errors import DataError

_POLY = 0xEDB88320  # CRC-32 (zlib), reflected
READ_BYTES = 4 << 20


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (zlib's multmodp, reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    """x^(2^n) modulo the polynomial, n = 0..31 (zlib's x2n_table)."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine in Python: crc1 times x^(8·len2), plus crc2."""
    if len2 <= 0:
        return crc1
    p, k, n = 1 << 31, 3, len2  # x^0; 8·len2 bits = len2 << 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _libz_combine() -> Callable[[int, int, int], int] | None:
    """zlib's own crc32_combine64 (Python's zlib module does not expose it), from the libz already loaded."""
    try:
        libz = ctypes.CDLL("libz.so.1")
        call = libz.crc32_combine64
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64]
    call.restype = ctypes.c_ulong
    return lambda crc1, crc2, len2: call(crc1, crc2, len2) if len2 > 0 else crc1


# crc32_combine(crc1, crc2, len2): CRC32 of A+B from crc32(A), crc32(B) and len(B) (zlib's, which Python's zlib lacks)
crc32_combine: Callable[[int, int, int], int] = _libz_combine() or _crc32_combine_py


def _libdeflate_crc32() -> Callable[[int, Any, int], int] | None:
    """libdeflate's crc32 (carry-less multiplication: 13.7 GB/s here, zlib 1.2's 2.6 GB/s), where the system has it."""
    try:
        call = ctypes.CDLL(ctypes.util.find_library("deflate") or "libdeflate.so.0").libdeflate_crc32
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    call.restype = ctypes.c_uint32
    return call


_FAST_CRC32 = _libdeflate_crc32()
FAST_CRC_BYTES = 64 << 10  # below this a foreign call costs more than it saves


def crc32(data: Any, crc: int = 0) -> int:
    """zlib.crc32(data, crc), through libdeflate for large buffers where it is installed (a conversion's CRCs were a fifth
    of its CPU time: benchmarks/beyond_ram.py). The GIL is released either way."""
    if _FAST_CRC32 is None or len(data) < FAST_CRC_BYTES:
        return zlib.crc32(data, crc)
    if isinstance(data, bytes):
        return _FAST_CRC32(crc, data, len(data))
    view = memoryview(data)
    if view.readonly or not view.c_contiguous:
        return zlib.crc32(view, crc)
    view = view.cast("B")
    return _FAST_CRC32(crc, ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view))


# A record read in more pieces than this is checked whole at once (read again), not piece by piece: a ZeRO-3 flat
# resharded from 1,024 ranks is read one element per parameter, and tracking each piece cost more than the copy.
SLIVERS = 64


@dataclass
class _Pieces:
    """The disjoint pieces of one record read so far: (offset, length, CRC32) sorted by offset."""

    parts: list[tuple[int, int, int]] = field(default_factory=list)
    covered: int = 0
    adds: int = 0


class RecordCheck:
    """Checks the CRC32 of the source records a write copies (the records of its plan's stored arrays).

    Shared by the threads of one write: `wants`, `add`, `whole` and `learn` may be called from any of them.
    """

    def __init__(self, records: Iterable[tuple[str, Record]] = ()) -> None:
        # Per path: (record starts, records) sorted by start, replaced as one tuple when records are learnt, so that
        # a thread looking one up never sees the two lists out of step. A record checked is let go: its slot holds
        # None (a reshard of 580,000 DCP chunks held every record and a set of their keys through the write: 250 MB).
        self._sorted: dict[str, tuple[list[int], list[Record | None]]] = {}
        self._pieces: dict[tuple[str, int], _Pieces] = {}
        self._done: dict[str, array] = {}  # per path, the starts of the records checked, sorted (let go from _sorted)
        self._outside: set[tuple[str, int]] = set()  # records checked by whole() that were never learnt
        self._lock = threading.Lock()
        self.learn(records)

    def learn(self, records: Iterable[tuple[str, Record]]) -> None:
        """Check these records too (a file whose segments are made only when it is written names its records then)."""
        new: dict[str, dict[int, Record]] = {}
        for path, rec in records:
            if rec.crc:  # 0: not recorded (torch.serialization.skip_data skeletons)
                new.setdefault(path, {})[rec.data_offset] = rec
        with self._lock:
            for path, recs in new.items():
                # The records checked (None) move to the path's sorted array of checked starts (8 bytes each, not an
                # int and two list slots: a reshard of 580,000 chunks checks as many). One learnt again stays checked.
                old_starts, old_records = self._sorted.get(path, ([], []))
                checked = [start for start, rec in zip(old_starts, old_records) if rec is None]
                done = self._done.get(path, _NONE_DONE)
                if checked:
                    done = self._done[path] = array("q", sorted([*done, *checked]))
                merged: dict[int, Record | None] = {start: rec for start, rec in zip(old_starts, old_records) if rec is not None}
                count = len(merged)
                merged.update((start, rec) for start, rec in recs.items() if start not in merged and not _holds(done, start))
                if len(merged) == count and not checked:
                    continue  # known already
                starts = sorted(merged)
                self._sorted[path] = (starts, [merged[start] for start in starts])

    def _record(self, path: str, offset: int, nbytes: int) -> Record | None:
        """The record still to be checked that holds bytes [offset, offset + nbytes) of `path` (None: no record, or
        one checked already)."""
        starts, records = self._sorted.get(path, ((), ()))
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0:
            return None
        rec = records[i]
        return rec if rec is not None and offset + nbytes <= rec.data_offset + rec.size else None

    def _checked(self, path: str, start: int) -> bool:
        """Whether the record starting at `start` was checked (its slot let go)."""
        starts, records = self._sorted.get(path, ((), ()))
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] == start and records[i] is None:
            return True
        return _holds(self._done.get(path, _NONE_DONE), start) or (path, start) in self._outside

    def wants(self, path: str, offset: int, nbytes: int) -> bool:
        """Whether these bytes belong to a record still to be checked (their CRC32 is then wanted)."""
        return self._record(path, offset, nbytes) is not None

    def add(self, path: str, offset: int, nbytes: int, crc: int) -> None:
        """Bytes [offset, offset + nbytes) of `path` were read and had CRC32 `crc`; check their record once covered."""
        rec = self._record(path, offset, nbytes)
        if rec is None or not nbytes:
            return
        key = (path, rec.data_offset)
        with self._lock:
            if self._checked(path, rec.data_offset):
                return
            if nbytes == rec.size:
                self._settle(path, rec, crc)
                return
            pieces = self._pieces.setdefault(key, _Pieces())
            i = bisect.bisect_right(pieces.parts, (offset, nbytes, crc))
            before_ends = i > 0 and pieces.parts[i - 1][0] + pieces.parts[i - 1][1] > offset
            after_starts = i < len(pieces.parts) and pieces.parts[i][0] < offset + nbytes
            if before_ends or after_starts:  # read twice (tied or replicated data): the piece kept covers these bytes
                return
            pieces.covered += nbytes
            pieces.adds += 1
            if pieces.adds > SLIVERS:  # read in slivers (1,024 ZeRO-3 ranks resharded): check it whole, once, now
                self._settle(path, rec, _read_crc(path, rec.data_offset, rec.size))
                return
            # Adjacent pieces are joined as they come (a record read in order stays one piece).
            if i > 0 and pieces.parts[i - 1][0] + pieces.parts[i - 1][1] == offset:
                prev = pieces.parts[i - 1]
                offset, nbytes, crc = prev[0], prev[1] + nbytes, crc32_combine(prev[2], crc, nbytes)
                i -= 1
                del pieces.parts[i]
            if i < len(pieces.parts) and pieces.parts[i][0] == offset + nbytes:
                after = pieces.parts.pop(i)
                nbytes, crc = nbytes + after[1], crc32_combine(crc, after[2], after[1])
            pieces.parts.insert(i, (offset, nbytes, crc))
            if pieces.covered == rec.size:
                self._settle(path, rec, self._joined(path, rec, pieces.parts))

    def whole(self, path: str, rec: Record) -> None:
        """Check a record by reading all of it (a stored array read another way, e.g. through a memory map)."""
        if not rec.crc or self._checked(path, rec.data_offset):
            return
        crc = _read_crc(path, rec.data_offset, rec.size)
        with self._lock:
            self._settle(path, rec, crc)

    def finish(self) -> None:
        """Check the records read only in part, reading the bytes no copy went through."""
        with self._lock:
            pending = list(self._pieces.items())
        for (path, start), pieces in pending:
            starts, records = self._sorted[path]
            rec = records[bisect.bisect_left(starts, start)]
            if rec is None:  # checked meanwhile
                continue
            crc = self._joined(path, rec, pieces.parts)
            with self._lock:
                self._settle(path, rec, crc)

    def _joined(self, path: str, rec: Record, parts: list[tuple[int, int, int]]) -> int:
        """The record's CRC32 from its pieces, reading the gaps between them."""
        crc, pos, end = 0, rec.data_offset, rec.data_offset + rec.size
        for offset, nbytes, piece_crc in [*parts, (end, 0, 0)]:
            if offset > pos:
                crc = crc32_combine(crc, _read_crc(path, pos, offset - pos), offset - pos)
            crc = crc32_combine(crc, piece_crc, nbytes)
            pos = offset + nbytes
        return crc

    def _settle(self, path: str, rec: Record, crc: int) -> None:
        """Compare (the lock held); a record is checked once, then let go."""
        key = (path, rec.data_offset)
        starts, records = self._sorted.get(path, ((), []))
        i = bisect.bisect_left(starts, rec.data_offset)
        if i < len(starts) and starts[i] == rec.data_offset:
            records[i] = None
        else:  # a record checked whole without being learnt (whole())
            self._outside.add(key)
        self._pieces.pop(key, None)
        if crc != rec.crc:
            raise DataError(
                f"{path}: record {rec.name} at byte {rec.data_offset} fails its CRC32 check (stored {rec.crc:08x}, read {crc:08x}): "
                "the file is damaged; nothing was converted"
            )


_NONE_DONE = array("q")


def _holds(starts: array, start: int) -> bool:
    """Whether the sorted array holds `start`."""
    i = bisect.bisect_left(starts, start)
    return i < len(starts) and starts[i] == start


def _read_crc(path: str, offset: int, nbytes: int) -> int:
    """CRC32 of bytes [offset, offset + nbytes) of `path`, read in blocks through the page cache (ranged GETs
    for an object in object storage)."""
    if not store.mappable(path):
        crc, buffer = 0, bytearray(min(nbytes, READ_BYTES))
        while nbytes:
            view = memoryview(buffer)[: min(nbytes, READ_BYTES)]
            store.read_into(path, offset, view)
            crc = crc32(view, crc)
            offset += len(view)
            nbytes -= len(view)
        return crc
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        crc = 0
        while nbytes:
            chunk = os.pread(fd, min(nbytes, READ_BYTES), offset)
            if not chunk:
                raise DataError(f"{path}: truncated: expected {nbytes} more bytes at offset {offset}, file ends first")
            crc = crc32(chunk, crc)
            offset += len(chunk)
            nbytes -= len(chunk)
        return crc
    finally:
        os.close(fd)
