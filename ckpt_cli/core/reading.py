"""Read primitives: a tensor's elements or bytes, gathered from its stored pieces, with bounded memory.

Verify, the conversions and the write engine (core/write/executor.py) all read tensor data through these.
Contiguous pieces in the wanted dtype are read as raw bytes (no torch); anything else (a cast, a
strided piece) goes through torch one window of at most BLOCK_BYTES at a time. Only a stored piece
that is not contiguous (a transposed chunk) is materialised, one piece at a time. A source in object
storage (an `s3://` path) is read with ranged GETs (ckpt_cli.store) instead of pread.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from typing import Any

from ckpt_cli import store
from ckpt_cli.core.copies import map_file
from ckpt_cli.core.direct import DIRECT_BYTES, DirectReads, cached
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import ZEROS, StoredArray, TensorEntry
from ckpt_cli.core.paths import open_regular, open_regular_fd
from ckpt_cli.core.write.crc import RecordCheck, crc32
from ckpt_cli.errors import DataError
from ckpt_cli.store import prefetch as remote_read
from ckpt_cli.store.shared_reads import SharedReader

# 4 MiB stays in cache between the read, the CRC and the write; 32 MiB made the kernel's copy into
# the page cache 3-10x slower on a 2-core VM (benchmarks/run.py, perf: copy_folio_from_iter_atomic).
BLOCK_BYTES = 4 << 20
SMALL_READ_BYTES = 64 << 10  # reads up to this size go through a read-ahead window of their file
WINDOW_BYTES, WINDOW_BUDGET = 1 << 20, 16 << 20  # one file's window at most, all windows of one reader together


def remote_runs(runs: list[ByteRun]) -> list[ByteRun]:
    """The runs of `runs` in object storage (fetched ahead), in order."""
    return [r for r in runs if not store.mappable(r[0])]


class SourceFiles:
    """Open file descriptors of the sources, and the one materialised non-contiguous piece. With `check`
    (a write), the source zip records read here are checked against their CRC32."""

    def __init__(self, check: RecordCheck | None = None, window_budget: int | None = None) -> None:
        self.check = check
        # All its windows together: WINDOW_BUDGET, or less (diff's two readers share one budget).
        self.window_budget = WINDOW_BUDGET if window_budget is None else window_budget
        self.fds: dict[str, int] = {}
        self._buffer: bytearray | None = None
        self._materialised: tuple[StoredArray, Any] | None = None
        self._prefetch: remote_read.Prefetch | SharedReader | None = None
        self._windows: dict[str, tuple[int, bytes]] = {}  # path -> (offset, bytes read ahead there), oldest first
        self._window_bytes = 0
        self._maps: dict[str, tuple[Any, Any]] = {}  # path -> (memory map, its bytes as numpy): planned gathers
        # A write's large reads go through the page cache and leave it as they found it (`passing`); past it on request
        # (CKPT_DIRECT_READS=1: core/direct.py)
        direct = check is not None and os.environ.get("CKPT_DIRECT_READS", "0") == "1"
        self._direct = DirectReads(BLOCK_BYTES, self.fd) if direct else None
        self._passing: dict[str, bool] = {}  # path -> whether its large reads leave the page cache (`passing`)

    def fd(self, path: str) -> int:
        if path not in self.fds:
            try:
                self.fds[path] = open_regular_fd(path)
            except OSError as exc:
                raise DataError(f"{path}: cannot open ({exc.strerror})") from exc
        return self.fds[path]

    def passing(self, path: str, offset: int, nbytes: int) -> bool:
        """Whether a write's read of these bytes is to leave the page cache once used (`let_go`): a large run of a local
        file that the cache did not hold whole when the write first read it (asked once a file: the kernel's read-ahead
        brings in the next run before it is asked for). Read once, its pages would only push out what the machine
        keeps, and under a memory limit smaller than the checkpoint every new page waits for one to be reclaimed (8 GB
        hf -> DCP under 1 GB: 1.05x `cp -r` + `sync` kept, 0.99x let go)."""
        if self.check is None or self._direct is not None or nbytes < DIRECT_BYTES or path == ZEROS or not store.mappable(path):
            return False
        if not hasattr(os, "posix_fadvise"):  # (macOS)
            return False
        if path not in self._passing:
            fd = self.fd(path)
            self._passing[path] = not cached(fd, 0, os.fstat(fd).st_size)
        return self._passing[path]

    def let_go(self, path: str, offset: int, nbytes: int) -> None:
        """Drop these bytes' pages from the page cache (clean pages: nothing is written)."""
        os.posix_fadvise(self.fd(path), offset, nbytes, os.POSIX_FADV_DONTNEED)

    def direct(self, path: str, nbytes: int) -> bool:
        """Whether a write reads this run of a local file past the page cache (core/direct.py)."""
        return self._direct is not None and path != ZEROS and store.mappable(path) and self._direct.wants(path, nbytes)

    def mapped(self, path: str) -> Any:
        """The file's bytes as a numpy uint8 array over a read-only memory map, kept until close (a gather of
        slivers from it touches only their pages: core/copies.py)."""
        if path not in self._maps:
            self._maps[path] = map_file(self.fd(path))
        return self._maps[path][1]

    def close(self) -> None:
        while self._maps:
            _, (mm, data) = self._maps.popitem()
            del data  # the numpy view first: a map with views of it cannot close
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view still held (an exception's frame): closed when collected
                    pass
        if self._direct is not None:  # first: its helper thread may be reading through self.fds
            self._direct.close()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self._windows.clear()
        self._window_bytes = 0
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None

    def expect(self, runs: list[ByteRun]) -> None:
        """The byte runs this reader will read next, in order: those in object storage are fetched ahead, a write's
        large local ones read ahead past the page cache (core/direct.py)."""
        if self._direct is not None:
            self._direct.expect(
                (path, offset + at, n)
                for path, offset, nbytes in runs
                if nbytes >= DIRECT_BYTES and store.mappable(path) and path != ZEROS
                for at in range(0, nbytes, BLOCK_BYTES)
                if self._direct.wants(path, n := min(BLOCK_BYTES, nbytes - at))
            )
        remote = remote_runs(runs)
        if self._prefetch is not None:
            self._prefetch.close()
        self._prefetch = remote_read.Prefetch(remote) if remote else None

    def share(self, reader: remote_read.Prefetch | SharedReader) -> None:
        """Serve the runs in object storage through `reader` (store/shared_reads.py: spans fetched once for the files
        of one write), as `expect` would through a Prefetch of its own."""
        if self._prefetch is not None:
            self._prefetch.close()
        self._prefetch = reader

    def remote(self, path: str, offset: int, nbytes: int) -> Iterator[memoryview]:
        """Bytes of an object: from the prefetched runs when this is the next one expected, else streamed."""
        if self._prefetch is not None:
            got = self._prefetch.take(path, offset, nbytes)
            if got is not None:
                return got
            self._prefetch.close()  # read out of the announced order: stop fetching ahead
            self._prefetch = None
        return map(memoryview, remote_read.stream(path, offset, nbytes))

    def pread_into(self, path: str, offset: int, buf: bytearray | memoryview) -> None:
        """Fill `buf` with the bytes of `path` from `offset`; DataError if the file ends first."""
        self._pread(path, offset, memoryview(buf))

    def _pread(self, path: str, offset: int, view: memoryview) -> None:
        if not store.mappable(path):
            store.read_into(path, offset, view)
            return
        if len(view) <= SMALL_READ_BYTES and self._from_window(path, offset, view):
            return
        got = 0
        while got < len(view):
            n = os.preadv(self.fd(path), [view[got:]], offset + got)
            if n == 0:
                raise DataError(f"{path}: truncated: expected {len(view)} bytes at offset {offset}, file ends first")
            got += n

    def _from_window(self, path: str, offset: int, view: memoryview) -> bool:
        """A small read served from a window read ahead in `path` (one window a file: a wide checkpoint's tensor
        gathers a few elements from each of hundreds of rank files, and the next tensor's lie right after them).
        The windows share the reader's budget: more files get smaller windows, and the least recently refilled go when a
        new one would pass it (sized once each, 1,024 rank files' windows had reached 240 MB). False at the end of
        the file."""
        start, data = self._windows.get(path, (0, b""))
        if not start <= offset or offset + len(view) > start + len(data):
            size = max(len(view), min(WINDOW_BYTES, self.window_budget // max(1, len(self.fds))))
            self._drop_window(path)
            while self._windows and self._window_bytes + size > self.window_budget:
                self._drop_window(next(iter(self._windows)))
            start, data = offset, os.pread(self.fd(path), size, offset)
            self._windows[path] = (start, data)
            self._window_bytes += len(data)
            if offset + len(view) > start + len(data):
                return False
        view[:] = data[offset - start : offset - start + len(view)]
        return True

    def _drop_window(self, path: str) -> None:
        dropped = self._windows.pop(path, None)
        if dropped is not None:
            self._window_bytes -= len(dropped[1])

    def read_block(self, path: str, offset: int, nbytes: int) -> memoryview:
        """Bytes of `path` in a buffer reused from call to call (nbytes <= BLOCK_BYTES)."""
        if path != ZEROS and self._direct is not None and store.mappable(path) and self._direct.wants(path, nbytes):
            return self._direct.read(path, offset, nbytes)  # a view of its own buffers
        if self._buffer is None:
            self._buffer = bytearray(BLOCK_BYTES)
        view = memoryview(self._buffer)[:nbytes]
        if path == ZEROS:
            view[:] = bytes(nbytes)
        else:
            self._pread(path, offset, view)
        return view

    def materialised(self, array: StoredArray) -> Any:
        """The elements of a non-contiguous stored array as a flat contiguous torch tensor."""
        if self._materialised is None or self._materialised[0] != array:
            self._materialised = None
            if self.check is not None and array.record is not None:
                self.check.whole(array.path, array.record)
            self._materialised = (array, materialise(array))
        return self._materialised[1]


def materialise(array: StoredArray) -> Any:
    """Read a strided stored array through a private memory map into a flat contiguous tensor."""
    import torch

    start, end = array.extent()
    base = array.offset
    if not store.mappable(array.path):  # the stored extent, fetched (a memory map needs a local file)
        raw = bytearray(end - base)
        store.read_into(array.path, base, memoryview(raw))
        flat = torch.frombuffer(raw, dtype=array.dtype.torch(), count=len(raw) // array.dtype.itemsize)
        return flat.as_strided(array.shape, array.stride, array.storage_offset).contiguous().reshape(-1)
    with open_regular(array.path) as f:
        size = os.fstat(f.fileno()).st_size
        if end > size:
            raise DataError(f"{array.path}: truncated: data needs bytes up to {end}, file has {size}")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    storage_elems = (end - base) // array.dtype.itemsize
    flat = torch.frombuffer(mm, dtype=array.dtype.torch(), count=storage_elems, offset=base)
    view = flat.as_strided(array.shape, array.stride, array.storage_offset)
    return view.contiguous().reshape(-1)


def read_stored(array: StoredArray, start: int, count: int, sources: SourceFiles) -> Any:
    """Elements [start, start+count) of a stored array (row-major order) as a 1-d torch tensor."""
    import torch

    if count == 0:
        return torch.empty(0, dtype=array.dtype.torch())
    if array.path == ZEROS:
        return torch.zeros(count, dtype=array.dtype.torch())
    if not array.is_contiguous:
        return sources.materialised(array)[start : start + count]
    itemsize = array.dtype.itemsize
    raw = bytearray(count * itemsize)
    offset = array.offset + (array.storage_offset + start) * itemsize
    sources.pread_into(array.path, offset, raw)
    if sources.check is not None and sources.check.wants(array.path, offset, len(raw)):
        sources.check.add(array.path, offset, len(raw), crc32(raw))
    return torch.frombuffer(raw, dtype=array.dtype.torch())


def read_elements(entry: TensorEntry, start: int, count: int, sources: SourceFiles) -> Any:
    """Elements [start, start+count) of a logical tensor, gathered from its pieces, as its dtype."""
    if entry.derived is not None:  # before importing torch: a computed tensor may be made without it (GGUF's)
        return entry.derived.read(start, count, sources)
    import torch

    out = torch.empty(count, dtype=entry.dtype.torch())
    filled = 0
    for gstart, length, piece, lstart in entry.runs_in(start, count):
        lo, hi = max(gstart, start), min(gstart + length, start + count)
        if lo < hi:
            out[lo - start : hi - start] = read_stored(piece.data, lstart + lo - gstart, hi - lo, sources)
            filled += hi - lo
    if filled != count:
        raise DataError(f"{entry.name}: {entry.tiling_problem() or 'pieces do not cover the tensor'}")
    return out


def equal_values(a: TensorEntry, b: TensorEntry, sources: SourceFiles) -> bool:
    """Same shape, dtype and bytes. The first elements are compared first, so unrelated tensors of one shape cost a
    few KB; the rest window by window."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False

    def same(start: int, count: int) -> bool:
        left, right = read_elements(a, start, count, sources), read_elements(b, start, count, sources)
        return torch.equal(left.view(torch.uint8), right.view(torch.uint8))

    return same(0, min(a.numel, 1024)) and all(same(start, n) for start, n in element_windows(a))


def element_windows(entry: TensorEntry, itemsize: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, count) windows of at most BLOCK_BYTES that walk a tensor in order (a computed tensor's own)."""
    if entry.derived is not None:
        yield from entry.derived.windows()
        return
    step = max(BLOCK_BYTES // (itemsize or entry.dtype.itemsize), 1)
    for start in range(0, entry.numel, step):
        yield start, min(step, entry.numel - start)


def tensor_bytes(entry: TensorEntry, sources: SourceFiles) -> Iterator[Any]:
    """The tensor's elements as little-endian bytes in row-major order, block by block.

    Contiguous pieces already in the tensor's dtype are read as bytes (no torch); anything else is
    gathered through torch one window at a time. Buffers are reused: consume each before the next.
    """
    runs = byte_runs(entry, entry.dtype)
    if runs is None:
        for start, count in element_windows(entry):
            yield window_bytes(entry, entry.dtype, start, count, sources)
        return
    yield from read_runs(runs, sources)


def window_bytes(entry: TensorEntry, dst: DType, start: int, count: int, sources: SourceFiles) -> Any:
    """Elements [start, start + count) as `dst`'s bytes (a numpy uint8 array): cast through torch, or, with no cast, as a
    computed tensor gives them without torch: its `derived.read_raw` (an Orbax array, a box of one: their bytes) or a
    numpy window from its `read` (GGUF's quantized tensors: formats/gguf/writer.py), and a stored one as its byte
    ranges. torch is ~225 MB resident alone."""
    raw = getattr(entry.derived, "read_raw", None)
    if raw is not None and dst == entry.dtype:
        return raw(start, count, sources)
    runs = byte_runs_in(entry, dst, start, count) if entry.derived is None and dst == entry.dtype else None
    if runs is not None:  # stored bytes as they are: read into one numpy buffer
        import numpy as np

        out: Any = np.empty(count * dst.itemsize, np.uint8)
        read_runs_into(runs, memoryview(out), sources)
        return out
    values = read_elements(entry, start, count, sources)
    if type(values).__module__ == "numpy":  # (numpy itself is imported only by what made it)
        import numpy as np

        assert entry.dtype == dst, f"{entry.name}: a computed tensor's numpy window is in its own dtype"
        return values.view(np.uint8)
    return as_bytes(values.to(dst.torch()))


def as_bytes(tensor: Any) -> Any:
    import torch

    return tensor.contiguous().view(torch.uint8).numpy()


def _check_tiling(entry: TensorEntry, runs: list[tuple[int, int, Any, int]]) -> None:
    pos = 0
    for start, length, _, _ in runs:
        if start != pos:
            break
        pos += length
    if pos != entry.numel or len(runs) and runs[-1][0] + runs[-1][1] != entry.numel:
        raise DataError(f"{entry.name}: {entry.tiling_problem() or 'pieces do not cover the tensor'}")


ByteRun = tuple[str, int, int]  # (source path, byte offset, byte count)


def byte_runs(entry: TensorEntry, dst: DType) -> list[ByteRun] | None:
    """The stored bytes that make up the tensor as `dst`, in order; None when a cast, a strided piece or a computed
    tensor needs torch."""
    if entry.derived is not None:
        return None
    runs = entry.runs()
    _check_tiling(entry, runs)
    if not all(p.data.dtype == dst and p.data.is_contiguous for _, _, p, _ in runs):
        return None
    return [
        (p.data.path, p.data.offset + (p.data.storage_offset + lstart) * dst.itemsize, length * dst.itemsize)
        for _, length, p, lstart in runs
    ]


def byte_runs_in(entry: TensorEntry, dst: DType, start: int, count: int) -> list[ByteRun] | None:
    """byte_runs of elements [start, start + count) alone (a tensor whose pieces are made by range)."""
    if entry.derived is not None:
        return None
    runs, pos, out = entry.runs_in(start, count), start, []
    for gstart, length, piece, lstart in runs:
        lo, hi = max(gstart, start), min(gstart + length, start + count)
        if lo != pos or piece.data.dtype != dst or not piece.data.is_contiguous:
            if lo != pos:
                raise DataError(f"{entry.name}: {entry.tiling_problem() or 'pieces do not cover the tensor'}")
            return None
        offset = piece.data.offset + (piece.data.storage_offset + lstart + lo - gstart) * dst.itemsize
        out.append((piece.data.path, offset, (hi - lo) * dst.itemsize))
        pos = hi
    if pos != start + count:
        raise DataError(f"{entry.name}: {entry.tiling_problem() or 'pieces do not cover the tensor'}")
    return out


def read_runs_into(runs: list[ByteRun], buf: memoryview, sources: SourceFiles) -> None:
    """The runs' bytes one after the other into `buf`, each source zip record's CRC32 learnt as read_stored learns it."""
    pos = 0
    for path, offset, nbytes in runs:
        part = buf[pos : pos + nbytes]
        sources.pread_into(path, offset, part)
        if sources.check is not None and sources.check.wants(path, offset, nbytes):
            sources.check.add(path, offset, nbytes, crc32(part))
        pos += nbytes


def read_runs(runs: list[ByteRun], sources: SourceFiles) -> Iterator[memoryview]:
    """The runs' bytes, a block at a time, in the reused buffer: consume each block before the next. From object
    storage, in the pieces of parallel ranged GETs fetched ahead (store/prefetch.py)."""
    for path, offset, nbytes in runs:
        if not store.mappable(path):
            yield from sources.remote(path, offset, nbytes)
            continue
        while nbytes:
            count = min(nbytes, BLOCK_BYTES)
            passing = sources.passing(path, offset, count)
            yield sources.read_block(path, offset, count)
            if passing:
                sources.let_go(path, offset, count)
            offset += count
            nbytes -= count
