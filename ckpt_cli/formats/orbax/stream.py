"""Orbax's default arrays (zarr v2 chunks compressed with zstd, in an OCDBT database) decoded as a stream, a window of
rows at a time, so that reading one never holds a whole chunk.

tensorstore decodes a whole chunk for any read of it, holding its compressed bytes and the decoded chunk together, and
a save made on one host has one chunk per array (Orbax chunks by the devices' shards unless told otherwise): a 7B
model's MLP kernel is one 235 MB chunk, so a read of its first rows cost about 470 MB. A zarr v2 chunk is one zstd
frame of the chunk's C-order bytes (edge chunks padded to the full chunk shape; Orbax writes no filters). When a chunk
holds whole rows (its shape is the array's past the first axis), a window of rows is a byte range of that frame's
output: zstandard's stream reader decodes it from the data file's bytes the OCDBT B-tree points at (formats/orbax/ocdbt.py),
a buffer at a time, and a read that starts where the last one stopped goes on from there. Anything else (zarr3,
another codec, chunks split along other axes, a chunk stored inline in the B-tree, a missing one) is read by tensorstore.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_cli.errors import DataError
from ckpt_cli.formats.orbax import ocdbt

CURSORS = 4  # decoders kept per array: a DCP write reads each rank's rows of an array in order, from as many threads


def for_array(
    item: Path, name: str, doc: dict[str, Any], shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int
) -> ChunkStream | None:
    """A stream for the array when its chunks can be decoded as one, else None (tensorstore reads it)."""
    compressor = doc.get("compressor")
    if not (isinstance(compressor, dict) and compressor.get("id") == "zstd") or doc.get("filters") or doc.get("order", "C") != "C":
        return None
    if not shape or chunks[1:] != shape[1:] or chunks[0] < 1 or str(doc.get("dtype", "")).startswith(">"):
        return None
    if _zstandard() is None:
        return None
    separator = doc.get("dimension_separator") or "."
    return ChunkStream(item, name, shape, chunks[0], math.prod(shape[1:]) * itemsize, str(separator))


@functools.cache
def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError:  # the orbax extra brings it; without it every read goes through tensorstore
        return None
    return zstandard


@functools.lru_cache(maxsize=4)
def _values(item: Path) -> dict[str, ocdbt.Ref]:
    """Where each out-of-line value of the item's database lies (one walk of its B-tree)."""
    return {ref.key: ref for ref in ocdbt.references(item) if ref.key is not None}


class _Cursor:
    """A zstd frame being decoded: chunk `chunk`, `pos` bytes of its output given so far."""

    def __init__(self, chunk: int, file: BinaryIO, reader: Any) -> None:
        self.chunk, self.pos, self.file, self.reader = chunk, 0, file, reader

    def close(self) -> None:
        self.reader.close()
        self.file.close()


class _Bounded:
    """`length` bytes of a file from `offset`: what a decoder may read of it (one chunk's frame)."""

    def __init__(self, file: BinaryIO, offset: int, length: int) -> None:
        file.seek(offset)
        self.file, self.left = file, length

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.file.read(size)
        self.left -= len(data)
        return data


class ChunkStream:
    """The rows of one array, chunk frame by chunk frame (`read` of a flat byte range; None: read it another way)."""

    def __init__(self, item: Path, name: str, shape: tuple[int, ...], chunk_rows: int, row_bytes: int, separator: str) -> None:
        self.item, self.name, self.rows, self.chunk_rows, self.row_bytes = item, name, shape[0], chunk_rows, row_bytes
        self.tail = separator.join(["0"] * (len(shape) - 1))  # the chunk key's other indices: one chunk across
        self.separator = separator
        self.cursors: list[_Cursor] = []
        self.lock = threading.Lock()

    def chunk_bytes(self) -> int:
        return self.chunk_rows * self.row_bytes

    def read(self, start: int, nbytes: int) -> Any:
        """Bytes [start, start + nbytes) of the array (row-major), as a numpy uint8 array; None when a chunk they lie in
        is not a frame in a data file (inline, or absent)."""
        import numpy as np

        out = np.empty(nbytes, np.uint8)
        done, size = 0, self.chunk_bytes()
        while done < nbytes:
            chunk, offset = divmod(start + done, size)
            take = min(nbytes - done, size - offset)
            if not self._decode(chunk, offset, out[done : done + take]):
                return None
            done += take
        return out

    def _decode(self, chunk: int, offset: int, into: Any) -> bool:
        with self.lock:  # a cursor is taken out while it decodes: one thread at a time moves it
            cursor = max((c for c in self.cursors if c.chunk == chunk and c.pos <= offset), key=lambda c: c.pos, default=None)
            if cursor is not None:
                self.cursors.remove(cursor)
        if cursor is None:
            cursor = self._open(chunk)
            if cursor is None:
                return False
        try:
            if cursor.pos < offset:
                cursor.reader.seek(offset)  # decodes and drops what lies before (a zstd frame has no index)
            view, filled = memoryview(into).cast("B"), 0
            while filled < len(view):
                n = cursor.reader.readinto(view[filled:])
                if n == 0:
                    raise DataError(f"{self._where(chunk)}: array '{self.name}' chunk {chunk} ends before its {self.chunk_bytes()} bytes")
                filled += n
            cursor.pos = offset + filled
        except _zstandard().ZstdError as exc:
            cursor.close()
            raise DataError(f"{self._where(chunk)}: array '{self.name}' chunk {chunk} cannot be decoded ({exc})") from exc
        except BaseException:
            cursor.close()
            raise
        if cursor.pos >= self.chunk_bytes():  # the frame is done, and holds no more (tensorstore refuses a longer one)
            try:
                extra = cursor.reader.read(1)
            except _zstandard().ZstdError:
                extra = b"?"
            finally:
                cursor.close()
            if extra:
                where = f"{self._where(chunk)}: array '{self.name}' chunk {chunk}"
                raise DataError(f"{where} decodes to more than its {self.chunk_bytes()} bytes")
            return True
        with self.lock:
            self.cursors.append(cursor)
            while len(self.cursors) > CURSORS:
                self.cursors.pop(0).close()
        return True

    def _ref(self, chunk: int) -> ocdbt.Ref | None:
        """The OCDBT reference (file, offset, length) of a chunk's stored frame; None where the database has none."""
        return _values(self.item).get(f"{self.name}/{chunk}" + (self.separator + self.tail if self.tail else ""))

    def _open(self, chunk: int) -> _Cursor | None:
        ref = self._ref(chunk)
        if ref is None:
            return None
        path = self.item / ref.file
        try:
            file = path.open("rb")  # (closed with the cursor; an s3:// object is read by range)
        except OSError as exc:
            raise DataError(f"{path}: cannot open the OCDBT data file holding array '{self.name}' ({exc.strerror})") from exc
        if file.seek(0, 2) < ref.offset + ref.length:
            file.close()
            raise DataError(f"{path}: truncated: array '{self.name}' chunk {chunk} needs bytes up to {ref.offset + ref.length}")
        reader = _zstandard().ZstdDecompressor().stream_reader(_Bounded(file, ref.offset, ref.length), read_size=1 << 20)
        return _Cursor(chunk, file, reader)

    def _where(self, chunk: int) -> Path:
        ref = self._ref(chunk)
        return self.item / ref.file if ref is not None else self.item
