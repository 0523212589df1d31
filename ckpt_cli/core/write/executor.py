"""The write engine: carries out a WritePlan in one process, with a bounded amount of tensor data in memory.

Files are written up to `workers` at once, each through a sink (core/write/sinks.py: kernel copies where the bytes are
what the output needs, one reusable buffer where a CRC or a cast is). Each file's large local reads are announced to its
reader, which reads them ahead past the page cache (core/direct.py: `direct_runs`). Data read from a zip record (torch file,
DeepSpeed rank file, DCP chunk) has its CRC32 checked on the way (core/write/crc.py), so a damaged source fails the write
instead of being copied. A file the plan builds when it is written (a wide write's rank files) is made here, one at a
time. Writeback to disk starts every WRITEBACK_BYTES, so the final fsync finds little left to flush.
Under torchrun the caller uses core/write/distributed.py instead, which shares the files out over ranks.
Files are created through the destination's write transaction (ckpt_cli.store): locally a temporary sibling renamed
into place at the end, positional writes; in object storage each file streams in order into one object, data objects
first and the commit markers last, and a failure deletes the objects completed.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpt_cli import interrupt, store
from ckpt_cli.core import heap
from ckpt_cli.core.direct import DIRECT_BYTES
from ckpt_cli.core.model import ZEROS
from ckpt_cli.core.paths import inside
from ckpt_cli.core.reading import ByteRun, SourceFiles, byte_runs, remote_runs
from ckpt_cli.core.write import object_copies, source_order
from ckpt_cli.core.write.crc import RecordCheck, crc32_combine
from ckpt_cli.core.write.plan import Deferred, FileSizes, Literal, OutputFile, Segment, TensorData, WritePlan
from ckpt_cli.core.write.segments import forget_kept, made, records, source_records
from ckpt_cli.core.write.sinks import (
    FileSink,
    Progress,
    advancer,
    copy_runs,
    split_runs,
    stream_tensor,
    write_segments,
)
from ckpt_cli.core.write.source_order import run_together, ticker
from ckpt_cli.store import Guard, Write
from ckpt_cli.store.shared_reads import SharedReads

SharedFile = tuple[SharedReads, int]  # a write's shared reads, and a file's index in them

CHUNK_BYTES = 64 << 20  # a large tensor is cut into pieces of this size when threads share its file


def write_file(
    fd: int,
    out: OutputFile,
    segments: list[Segment],
    progress: Progress | None,
    threads: int = 1,
    cancel: threading.Event | None = None,
    check: RecordCheck | None = None,
) -> None:
    """Write one output file. Literal bytes go out at once; tensor data is copied by `threads` threads at
    known offsets (large CRC-bearing tensors in CHUNK_BYTES pieces, their CRCs combined in order); the
    CRC-dependent trailers (Deferred) come last. `check` verifies the source records the copies read."""
    advance = advancer(fd, progress)
    if threads > 1 and not any(_worth_a_thread(seg) for seg in segments):
        threads = 1  # byte copies alone: a second thread only waits for the file's inode lock (8 GB merge: 17 s -> 12 s)
    if threads == 1:  # in order, through one buffered sink: each trailer right after the data it covers

        def in_order(sources: SourceFiles) -> int:
            sink = FileSink(fd, 0, advance, buffered=True)
            write_segments(segments, sink, sources)
            sink.flush()
            # A built file's size was planned without its segments (DCP: every chunk's offset in .metadata).
            assert sink.offset == out.size, f"{out.relpath}: wrote {sink.offset} bytes, planned {out.size}"
            return 0

        _run_jobs([(0, out.size, in_order)], 1, cancel, check, file_runs(segments) or direct_runs(segments))
        return
    jobs: list[tuple[int, int, Callable[[SourceFiles], int]]] = []  # (segment, byte count, job -> CRC)
    deferred: list[tuple[int, Deferred]] = []
    tensors: dict[int, TensorData] = {}  # segment index -> the tensor its jobs copy
    pos = 0
    for index, seg in enumerate(segments):
        if isinstance(seg, Literal):
            FileSink(fd, pos, None).write(seg.data)
        elif isinstance(seg, TensorData):
            tensors[index] = seg
            jobs += _tensor_jobs(index, seg, fd, pos, advance, threads)
        elif isinstance(seg, Deferred):
            deferred.append((pos, seg))
        pos += seg.size
    assert pos == out.size, f"{out.relpath}: {pos} bytes of segments, planned {out.size}"
    crcs = _run_jobs(jobs, threads, cancel, check)
    by_key = {key: crc for i, crc in crcs.items() if (key := tensors[i].crc_key) is not None}
    for offset, seg in deferred:
        data = seg.build(by_key)
        assert len(data) == seg.size, "deferred segment size differs from its plan"
        FileSink(fd, offset, None).write(data)


def _worth_a_thread(seg: Segment) -> bool:
    """Whether the segment's data is work a second thread shares: a large tensor with a CRC (cut in CHUNK_BYTES
    pieces), a cast, a computed tensor (torch or numpy) or one made by range (gathered; its pieces are not made here)."""
    if not isinstance(seg, TensorData):
        return False
    if seg.crc_key is not None and seg.size > 2 * CHUNK_BYTES or seg.tensor.derived is not None or seg.tensor.made_by_range():
        return True
    return any(a.dtype != seg.dtype or not a.is_contiguous for a in seg.tensor.stored_arrays())


def _tensor_jobs(
    index: int, seg: TensorData, fd: int, pos: int, advance: Progress, threads: int
) -> list[tuple[int, int, Callable[[SourceFiles], int]]]:
    # Only CRC-bearing data is shared: reads and CRCs run in parallel, while writes into one file are
    # serialised by the filesystem anyway (the inode lock), so kernel copies gain nothing from threads.
    shared = threads > 1 and seg.crc_key is not None and seg.size > 2 * CHUNK_BYTES
    runs = byte_runs(seg.tensor, seg.dtype) if shared else None
    if runs is None:  # one job: the whole segment in order, its small pieces gathered (a tensor of 64 ranks' slivers)

        def whole(sources: SourceFiles) -> int:
            sources.expect(direct_runs([seg]))  # (local runs alone) read ahead past the page cache
            crc = stream_tensor(seg, sink := FileSink(fd, pos, advance, buffered=True), sources)
            sink.flush()
            return crc

        return [(index, seg.size, whole)]

    def copy_chunk(chunk: list[ByteRun], at: int) -> Callable[[SourceFiles], int]:
        def copy(sources: SourceFiles) -> int:
            sources.expect([run for run in chunk if store.mappable(run[0])])  # read ahead past the page cache
            return copy_runs(chunk, FileSink(fd, at, advance), sources, seg.crc_key is not None)

        return copy

    jobs: list[tuple[int, int, Callable[[SourceFiles], int]]] = []
    for chunk in split_runs(runs, CHUNK_BYTES):
        size = sum(n for _, _, n in chunk)
        jobs.append((index, size, copy_chunk(chunk, pos)))
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


def worker_count(workers: int | None, threads: int | None = None) -> int:
    """Files written at once (the default when None): reads, CRCs and writes release the GIL, so threads overlap them.
    The default shares the host's CPUs among the processes torchrun started on it (LOCAL_WORLD_SIZE): a process's
    threads past its share only queue for its GIL. `threads`: the plan's own limit on the default (WritePlan.threads)."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, workers or min(4, (os.cpu_count() or 1) // local, threads or 4))


