"""The write engine: carries out a WritePlan in one process, with a bounded amount of tensor data in memory.

Files are written up to `workers` at once, each through a sink (core/sinks.py: kernel copies where the bytes are
what the output needs, one reusable buffer where a CRC or a cast is). Data read from a zip record (torch file,
DeepSpeed rank file, DCP chunk) has its CRC32 checked on the way (core/crc.py), so a damaged source fails the write
instead of being copied. A file the plan builds when it is written (a wide write's rank files) is made here, one at a
time. Writeback to disk starts every WRITEBACK_BYTES, so the final fsync finds little left to flush.
Under torchrun the caller uses core/distributed.py instead, which shares the files out over ranks.
A destination in object storage (s3://) has no rename: each file streams in order into one multipart
upload (core/remote_write.py), data objects first and the commit markers last (execute_remote).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpt_cli.core import interrupt, remote_write, storage
from ckpt_cli.core.atomic import Guard, check_destination, staged
from ckpt_cli.core.crc import RecordCheck, crc32_combine
from ckpt_cli.core.model import ZEROS, TensorEntry
from ckpt_cli.core.paths import inside
from ckpt_cli.core.plan import Deferred, Literal, OutputFile, Segment, TensorData, WritePlan, sizes_of
from ckpt_cli.core.reading import ByteRun, SourceFiles, byte_runs
from ckpt_cli.core.remote_write import ObjectWriter
from ckpt_cli.core.sinks import (
    WRITEBACK_BYTES,
    FileSink,
    Progress,
    copy_runs,
    split_runs,
    start_writeback,
    stream_tensor,
    write_segments,
)
from ckpt_cli.core.storage import RemotePath
from ckpt_cli.core.zipio import Record

CHUNK_BYTES = 64 << 20  # a large tensor is cut into pieces of this size when threads share its file


def write_file(
    path: Path,
    out: OutputFile,
    progress: Progress | None,
    threads: int = 1,
    cancel: threading.Event | None = None,
    check: RecordCheck | None = None,
) -> None:
    """Write one output file. Literal bytes go out at once; tensor data is copied by `threads` threads at
    known offsets (large CRC-bearing tensors in CHUNK_BYTES pieces, their CRCs combined in order); the
    CRC-dependent trailers (Deferred) come last. `check` verifies the source records the copies read."""
    lock = threading.Lock()
    segments = made(out, check)
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

    if threads == 1:  # in order, through one buffered sink: each trailer right after the data it covers

        def in_order(sources: SourceFiles) -> int:
            sink = FileSink(fd, 0, advance, buffered=True)
            write_segments(segments, sink, sources)
            sink.flush()
            # A built file's size was planned without its segments (DCP: every chunk's offset in .metadata).
            assert sink.offset == out.size, f"{out.relpath}: wrote {sink.offset} bytes, planned {out.size}"
            return 0

        try:
            _run_jobs([(0, out.size, in_order)], 1, cancel, check, file_runs(segments))
        finally:
            os.close(fd)
        return
    jobs: list[tuple[int, int, Callable[[SourceFiles], int]]] = []  # (segment, byte count, job -> CRC)
    deferred: list[tuple[int, Deferred]] = []
    pos = 0
    try:
        for index, seg in enumerate(segments):
            if isinstance(seg, Literal):
                FileSink(fd, pos, None).write(seg.data)
            elif isinstance(seg, TensorData):
                jobs += _tensor_jobs(index, seg, fd, pos, advance, threads)
            elif isinstance(seg, Deferred):
                deferred.append((pos, seg))
            pos += seg.size
        assert pos == out.size, f"{out.relpath}: {pos} bytes of segments, planned {out.size}"
        crcs = _run_jobs(jobs, threads, cancel, check)
        by_key = {segments[i].crc_key: crc for i, crc in crcs.items()}  # type: ignore[union-attr]
        for offset, seg in deferred:
            data = seg.build(by_key)
            assert len(data) == seg.size, "deferred segment size differs from its plan"
            FileSink(fd, offset, None).write(data)
    finally:
        os.close(fd)


def _tensor_jobs(
    index: int, seg: TensorData, fd: int, pos: int, advance: Progress, threads: int
) -> list[tuple[int, int, Callable[[SourceFiles], int]]]:
    # Only CRC-bearing data is shared: reads and CRCs run in parallel, while writes into one file are
    # serialised by the filesystem anyway (the inode lock), so kernel copies gain nothing from threads.
    shared = threads > 1 and seg.crc_key is not None and seg.size > 2 * CHUNK_BYTES
    runs = byte_runs(seg.tensor, seg.dtype) if shared else None
    if runs is None:  # one job: the whole segment in order, its small pieces gathered (a tensor of 64 ranks' slivers)

        def whole(sources: SourceFiles) -> int:
            crc = stream_tensor(seg, sink := FileSink(fd, pos, advance, buffered=True), sources)
            sink.flush()
            return crc

        return [(index, seg.size, whole)]
    jobs = []
    for chunk in split_runs(runs, CHUNK_BYTES):
        size = sum(n for _, _, n in chunk)
        jobs.append(
            (index, size, lambda sources, c=chunk, at=pos: copy_runs(c, FileSink(fd, at, advance), sources, seg.crc_key is not None))
        )
        pos += size
    return jobs


def _run_jobs(
    jobs: list[tuple[int, int, Callable[[SourceFiles], int]]],
    threads: int,
    cancel: threading.Event | None,
    check: RecordCheck | None = None,
    expect: list[ByteRun] | None = None,
) -> dict[int, int]:
    """Run the jobs (each thread with its own source descriptors and buffer); the CRC of each segment.
    On an error or Ctrl-C, `cancel` stops the running jobs at their next block (their progress callback
    checks it) and the rest never start; descriptors are closed only once every job has returned."""
    local = threading.local()
    opened: list[SourceFiles] = []

    def run(job: Callable[[SourceFiles], int]) -> int:
        if not hasattr(local, "sources"):
            local.sources = SourceFiles(check)
            if expect:  # one thread runs the jobs in order: sources in object storage are fetched ahead
                local.sources.expect(expect)
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


def worker_count(workers: int | None) -> int:
    """Files written at once (the default when None): reads, CRCs and writes release the GIL, so threads overlap them.
    The default shares the host's CPUs among the processes torchrun started on it (LOCAL_WORLD_SIZE): a process's
    threads past its share only queue for its GIL."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, workers or min(4, (os.cpu_count() or 1) // local))


