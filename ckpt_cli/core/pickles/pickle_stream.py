"""How a pickle's bytes reach the C unpickler: through a read-ahead buffer, and for a large pickle in pieces that
are let go as they are read; a large pickle file's bytes are held once (`OwnCopy`)."""

from __future__ import annotations

import collections
import io
import mmap
from pathlib import Path
from typing import Any

from ckpt_cli.core import paths
from ckpt_cli.core.pickles import pickle_guard
from ckpt_cli.errors import DataError


def _buffered(data: bytes) -> io.BufferedReader:
    """`data` as a file the C unpickler reads ahead in: it calls `read` once per opcode on a file without `peek`
    (io.BytesIO), which made a 5 KB pickle take 0.2 ms instead of 0.03 (1,024 ZeRO optimizer files: 0.2 s)."""
    return io.BufferedReader(io.BytesIO(data), buffer_size=min(max(len(data), 1), 1 << 20))


class _LetGo(io.RawIOBase):
    """A large pickle's bytes in pieces, each let go once the unpickler has read it: the bytes and the value built
    from them are never both whole in memory (a 64-rank MoE `.metadata`: 100 MB of bytes beside 230 MB of records).
    The pieces are ckpt's own copy of the bytes the scan passed, not the file, which could change in between."""

    def __init__(self, data: bytes, piece: int = 1 << 20) -> None:
        self.pieces = collections.deque(data[i : i + piece] for i in range(0, len(data), piece))
        self.pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self.pieces and self.pos == len(self.pieces[0]):
            self.pieces.popleft()
            self.pos = 0
        if not self.pieces:
            return 0
        head = self.pieces[0]
        n = min(len(buffer), len(head) - self.pos)
        buffer[:n] = memoryview(head)[self.pos : self.pos + n]
        self.pos += n
        return n


def reader(data: bytes) -> io.BufferedReader:
    """What the unpickler reads `data` from: let go piece by piece when large, else in one buffer."""
    if len(data) < pickle_guard.LEAN_FROM:
        return _buffered(data)
    return io.BufferedReader(_LetGo(data), buffer_size=1 << 16)


HEADROOM = 1 << 16  # free bytes before an OwnCopy's pickle, for its rewrite in place (a replaced dict adds ~60)
_RELEASE = getattr(mmap, "MADV_DONTNEED", None)  # Linux and most Unix; elsewhere the pages stay until the load ends


class OwnCopy:
    """A large pickle file's bytes in ckpt's own anonymous memory (read once: the file could change between the scan
    and the load), scanned there, rewritten in place (pickle_guard.lean_in_place) and given to the unpickler from
    there, each megabyte's pages handed back to the system once read. A 111 MB `.metadata` was held twice at the
    start of its load, as the bytes read and as their rewrite."""

    def __init__(self, f: Any, size: int, where: str) -> None:
        # private: its pages are this process's own memory, and given back for good when released (shared anonymous
        # pages would stay in their shmem object)
        self.map = mmap.mmap(-1, HEADROOM + size, flags=mmap.MAP_PRIVATE)
        self.start, self.end = HEADROOM, HEADROOM + size
        pos = self.start
        while pos < self.end:
            chunk = f.read(min(1 << 20, self.end - pos))
            if not chunk:
                raise DataError(f"{where}: the file shrank while it was read")
            self.map[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        if f.read(1):
            raise DataError(f"{where}: the file grew while it was read")

    def __len__(self) -> int:
        return self.end - self.start

    def scan(self) -> bool:
        """pickle_guard.scan of the bytes."""
        with memoryview(self.map) as whole, whole[self.start : self.end] as data:
            return pickle_guard.scan(data)  # type: ignore[arg-type]  # a buffer: only with the C walk built (pickle_guard.in_place)

    def lean_stream(self, replacements: dict[bytes, bytes] | None) -> io.BufferedReader:
        """The bytes rewritten in place (or as they are, where the rewrite leaves them alone), as a stream."""
        written = pickle_guard.lean_in_place(self.map, HEADROOM, replacements)
        if written is not None:
            self.start, self.end = 0, written
        return io.BufferedReader(_Pages(self), buffer_size=1 << 16)

    def close(self) -> None:
        self.map.close()


class _Pages(io.RawIOBase):
    """An OwnCopy's bytes, its pages given back a megabyte at a time behind the reader."""

    def __init__(self, copy: OwnCopy) -> None:
        self.copy, self.pos, self.released = copy, copy.start, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.copy.end - self.pos)
        buffer[:n] = self.copy.map[self.pos : self.pos + n]
        self.pos += n
        done = self.pos - self.pos % mmap.PAGESIZE
        if _RELEASE is not None and done - self.released >= 1 << 20:
            self.copy.map.madvise(_RELEASE, self.released, done - self.released)
            self.released = done
        return n


def read_pickle_file(path: Path, where: str) -> bytes | OwnCopy:
    """A pickle file's bytes: an OwnCopy when large and the C rewrite is built (safe_pickle.safe_loads takes both)."""
    with paths.open_regular(path) as f:
        size = paths.file_size(f)
        if size < pickle_guard.LEAN_FROM or not pickle_guard.in_place() or not hasattr(mmap, "MAP_PRIVATE"):  # Windows
            return f.read()
        return OwnCopy(f, size, where)