def write_files(
    write: Write, files: list[tuple[Path, OutputFile]], workers: int, progress: Progress | None, take: Take | None = None
) -> list[tuple[Path, OutputFile]]:
    """Create `files` through the write transaction, up to `workers` at once, then sync them. A local file takes
    positional writes, and with fewer files than workers the spare workers share its large CRC-bearing tensors (one
    big DeepSpeed optimizer file, say); an object takes its bytes in order. Every source zip record read is checked
    against its CRC32 (DataError before anything is committed). `take` gives the position of the next file to
    write, shared with other processes under torchrun (each writes the files it takes); the files written here
    are returned."""

    def write_one(target: Path, out: OutputFile, tick: Progress, threads: int, cancel: threading.Event, check: RecordCheck) -> None:
        if out.fill is not None:  # written by a library into the temporary destination (local only)
            sources = SourceFiles(check)
            try:
                out.fill(target, tick, sources)
            finally:
                sources.close()
            return
        if out.stream is not None:  # its parts as batches of one literal each
            write_batches(write, target, out, ([Literal(part)] for part in out.stream()), tick, check)
            return
        batches = getattr(out.build, "batches", None)
        if batches is not None and out.sizes is not None and threads == 1:
            write_batches(write, target, out, batches(), tick, check)
            return
        segments = made(out, check)  # first: a built file's size is known once its segments are made
        sink = write.create(target, out.size, tick)
        try:
            if sink.fd is not None:
                write_file(sink.fd, out, segments, tick, threads, cancel, check)
            else:
                write_in_order(segments, sink, check, (shared, order[id(out)]) if shared is not None else None)
            interrupt.check()  # a SIGTERM during the last blocks: complete nothing
            sink.commit()
        except BaseException:
            sink.abort()
            raise

    check = source_records(files)
    shared = shared_reads(write, files, workers) if take is None else None
    order = {id(out): k for k, (_, out) in enumerate(files)}
    if take is None and source_order.applies(write, files):
        planned = source_order.plan_jobs(files, check)
        if planned is not None:
            cancel = threading.Event()
            source_order.write_sorted(write, files, *planned, workers, ticker(cancel, progress), cancel, check)
            check.finish()  # records copied only in part: read the rest and compare
            write.sync()
            return files
    try:
        written = _write_all(files, workers, progress, write_one, take, check)
    finally:
        forget_kept()  # (what source order made and did not use, once every file has taken its own)
    write.sync()  # once all are written (the kernel wrote back while the next file was made), before the commit
    return written