class _Cancelled(Exception):
    pass


def records(tensors: Iterable[TensorEntry]) -> Iterator[tuple[str, Record]]:
    """The zip records (with their CRC32) the tensors' data is read from."""
    return ((a.path, a.record) for tensor in tensors for a in tensor.stored_arrays() if a.record is not None)


def source_records(files: list[tuple[Path, OutputFile]]) -> RecordCheck:
    """The check of the zip records the files' tensor data is read from (a built file's are learnt as it is made)."""
    return RecordCheck(records(tensor for _, out in files for tensor in out.tensors()))


def made(out: OutputFile, check: RecordCheck | None) -> list[Segment]:
    """The file's segments; a built file's made now (held only while it is written), its source records learnt."""
    segments = out.parts()
    if out.build is not None:
        tensors = [s.tensor for s in segments if isinstance(s, TensorData)]
        if check is not None:
            check.learn(records(tensors))
        if out.names is None:  # what the write report lists, without making the segments again; interned: 1,024
            out.names = [sys.intern(t.name) for t in tensors]  # ranks' files name the same 2,000 tensors (150 MB apart)
        if out.sizes is None:
            out.sizes = sizes_of(segments)
    return segments


def write_files(files: list[tuple[Path, OutputFile]], workers: int, progress: Progress | None) -> None:
    """Write `files`, up to `workers` at once, and fsync them. With fewer files than workers, the spare
    workers share the large CRC-bearing tensors of a file (one big DeepSpeed optimizer file, say). Every
    source zip record read is checked against its CRC32 (DataError before anything is committed)."""

    def write_one(target: Path, out: OutputFile, tick: Progress, threads: int, cancel: threading.Event, check: RecordCheck) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_file(target, out, tick, threads, cancel, check)

    _write_all(files, workers, progress, write_one)
    # Flush once all are written (the kernel writes back while we produce the next file), before
    # the rename makes the destination visible.
    for target, _ in files:
        fsync_path(target)


WriteOne = Callable[[Path, OutputFile, Progress, int, threading.Event, RecordCheck], None]


