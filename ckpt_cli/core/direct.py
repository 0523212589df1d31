"""A write's large source reads past the page cache (O_DIRECT), the next blocks read ahead while this one is written.

Why: a conversion reads each source byte once. Read through the page cache, those bytes are charged to the memory
cgroup of the process, and under a limit smaller than the checkpoint every new page waits for the reclaim of an old
one; the kernel's read-ahead also pulls in what the write does not want yet (a DCP write reads a quarter of each
tensor per rank file: 35% more bytes came off the disk than the checkpoint holds, 4 GB under a 512 MB limit). An
O_DIRECT read lands in this process's own aligned buffer: nothing to reclaim, nothing read that is not asked for, no
copy out of the cache (benchmarks/beyond_ram.py: 400,000 failed charges a run became 2,000-4,000, the kernel's CPU
time halved). Reads are kept in flight: one 4 MB O_DIRECT read at a time came off this disk at 0.9 GB/s, where the
kernel's read-ahead keeps several going for `cp`; with AHEAD blocks read ahead a one-thread reshard went from 1.5x to
about 1x the copy (AHEAD 3 gained a little more, for 4 MB more a thread). A block the page cache holds whole is read
from it (cachestat, Linux 6.5; preadv2's RWF_NOWAIT is no test: it starts the read-ahead it declines to wait for), so
a warm checkpoint stays a memory copy. Where O_DIRECT is refused (tmpfs, some network filesystems) the reads go
through the cache as before; CKPT_DIRECT_READS=0 sends them all there.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from ckpt_cli.errors import DataError

ALIGN = 4096  # file offsets, lengths and buffers of O_DIRECT reads (any device's logical block size up to a page)
DIRECT_BYTES = 1 << 20  # smaller reads go through the page cache (its read-ahead serves a run of small chunks better)
AHEAD = 2  # blocks read ahead of the one being written, each on a helper thread of its own (see below)
AHEAD_BLOCKS = 4096  # blocks announced and not yet read, at most (a wide DCP write's batch is 1,000 chunks)
_DIRECT = getattr(os, "O_DIRECT", 0)

Key = tuple[str, int, int]  # (path, offset, nbytes): one block as core/reading.read_runs asks for it


class DirectReads:
    """One reading thread's direct reads: two aligned buffers, the block handed out and the one being read ahead on a
    helper thread. `expect` announces the blocks in the order they will be asked for; a block asked for out of that
    order is read at once (nothing is assumed). Buffers are reused: consume a block before asking for the next."""

    def __init__(self, block_bytes: int, cached_fd: Callable[[str], int], ahead: int = AHEAD) -> None:
        self.block_bytes, self._cached_fd = block_bytes, cached_fd  # cached_fd: the reader's descriptor of a path
        self.depth = ahead
        self._fds: dict[str, int | None] = {}  # None: O_DIRECT refused for this file
        self._buffers: list[mmap.mmap] = []
        self._queue: deque[Key] = deque()
        self._ahead: deque[tuple[Key, int, Future[memoryview]]] = deque()  # (block, buffer index, its read), in order
        self._held = -1  # the buffer of the block handed out last
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def wants(self, path: str, nbytes: int) -> bool:
        """Whether a read of `nbytes` of this local file goes direct (large enough, and the file opens so)."""
        return nbytes >= DIRECT_BYTES and bool(_DIRECT) and self._fd(path) is not None

    def _fd(self, path: str) -> int | None:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY | _DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # EINVAL: the filesystem has no O_DIRECT; the caller reads through the cache
                self._fds[path] = None
        return self._fds[path]

    def expect(self, blocks: Iterable[Key]) -> None:
        """The blocks to be read next, in order (those too small to go direct are left out by the caller)."""
        self._drop_ahead()
        self._queue = deque(blocks)
        while len(self._queue) > AHEAD_BLOCKS:
            self._queue.pop()
        self._start_next()

    def read(self, path: str, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of `path` (nbytes <= block_bytes); DataError if the file ends first."""
        key = (path, offset, nbytes)
        if any(k == key for k, _, _ in self._ahead):  # the blocks before it were read another way (a kernel copy)
            while self._ahead[0][0] != key:
                self._drop_ahead(1)
            _, self._held, future = self._ahead.popleft()
            view = future.result()
            self._start_next()
            return view
        if self._ahead and key in self._queue:  # further on: start again from it
            while self._queue[0] != key:
                self._queue.popleft()
            self._queue.popleft()
            self._drop_ahead()
        busy = {index for _, index, _ in self._ahead}
        self._held = next(i for i in range(self.depth + 1) if i not in busy)
        view = self._read_into(self._held, key)
        self._start_next()
        return view

    def _start_next(self) -> None:
        """Read the next announced blocks into the free buffers on the helper threads."""
        while self._queue and len(self._ahead) < self.depth:
            key = self._queue.popleft()
            self._cached_fd(key[0])  # opened here, on the reader's thread: the helpers only read
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="ckpt-direct")
            busy = {index for _, index, _ in self._ahead}
            index = next(i for i in range(self.depth + 1) if i not in busy and i != self._held)
            self._ahead.append((key, index, self._pool.submit(self._read_into, index, key)))

    def _drop_ahead(self, count: int | None = None) -> None:
        """Forget the blocks read ahead, or the first `count` (waiting for their reads: their buffers are reused next)."""
        for _ in range(len(self._ahead) if count is None else count):
            try:
                self._ahead.popleft()[2].result()
            except (OSError, DataError):  # a block no longer wanted: its error does not matter
                pass

    def _buffer(self, index: int) -> memoryview:
        with self._lock:
            while len(self._buffers) <= index:
                self._buffers.append(mmap.mmap(-1, self.block_bytes + 2 * ALIGN))  # page-aligned
        return memoryview(self._buffers[index])

    def _read_into(self, index: int, key: Key) -> memoryview:
        """The block in buffer `index`: what the page cache holds of it first, the rest from the disk."""
        path, offset, nbytes = key
        cached_fd = self._cached_fd(path)
        buffer = self._buffer(index)
        start = offset - offset % ALIGN  # buffer[0] holds the byte at `start`
        want = buffer[offset - start : offset - start + nbytes]
        got = 0
        fd = self._fd(path) if not cached(cached_fd, offset, nbytes) else None
        end = offset + nbytes
        while offset + got < end:
            pos = offset + got - (offset + got) % ALIGN
            stop = -(-end // ALIGN) * ALIGN
            try:
                n = os.preadv(fd, [buffer[pos - start : stop - start]], pos) if fd is not None else -1
            except OSError:  # refused after all (an unaligned device): through the cache from here on
                self._fds[path] = fd = None
                n = -1
            if n < 0:
                n = os.preadv(cached_fd, [want[got:]], offset + got)
                if n == 0:
                    break
                got += n
                continue
            if pos + n <= offset + got:  # the file ends before the bytes asked for
                break
            got = min(nbytes, pos + n - offset)
        if got < nbytes:
            raise DataError(f"{path}: truncated: expected {nbytes} bytes at offset {offset}, file ends first")
        return want

    def close(self) -> None:
        self._queue.clear()
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()
        for buffer in self._buffers:
            try:
                buffer.close()
            except BufferError:  # a view still held (an exception's frame): unmapped when collected
                pass
        self._buffers.clear()


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def _cachestat() -> Callable[[int, int, int], bool] | None:
    """cachestat(2) (Linux 6.5, syscall 451 on every architecture): whether the page cache holds every page of a range."""
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    def cached(fd: int, offset: int, nbytes: int) -> bool:
        first, end = offset - offset % PAGE, offset + nbytes
        stat = _Stat()
        if (
            syscall(ctypes.c_long(451), ctypes.c_uint(fd), ctypes.byref(_Range(first, end - first)), ctypes.byref(stat), ctypes.c_uint(0))
            != 0
        ):
            return False  # ENOSYS (an older kernel): read past the cache
        return stat.cache >= -(-(end - first) // PAGE)

    return cached


PAGE = mmap.PAGESIZE
cached: Callable[[int, int, int], bool] = _cachestat() or (lambda fd, offset, nbytes: False)
"""Whether the page cache holds every page of bytes [offset, offset + nbytes) of a file (False where unknown)."""