def write_batches(
    write: Write, target: Path, out: OutputFile, batches: Iterable[list[Segment]], tick: Progress, check: RecordCheck
) -> None:
    """A file whose segments come in batches (each self-contained: a DCP rank file's chunk archives, a streamed
    file's parts), written in order one batch at a time: a rank file of 70,000 chunks held every chunk's segments at
    once (+100 MB), `.metadata` its whole pickle. A planned size is checked; otherwise it is known once written. The
    source records are learnt batch by batch."""
    sink = write.create(target, out.sizes.total if out.sizes else STREAM_HINT, tick)
    sources = SourceFiles(check)
    names: list[str] = []
    try:
        local = FileSink(sink.fd, 0, advancer(sink.fd, tick), buffered=True) if sink.fd is not None else None
        written = 0
        for batch in batches:
            tensors = [s.tensor for s in batch if isinstance(s, TensorData)]
            check.learn(records(tensors))
            names += [sys.intern(t.name) for t in tensors]
            sources.expect((file_runs(batch) if local is None else []) or direct_runs(batch))
            write_segments(batch, local or sink, sources)
            written += sum(seg.size for seg in batch)
            del batch
            heap.give_back_when_grown()  # what the batches' segments took, or RSS climbs through a wide write
        if local is not None:
            local.flush()
        written = local.offset if local is not None else written
        assert out.sizes is None or written == out.size, f"{out.relpath}: wrote {written} bytes, planned {out.size}"
        interrupt.check()  # a SIGTERM during the last blocks: complete nothing
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    finally:
        sources.close()
    if out.sizes is None:
        out.sizes = FileSizes(written, 0, 0)
    if out.names is None:
        out.names = names


STREAM_HINT = 1 << 30  # what an object store's part size is chosen for when a streamed file's size is not known yet


WriteOne = Callable[[Path, OutputFile, Progress, int, threading.Event, RecordCheck], None]