def _write_all(files: list[tuple[Path, OutputFile]], workers: int, progress: Progress | None, write_one: WriteOne) -> None:
    """Run `write_one` on every file, up to `workers` at once; the first failure cancels the rest."""
    check = source_records(files)
    cancel = threading.Event()
    lock = threading.Lock()

    def tick(nbytes: int) -> None:  # called once per block: lets a failing sibling or a SIGTERM stop the others
        if cancel.is_set():
            raise _Cancelled
        interrupt.check()
        if progress:
            with lock:
                progress(nbytes)

    threads = max(1, workers // max(1, len(files)))

    if workers == 1 or len(files) <= 1:
        try:
            for target, out in files:
                write_one(target, out, tick, threads, cancel, check)
        except BaseException:
            cancel.set()
            raise
    else:
        with ThreadPoolExecutor(min(workers, len(files))) as pool:
            futures = [pool.submit(write_one, target, out, tick, threads, cancel, check) for target, out in files]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                cancel.set()
                raise
    check.finish()  # records copied only in part: read the rest and compare


def targets(plan: WritePlan, tmp: Path) -> tuple[list[tuple[Path, OutputFile]], list[tuple[Path, OutputFile]]]:
    """(data files, commit markers) of the plan, placed under the temporary destination (DataError for a file
    name that would leave it: names come from inside checkpoints)."""
    placed = [(inside(tmp, out.relpath, str(plan.dest)) if plan.dest_is_dir else tmp, out) for out in plan.files]
    return [t for t in placed if not t[1].commit_marker], [t for t in placed if t[1].commit_marker]


def plan_sources(plan: WritePlan) -> tuple[str, ...]:
    """The files the plan reads tensor data from (what --overwrite must never replace)."""
    paths = {a.path for f in plan.files for tensor in f.tensors() for a in tensor.stored_arrays()}
    paths.update(path for f in plan.files for path in f.reads)
    return tuple(sorted(paths - {ZEROS}))


def default_guard(plan: WritePlan, guard: Guard | None) -> Guard:
    return guard if guard is not None else Guard(plan_sources(plan))


def execute(
    plan: WritePlan, overwrite: bool = False, progress: Progress | None = None, workers: int | None = None, guard: Guard | None = None
) -> None:
    """Write every file of `plan` into a temporary sibling of the destination, then rename it. `guard` says what
    --overwrite must keep (default: the files the plan reads; only an empty folder is replaced).

    One process only: under torchrun (WORLD_SIZE > 1) the caller uses ckpt_cli.core.distributed.execute.
    """
    targets(plan, plan.dest)  # refuse a file name that leaves the destination before anything is created
    if storage.is_remote(plan.dest):
        execute_remote(plan, overwrite, progress, workers, guard)
        return
    with staged(plan.dest, plan.dest_is_dir, overwrite, default_guard(plan, guard)) as tmp:
        data, markers = targets(plan, tmp)
        write_files(data, worker_count(workers), progress)
        write_files(markers, 1, progress)  # last, so they are the newest files


def execute_remote(
    plan: WritePlan, overwrite: bool = False, progress: Progress | None = None, workers: int | None = None, guard: Guard | None = None
) -> None:
    """Write the plan to object storage: every data object first (each one multipart upload, up to `workers`
    at once), the commit markers after all of them completed. On an error or interrupt the uploads in flight
    are aborted and the objects completed are deleted, so no marker ever names missing data. --overwrite
    first deletes the old checkpoint under a prefix (a one-object output replaces the old object when its
    upload completes)."""
    dest = prepare_remote(plan, overwrite, guard)
    data, markers = targets(plan, dest)
    cleanup = remote_write.Cleanup()
    with interrupt.writing():
        try:
            upload_files(data, worker_count(workers), progress, cleanup)
            interrupt.check()
            upload_files(markers, 1, progress, cleanup)
        except BaseException:
            cleanup.undo()
            raise


def prepare_remote(plan: WritePlan, overwrite: bool, guard: Guard | None) -> RemotePath:
    """Refuse an existing destination unless --overwrite, and with it delete what is there (and abort what a killed
    write left unfinished)."""
    dest = storage.location(plan.dest)
    check_destination(dest, overwrite, plan.dest_is_dir, default_guard(plan, guard))
    if overwrite:
        remote_write.clear(dest, keep_object=not plan.dest_is_dir)  # type: ignore[arg-type]
    return dest  # type: ignore[return-value]


def upload_files(files: list[tuple[Path, OutputFile]], workers: int, progress: Progress | None, cleanup: remote_write.Cleanup) -> None:
    """Upload `files`, up to `workers` at once, each as one multipart upload completed only once all its bytes are
    sent; `cleanup` learns every object completed (call inside interrupt.writing())."""

    def upload_one(target: Path, out: OutputFile, tick: Progress, threads: int, cancel: threading.Event, check: RecordCheck) -> None:
        segments = made(out, check)
        with ObjectWriter(target, out.size, tick) as sink:  # type: ignore[arg-type]
            upload_segments(segments, sink, check)
            interrupt.check()  # a SIGTERM during the last blocks: complete nothing
            sink.commit()
        cleanup.add(target)  # type: ignore[arg-type]

    _write_all(files, workers, progress, upload_one)


def file_runs(segments: list[Segment]) -> list[ByteRun]:
    """The stored bytes a file's tensor data is copied from, in order, when some are in object storage (read
    ahead: core/remote_read.py); [] otherwise, and for data that needs torch (casts, strided pieces)."""
    data = [s for s in segments if isinstance(s, TensorData)]
    if not any(storage.is_remote(a.path) for s in data for a in s.tensor.stored_arrays()):
        return []
    return [run for s in data for run in byte_runs(s.tensor, s.dtype) or []]


def upload_segments(segments: list[Segment], sink: ObjectWriter, check: RecordCheck) -> None:
    """A file's bytes in order into an object (see write_segments)."""
    sources = SourceFiles(check)
    sources.expect(file_runs(segments))
    try:
        write_segments(segments, sink, sources)
    finally:
        sources.close()
