"""The streaming executor: carries out a WritePlan with a bounded amount of tensor data in memory.

Same-dtype contiguous data moves with copy_file_range (in the kernel, no user-space copy); data
that needs a CRC or a cast goes through one reusable buffer of BLOCK_BYTES. Only a stored piece
that is not contiguous (a transposed chunk) is materialised, one piece at a time. Writeback to
disk starts every WRITEBACK_BYTES, so the final fsync finds little left to flush.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt_cli.core.atomic import staged
from ckpt_cli.core.model import ZEROS, StoredArray, TensorEntry
from ckpt_cli.core.plan import Deferred, Literal, OutputFile, TensorData, WritePlan
from ckpt_cli.errors import DataError

# 4 MiB stays in cache between the read, the CRC and the write; 32 MiB made the kernel's copy into
# the page cache 3-10x slower on a 2-core VM (benchmarks/run.py, perf: copy_folio_from_iter_atomic).
BLOCK_BYTES = 4 << 20
COPY_BYTES = 64 << 20  # one copy_file_range call
WRITEBACK_BYTES = 64 << 20
Progress = Callable[[int], None]


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


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


class SourceFiles:
    """Open file descriptors of the sources, and the one materialised non-contiguous piece."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self._buffer: bytearray | None = None
        self._materialised: tuple[StoredArray, Any] | None = None

    def fd(self, path: str) -> int:
        if path not in self.fds:
            try:
                self.fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise DataError(f"{path}: cannot open ({exc.strerror})") from exc
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def pread_into(self, path: str, offset: int, buf: bytearray) -> None:
        """Fill `buf` with the bytes of `path` from `offset`; DataError if the file ends first."""
        self._pread(path, offset, memoryview(buf))

    def _pread(self, path: str, offset: int, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self.fd(path), [view[got:]], offset + got)
            if n == 0:
                raise DataError(f"{path}: truncated: expected {len(view)} bytes at offset {offset}, file ends first")
            got += n

    def read_block(self, path: str, offset: int, nbytes: int) -> memoryview:
        """Bytes of `path` in a buffer reused from call to call (nbytes <= BLOCK_BYTES)."""
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
            self._materialised = (array, materialise(array))
        return self._materialised[1]


def materialise(array: StoredArray) -> Any:
    """Read a strided stored array through a private memory map into a flat contiguous tensor."""
    import torch

    start, end = array.extent()
    base = array.offset
    with open(array.path, "rb") as f:
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
    sources.pread_into(array.path, array.offset + (array.storage_offset + start) * itemsize, raw)
    return torch.frombuffer(raw, dtype=array.dtype.torch())


def read_elements(entry: TensorEntry, start: int, count: int, sources: SourceFiles) -> Any:
    """Elements [start, start+count) of a logical tensor, gathered from its pieces, as its dtype."""
    import torch

    out = torch.empty(count, dtype=entry.dtype.torch())
    filled = 0
    for gstart, length, piece, lstart in entry.runs():
        lo, hi = max(gstart, start), min(gstart + length, start + count)
        if lo < hi:
            out[lo - start : hi - start] = read_stored(piece.data, lstart + lo - gstart, hi - lo, sources)
            filled += hi - lo
    if filled != count:
        raise DataError(f"{entry.name}: {entry.tiling_problem() or 'pieces do not cover the tensor'}")
    return out