def _write_all(
    files: list[tuple[Path, OutputFile]],
    workers: int,
    progress: Progress | None,
    write_one: WriteOne,
    take: Take | None,
    check: RecordCheck,
) -> list[tuple[Path, OutputFile]]:
    """Run `write_one` on the files `take` gives (by default each in turn), up to `workers` at once; the first
    failure cancels the rest. Returns the files taken."""
    cancel = threading.Event()
    next_file = take or _in_turn()
    taken: list[tuple[Path, OutputFile]] = []
    tick = ticker(cancel, progress)  # called once per block: lets a failing sibling or a SIGTERM stop the others
    threads = max(1, workers // max(1, len(files)))

    def write_taken() -> None:
        while not cancel.is_set():
            i = next_file()
            if i >= len(files):
                return
            taken.append(files[i])
            try:
                write_one(*files[i], tick, threads, cancel, check)
            except BaseException:
                cancel.set()
                raise

    run_together([write_taken] * max(1, min(workers, len(files))), cancel)
    check.finish()  # records copied only in part: read the rest and compare
    return taken


Take = Callable[[], int]  # the position of the next file to write (past the end: none left)


def _in_turn() -> Take:
    """Positions 0, 1, 2, ... to the threads of one process (a lock: two threads never take the same)."""
    lock, count = threading.Lock(), [0]

    def take() -> int:
        with lock:
            count[0] += 1
            return count[0] - 1

    return take


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
    """Write every file of `plan`, data first and the commit markers last, then commit: locally the temporary sibling
    is renamed into place; in object storage the markers were the commit. On an error or interrupt nothing is left:
    the temporary is removed, the objects completed are deleted. `guard` says what --overwrite must keep (default:
    the files the plan reads; only an empty folder is replaced).

    One process only: under torchrun (WORLD_SIZE > 1) the caller uses ckpt_cli.core.write.distributed.execute.
    """
    targets(plan, plan.dest)  # refuse a file name that leaves the destination before anything is created
    # Marked as a write from before the temporary exists: a SIGTERM that lands while it is made is honoured at the
    # first safe point, inside the `try` that removes it (raised at once, it left the temporary behind)
    with interrupt.writing():
        write = store.begin(plan.dest, plan.dest_is_dir, overwrite, default_guard(plan, guard))
        try:
            interrupt.check()
            data, markers = targets(plan, write.root)
            write_files(write, data, worker_count(workers, plan.threads), progress)
            interrupt.check()
            write_files(write, markers, 1, progress)  # last, so they are the newest files
            interrupt.check()  # a SIGTERM during the last blocks: commit nothing
        except BaseException:
            write.abort()
            raise
    write.commit()


def shared_reads(write: Write, files: list[tuple[Path, OutputFile]], workers: int) -> SharedReads | None:
    """The reads the files of an object-store write share (store/shared_reads.py), when their data is in object
    storage and their segments are at hand (not built, streamed or filled); else None."""
    if store.mappable(write.root) or any(out.build is not None or out.stream is not None or out.fill is not None for _, out in files):
        return None
    runs = [remote_runs(file_runs(out.segments)) for _, out in files]
    return SharedReads(runs, workers) if any(runs) else None


def file_runs(segments: list[Segment]) -> list[ByteRun]:
    """The stored bytes a file's tensor data is copied from, in order, when some are in object storage (read
    ahead: store/prefetch.py); [] otherwise, and for data that needs torch (casts, strided pieces)."""
    data = [s for s in segments if isinstance(s, TensorData) and s.tensor.numel]
    if all(store.mappable(a.path) for s in data for a in s.tensor.stored_arrays()):
        return []
    return [run for s in data for run in byte_runs(s.tensor, s.dtype) or []]


def direct_runs(segments: list[Segment]) -> list[ByteRun]:
    """The large runs of local files a file's tensor data is copied from, in order, that the reader reads ahead past
    the page cache (core/direct.py): tensors of DIRECT_BYTES or more whose runs are known without making pieces."""
    data = [s for s in segments if isinstance(s, TensorData) and s.size >= DIRECT_BYTES and not s.tensor.made_by_range()]
    return [run for s in data for run in byte_runs(s.tensor, s.dtype) or [] if store.mappable(run[0])]


def write_in_order(segments: list[Segment], sink: store.File, check: RecordCheck, shared: SharedFile | None = None) -> None:
    """A file's bytes in order into an object (see write_segments); stored data is fetched ahead (`shared`: this
    file's place in the write's shared reads), and data that passes unchanged from an object of the same store is
    copied there (core/write/object_copies.py)."""
    copied = object_copies.planned(segments, sink, check)
    sources = SourceFiles(check)
    runs = file_runs([s for s in segments if id(s) not in copied])
    reader = shared[0].reader(shared[1], remote_runs(runs)) if shared is not None else None
    if reader is not None:
        sources.share(reader)
    else:
        sources.expect(runs)
    try:
        object_copies.write(segments, sink, sources, copied)
    finally:
        sources.close()
