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
from ckpt_cli.core.dtypes import DType
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
    runs = byte_runs(entry, entry.dtype)
    if runs is None:
        for start, count in element_windows(entry):
            yield as_bytes(read_elements(entry, start, count, sources))
        return
    yield from read_runs(runs, sources)


def as_bytes(tensor: Any) -> Any:
    import torch

    return tensor.contiguous().view(torch.uint8).numpy()


class _Out:
    """Positional writes into one output file from `offset` on (threads may fill other ranges of it)."""

    def __init__(self, fd: int, offset: int, progress: Progress | None) -> None:
        self.fd, self.offset, self.progress = fd, offset, progress

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, self.offset)
            view = view[n:]
            self.offset += n
            if self.progress:
                self.progress(n)

    def copy(self, src_fd: int, offset: int, nbytes: int, path: str) -> None:
        """`nbytes` of a source from `offset`, in the kernel (copy_file_range) where it can."""
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
    """The stored bytes that make up the tensor as `dst`, in order; None when a cast or a strided piece needs torch."""
    runs = entry.runs()
    _check_tiling(entry, runs)
    if not all(p.data.dtype == dst and p.data.is_contiguous for _, _, p, _ in runs):
        return None
    return [
        (p.data.path, p.data.offset + (p.data.storage_offset + lstart) * dst.itemsize, length * dst.itemsize)
        for _, length, p, lstart in runs
    ]


def read_runs(runs: list[ByteRun], sources: SourceFiles) -> Iterator[memoryview]:
    """The runs' bytes, a block at a time, in the reused buffer: consume each block before the next."""
    for path, offset, nbytes in runs:
        while nbytes:
            view = sources.read_block(path, offset, min(nbytes, BLOCK_BYTES))
            yield view
            offset += len(view)
            nbytes -= len(view)


def copy_runs(runs: list[ByteRun], out: _Out, sources: SourceFiles, with_crc: bool) -> int:
    """Copy byte runs to `out`: in the kernel when no CRC is wanted, else through the reusable buffer."""
    crc = 0
    for path, offset, nbytes in runs:
        if not with_crc and path != ZEROS:
            out.copy(sources.fd(path), offset, nbytes, path)
            continue
        for view in read_runs([(path, offset, nbytes)], sources):
            crc = zlib.crc32(view, crc)
            out.write(view)
    return crc


def stream_tensor(seg: TensorData, out: _Out, sources: SourceFiles) -> int:
    """Write the tensor's elements in order; return their CRC32 (0 when not asked for).

    Stored bytes that are already what the output needs are copied as bytes; anything else (casts,
    strided pieces) goes through torch, one window at a time.
    """
    runs = byte_runs(seg.tensor, seg.dtype)
    if runs is None:
        return _stream_converted(seg, out, sources)
    return copy_runs(runs, out, sources, seg.crc_key is not None)


def _stream_converted(seg: TensorData, out: _Out, sources: SourceFiles) -> int:
    entry, dst = seg.tensor, seg.dtype
    crc = 0
    for start, count in element_windows(entry, max(dst.itemsize, entry.dtype.itemsize)):
        data = as_bytes(read_elements(entry, start, count, sources).to(dst.torch()))
        if seg.crc_key is not None:
            crc = zlib.crc32(data, crc)
        out.write(data)
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


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine, which Python's zlib lacks)."""

    def times(mat: list[int], vec: int) -> int:
        out, i = 0, 0
        while vec:
            if vec & 1:
                out ^= mat[i]
            vec >>= 1
            i += 1
        return out

    def square(mat: list[int]) -> list[int]:
        return [times(mat, mat[n]) for n in range(32)]

    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = square(odd)  # two zero bits
    odd = square(even)  # four zero bits
    while len2:  # apply len2 zero bytes to crc1, one bit of len2 at a time
        even = square(odd)
        if len2 & 1:
            crc1 = times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = square(even)
        if len2 & 1:
            crc1 = times(odd, crc1)
        len2 >>= 1
    return crc1 ^ crc2


CHUNK_BYTES = 64 << 20  # a large tensor is cut into pieces of this size when threads share its file