def element_windows(entry: TensorEntry, itemsize: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, count) windows of at most BLOCK_BYTES that walk a tensor in order."""
    step = max(BLOCK_BYTES // (itemsize or entry.dtype.itemsize), 1)
    for start in range(0, entry.numel, step):
        yield start, min(step, entry.numel - start)


def tensor_bytes(entry: TensorEntry, sources: SourceFiles) -> Iterator[Any]:
    """The tensor's elements as little-endian bytes in row-major order, block by block.

    Contiguous pieces already in the tensor's dtype are read as bytes (no torch); anything else is
    gathered through torch one window at a time. Buffers are reused: consume each before the next.
    """
    runs = entry.runs()
    _check_tiling(entry, runs)
    if not all(p.data.dtype == entry.dtype and p.data.is_contiguous for _, _, p, _ in runs):
        for start, count in element_windows(entry):
            yield as_bytes(read_elements(entry, start, count, sources))
        return
    for _, length, piece, lstart in runs:
        array = piece.data
        offset = array.offset + (array.storage_offset + lstart) * entry.dtype.itemsize
        remaining = length * entry.dtype.itemsize
        while remaining:
            view = sources.read_block(array.path, offset, min(remaining, BLOCK_BYTES))
            yield view
            offset += len(view)
            remaining -= len(view)


def as_bytes(tensor: Any) -> Any:
    import torch

    return tensor.contiguous().view(torch.uint8).numpy()


def _copy_range(src_fd: int, dst_fd: int, offset: int, nbytes: int, path: str, progress: Progress | None = None) -> None:
    while nbytes:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(nbytes, COPY_BYTES), offset)
        except OSError:
            n = -1
        if n < 0:  # not supported here (other filesystems): fall back to read/write
            os.lseek(src_fd, offset, os.SEEK_SET)
            chunk = os.read(src_fd, min(nbytes, BLOCK_BYTES))
            if not chunk:
                raise DataError(f"{path}: truncated at offset {offset}")
            _write_all(dst_fd, chunk)
            n = len(chunk)
        elif n == 0:
            raise DataError(f"{path}: truncated: expected {nbytes} more bytes at offset {offset}")
        offset += n
        nbytes -= n
        if progress:
            progress(n)


def _check_tiling(entry: TensorEntry, runs: list[tuple[int, int, Any, int]]) -> None:
    pos = 0
    for gstart, length, _, _ in runs:
        if gstart != pos:
            break
        pos += length
    if pos != entry.numel or len(runs) and runs[-1][0] + runs[-1][1] != entry.numel:
        raise DataError(f"{entry.name}: {entry.tiling_problem() or 'pieces do not cover the tensor'}")


def stream_tensor(seg: TensorData, fd: int, sources: SourceFiles, progress: Progress | None) -> int:
    """Write the tensor's elements to `fd` in order; return their CRC32 (0 when not asked for).

    Stored bytes that are already what the output needs are copied as bytes: in the kernel when no
    CRC is wanted, else through one reusable buffer. Anything else (casts, strided pieces) goes
    through torch, one window at a time.
    """
    entry, dst = seg.tensor, seg.dtype
    runs = entry.runs()
    _check_tiling(entry, runs)
    if not all(p.data.dtype == dst and p.data.is_contiguous for _, _, p, _ in runs):
        return _stream_converted(seg, fd, sources, progress)
    crc = 0
    for _, length, piece, lstart in runs:
        array = piece.data
        offset = array.offset + (array.storage_offset + lstart) * dst.itemsize
        nbytes = length * dst.itemsize
        if seg.crc_key is None and array.path != ZEROS:
            _copy_range(sources.fd(array.path), fd, offset, nbytes, array.path, progress)
        else:
            crc = _copy_with_crc(sources, array.path, offset, nbytes, fd, crc, progress)
    return crc


def _copy_with_crc(sources: SourceFiles, path: str, offset: int, nbytes: int, fd: int, crc: int, progress: Progress | None) -> int:
    while nbytes:
        view = sources.read_block(path, offset, min(nbytes, BLOCK_BYTES))
        crc = zlib.crc32(view, crc)
        _write_all(fd, view)
        offset += len(view)
        nbytes -= len(view)
        if progress:
            progress(len(view))
    return crc


def _stream_converted(seg: TensorData, fd: int, sources: SourceFiles, progress: Progress | None) -> int:
    entry, dst = seg.tensor, seg.dtype
    crc = 0
    for start, count in element_windows(entry, max(dst.itemsize, entry.dtype.itemsize)):
        out = as_bytes(read_elements(entry, start, count, sources).to(dst.torch()))
        if seg.crc_key is not None:
            crc = zlib.crc32(out, crc)
        _write_all(fd, out)
        if progress:
            progress(len(out))
    return crc


def write_file(path: Path, out: OutputFile, sources: SourceFiles, progress: Progress | None) -> None:
    crcs: dict[str, int] = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pending = 0

    def advance(nbytes: int) -> None:
        nonlocal pending
        pending += nbytes
        if pending >= WRITEBACK_BYTES:  # let the disk work while we produce the next bytes
            start_writeback(fd)
            pending = 0
        if progress:
            progress(nbytes)

    try:
        for seg in out.segments:
            if isinstance(seg, Literal):
                _write_all(fd, seg.data)
            elif isinstance(seg, TensorData):
                crc = stream_tensor(seg, fd, sources, advance)
                if seg.crc_key is not None:
                    crcs[seg.crc_key] = crc
            elif isinstance(seg, Deferred):
                data = seg.build(crcs)
                assert len(data) == seg.size, "deferred segment size differs from its plan"
                _write_all(fd, data)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_workers() -> int:
    """Files written at once: reads, CRCs and writes release the GIL, so threads overlap them."""
    return max(1, min(4, os.cpu_count() or 1))


class _Cancelled(Exception):
    pass


def write_files(files: list[tuple[Path, OutputFile]], workers: int, progress: Progress | None) -> None:
    """Write `files`, up to `workers` at once (each thread with its own descriptors and buffer), and fsync them."""
    cancel = threading.Event()
    lock = threading.Lock()

    def tick(nbytes: int) -> None:  # called once per block: lets a failing sibling stop the others
        if cancel.is_set():
            raise _Cancelled
        if progress:
            with lock:
                progress(nbytes)

    def write_one(target: Path, out: OutputFile) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        sources = SourceFiles()
        try:
            write_file(target, out, sources, tick)
        finally:
            sources.close()

    if workers == 1 or len(files) <= 1:
        for target, out in files:
            write_one(target, out)
    else:
        with ThreadPoolExecutor(min(workers, len(files))) as pool:
            futures = [pool.submit(write_one, target, out) for target, out in files]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                cancel.set()
                raise
    # Flush once all are written (the kernel writes back while we produce the next file), before
    # the rename makes the destination visible.
    for target, _ in files:
        fsync_path(target)


def targets(plan: WritePlan, tmp: Path) -> tuple[list[tuple[Path, OutputFile]], list[tuple[Path, OutputFile]]]:
    """(data files, commit markers) of the plan, placed under the temporary destination."""
    placed = [(tmp / out.relpath if plan.dest_is_dir else tmp, out) for out in plan.files]
    return [t for t in placed if not t[1].commit_marker], [t for t in placed if t[1].commit_marker]


def execute(plan: WritePlan, overwrite: bool = False, progress: Progress | None = None, workers: int | None = None) -> None:
    """Write every file of `plan` into a temporary sibling of the destination, then rename it.

    Under torchrun (WORLD_SIZE > 1) the ranks share the work: see ckpt_cli.core.distributed.
    """
    from ckpt_cli.core import distributed

    workers = max(1, workers or default_workers())
    if distributed.rank_and_world() is not None:
        distributed.execute(plan, overwrite, progress, workers)
        return
    with staged(plan.dest, plan.dest_is_dir, overwrite) as tmp:
        data, markers = targets(plan, tmp)
        write_files(data, workers, progress)
        write_files(markers, 1, progress)  # last, so they are the newest files