def write_file(path: Path, out: OutputFile, progress: Progress | None, threads: int = 1, cancel: threading.Event | None = None) -> None:
    """Write one output file. Literal bytes go out at once; tensor data is copied by `threads` threads at
    known offsets (large CRC-bearing tensors in CHUNK_BYTES pieces, their CRCs combined in order); the
    CRC-dependent trailers (Deferred) come last."""
    lock = threading.Lock()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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

    jobs: list[tuple[int, int, Callable[[SourceFiles], int]]] = []  # (segment, byte count, job -> CRC)
    deferred: list[tuple[int, Deferred]] = []
    pos = 0
    try:
        for index, seg in enumerate(out.segments):
            if isinstance(seg, Literal):
                _Out(fd, pos, None).write(seg.data)
            elif isinstance(seg, TensorData):
                jobs += _tensor_jobs(index, seg, fd, pos, advance, threads)
            elif isinstance(seg, Deferred):
                deferred.append((pos, seg))
            pos += seg.size
        crcs = _run_jobs(jobs, threads, cancel)
        for offset, seg in deferred:
            data = seg.build({out.segments[i].crc_key: crc for i, crc in crcs.items()})  # type: ignore[union-attr]
            assert len(data) == seg.size, "deferred segment size differs from its plan"
            _Out(fd, offset, None).write(data)
    finally:
        os.close(fd)


def _tensor_jobs(
    index: int, seg: TensorData, fd: int, pos: int, advance: Progress, threads: int
) -> list[tuple[int, int, Callable[[SourceFiles], int]]]:
    # Only CRC-bearing data is shared: reads and CRCs run in parallel, while writes into one file are
    # serialised by the filesystem anyway (the inode lock), so kernel copies gain nothing from threads.
    shared = threads > 1 and seg.crc_key is not None and seg.size > 2 * CHUNK_BYTES
    runs = byte_runs(seg.tensor, seg.dtype) if shared else None
    if runs is None:  # one job: the whole segment in order
        return [(index, seg.size, lambda sources: stream_tensor(seg, _Out(fd, pos, advance), sources))]
    jobs = []
    for chunk in split_runs(runs, CHUNK_BYTES):
        size = sum(n for _, _, n in chunk)
        jobs.append((index, size, lambda sources, c=chunk, at=pos: copy_runs(c, _Out(fd, at, advance), sources, seg.crc_key is not None)))
        pos += size
    return jobs


def _run_jobs(jobs: list[tuple[int, int, Callable[[SourceFiles], int]]], threads: int, cancel: threading.Event | None) -> dict[int, int]:
    """Run the jobs (each thread with its own source descriptors and buffer); the CRC of each segment.
    On an error or Ctrl-C, `cancel` stops the running jobs at their next block (their progress callback
    checks it) and the rest never start; descriptors are closed only once every job has returned."""
    local = threading.local()
    opened: list[SourceFiles] = []

    def run(job: Callable[[SourceFiles], int]) -> int:
        if not hasattr(local, "sources"):
            local.sources = SourceFiles()
            opened.append(local.sources)
        return job(local.sources)

    try:
        if threads == 1 or len(jobs) <= 1:
            results = [run(job) for _, _, job in jobs]
        else:
            pool = ThreadPoolExecutor(threads)
            futures = [pool.submit(run, job) for _, _, job in jobs]
            try:
                results = [f.result() for f in futures]
            except BaseException:
                if cancel is not None:
                    cancel.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            pool.shutdown()
    finally:
        for sources in opened:
            sources.close()
    crcs: dict[int, int] = {}
    for (index, size, _), crc in zip(jobs, results):
        crcs[index] = crc32_combine(crcs[index], crc, size) if index in crcs else crc
    return crcs


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
    """Write `files`, up to `workers` at once, and fsync them. With fewer files than workers, the spare
    workers share the large CRC-bearing tensors of a file (one big DeepSpeed optimizer file, say)."""
    cancel = threading.Event()
    lock = threading.Lock()

    def tick(nbytes: int) -> None:  # called once per block: lets a failing sibling stop the others
        if cancel.is_set():
            raise _Cancelled
        if progress:
            with lock:
                progress(nbytes)

    threads = max(1, workers // max(1, len(files)))

    def write_one(target: Path, out: OutputFile) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_file(target, out, tick, threads, cancel)

    if workers == 1 or len(files) <= 1:
        try:
            for target, out in files:
                write_one(target, out)
        except BaseException:
            cancel.set()
            raise
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
