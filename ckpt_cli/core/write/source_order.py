"""A write of local files whose tensor data is copied in the order the sources hold it, not file by file.

Why: a DCP file for one of 4 ranks holds a quarter of every tensor. Written file by file, each thread reads a quarter,
skips three, reads the next quarter: the kernel's read-ahead fetches what the thread skips, and under a memory limit
smaller than the checkpoint those pages are reclaimed before another thread comes to them (8 GB hf -> DCP at 4 ranks
under 1 GB: 1.3-1.5x `cp -r` + `sync` of the same bytes). Here every output file is opened at once and its literal
bytes written; then the tensor segments of all files, sorted by where their bytes are stored, are handed out in
groups, so that each thread reads one source file (or GROUP_BYTES of it) front to back and puts each piece at its
planned offset in its output file (the same bytes, the same safety: 0.9-1.0x the copy). One file too: a merged file
lists its tensors in name order, which the shards do not (layers.10 before layers.2: merge 1.04-1.21x -> 1.02-1.05x;
one thread a file, as two in one file only queue for its inode lock). The CRC-bearing trailers
(Deferred) follow once every segment is copied. It applies where every file's segments are plain stored bytes of local
files and not many (MAX_SEGMENTS: a wide write makes its files' segments one file at a time instead).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ckpt_cli import interrupt, store
from ckpt_cli.core.model import ZEROS
from ckpt_cli.core.reading import ByteRun, SourceFiles, byte_runs
from ckpt_cli.core.write.crc import RecordCheck, crc32_combine
from ckpt_cli.core.write.plan import Deferred, Literal, OutputFile, Segment, TensorData
from ckpt_cli.core.write.segments import keep, made
from ckpt_cli.core.write.sinks import FileSink, Progress, advancer, copy_runs
from ckpt_cli.store import Write

MAX_FILES = 256  # output files open at once
MAX_SEGMENTS = 20_000  # segments held at once (about 1.4 KB each)
GROUP_BYTES = 512 << 20  # a thread's share of one source file, read front to back


class Cancelled(Exception):
    """A write stopped because a sibling thread failed (the sibling's error is the one raised)."""


def ticker(cancel: threading.Event, progress: Progress | None) -> Progress:
    """What each block written calls: stops the thread when a sibling failed or a SIGTERM came, then reports progress."""
    lock = threading.Lock()

    def tick(nbytes: int) -> None:
        if cancel.is_set():
            raise Cancelled
        interrupt.check()
        if progress:
            with lock:
                progress(nbytes)

    return tick


def run_together(calls: list[Callable[[], None]], cancel: threading.Event) -> None:
    """Run the calls, each on a thread of its own (the one call on this thread); the first failure sets `cancel`, so
    the others stop at their next block, and the cause is raised, not a Cancelled."""
    if len(calls) == 1:
        calls[0]()
        return
    failures: list[BaseException] = []
    with ThreadPoolExecutor(len(calls)) as pool:
        for future in [pool.submit(call) for call in calls]:
            try:
                future.result()
            except BaseException as exc:
                cancel.set()
                failures.append(exc)
    if failures:
        raise next((e for e in failures if not isinstance(e, Cancelled)), failures[0])


@dataclass
class _Job:
    run: ByteRun  # stored bytes of one source file, in the order of the run list of its segment
    file: int  # index of its output file
    offset: int  # where they go in it
    crc: tuple[str, int] | None  # (its segment's crc_key, the run's place in the segment) where a CRC32 is wanted


def applies(write: Write, files: list[tuple[Path, OutputFile]]) -> bool:
    """Whether the files may be written in source order (before any segment is made)."""
    return 0 < len(files) <= MAX_FILES and store.mappable(write.root) and all(out.fill is None and out.stream is None for _, out in files)


def plan_jobs(files: list[tuple[Path, OutputFile]], check: RecordCheck) -> tuple[list[list[Segment]], list[_Job]] | None:
    """Every file's segments, and their tensors' byte runs as jobs in source order; None where a tensor is not plain
    stored bytes of local files (a cast, a computed tensor, an object) or the segments and runs pass MAX_SEGMENTS."""
    made_segments: list[list[Segment]] = []
    jobs: list[_Job] = []
    held = 0  # segments made
    for index, (_, out) in enumerate(files):
        if held + len(jobs) + _tensor_count(out) > MAX_SEGMENTS:  # before making them (held through the write)
            _not_planned(files, made_segments)
            return None
        segments = made(out, check)
        made_segments.append(segments)
        held += len(segments)
        pos = 0
        for seg in segments:
            if isinstance(seg, TensorData) and seg.tensor.numel:
                # (a tensor of a 1,024-rank DCP is 1,024 runs: counted as they come, before they are many)
                runs = None if seg.tensor.made_by_range() or held + len(jobs) > MAX_SEGMENTS else byte_runs(seg.tensor, seg.dtype)
                local = runs and all(path != ZEROS and store.mappable(path) for path, _, _ in runs)
                if not runs or not local or held + len(jobs) + len(runs) > MAX_SEGMENTS:
                    _not_planned(files, made_segments)
                    return None
                at = pos
                for part, run in enumerate(runs):
                    jobs.append(_Job(run, index, at, None if seg.crc_key is None else (seg.crc_key, part)))
                    at += run[2]
            pos += seg.size
        assert pos == out.size, f"{out.relpath}: {pos} bytes of segments, planned {out.size}"
    if not jobs:  # (an index, a marker: nothing to order)
        _not_planned(files, made_segments)
        return None
    jobs.sort(key=lambda job: (job.run[0], job.run[1], job.file, job.offset))
    return made_segments, jobs


def _tensor_count(out: OutputFile) -> int:
    """The tensors a file holds, where known without making its segments (a DCP rank file of 70,000 chunks is written
    in batches instead: made whole here, its segments would be held through the write, +100 MB); else 0."""
    if out.build is None:
        return len(out.segments)
    if out.names is not None:
        return len(out.names)
    told = getattr(out.build, "tensor_names", None)
    return len(told()) if told is not None else 0


def _not_planned(files: list[tuple[Path, OutputFile]], made_segments: list[list[Segment]]) -> None:
    """The files made so far keep their segments for the file-by-file write (made once: segments.keep)."""
    for (_, out), segments in zip(files, made_segments):
        keep(out, segments)


def groups(jobs: list[_Job]) -> list[list[_Job]]:
    """Consecutive jobs of one source file, up to about GROUP_BYTES each: what one thread reads front to back."""
    out: list[list[_Job]] = []
    held = 0
    for job in jobs:
        if not out or job.run[0] != out[-1][0].run[0] or held >= GROUP_BYTES:
            out.append([])
            held = 0
        out[-1].append(job)
        held += job.run[2]
    return out


def write_sorted(
    write: Write,
    files: list[tuple[Path, OutputFile]],
    segments: list[list[Segment]],
    jobs: list[_Job],
    workers: int,
    tick: Progress,
    cancel: threading.Event,
    check: RecordCheck,
) -> None:
    """Create the files, write their literal bytes, copy the jobs' tensors group by group on `workers` threads, then
    write each file's CRC-bearing trailers and complete it. On an error every file is aborted (nothing completes)."""
    sinks: list[store.File] = []
    try:
        fds: list[int] = []
        advances: list[Progress] = []
        for (target, out), parts in zip(files, segments):
            sinks.append(sink := write.create(target, out.size, tick))
            assert sink.fd is not None, "a local destination gives descriptors"
            fds.append(sink.fd)
            advances.append(advancer(sink.fd, tick))
            pos = 0
            for seg in parts:
                if isinstance(seg, Literal):
                    FileSink(sink.fd, pos, advances[-1]).write(seg.data)
                pos += seg.size
        crcs = _copy(groups(jobs), fds, advances, workers, cancel, check)
        for index, parts in enumerate(segments):
            pos = 0
            for seg in parts:
                if isinstance(seg, TensorData) and not seg.tensor.numel and seg.crc_key is not None:
                    crcs[index][seg.crc_key] = 0
                if isinstance(seg, Deferred):
                    data = seg.build(crcs[index])
                    assert len(data) == seg.size, "deferred segment size differs from its plan"
                    FileSink(fds[index], pos, advances[index]).write(data)
                pos += seg.size
        interrupt.check()  # a SIGTERM during the last blocks: complete nothing
        while sinks:
            sinks.pop(0).commit()
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise


def _copy(
    work: list[list[_Job]], fds: list[int], advances: list[Progress], workers: int, cancel: threading.Event, check: RecordCheck
) -> list[dict[str, int]]:
    """Run the groups on up to `workers` threads (each with its own source descriptors and read-ahead); the CRC32 of
    each CRC-bearing segment, by file and crc_key, combined from its runs' (an empty tensor's is added by the caller)."""
    parts: list[dict[str, list[tuple[int, int, int]]]] = [{} for _ in fds]  # crc_key -> (place, CRC32, bytes) of its runs
    lock = threading.Lock()
    threads = max(1, min(workers, len(work), len(fds)))  # (two threads in one file only queue for its inode lock)
    shares = _shares(work, threads)

    def run(share: list[list[_Job]]) -> None:
        sources = SourceFiles(check)
        try:
            for group in share:
                if cancel.is_set():
                    return
                if len(sources.fds) > 16:  # a thousand source shards read by one thread: their descriptors let go
                    sources.close()
                    sources = SourceFiles(check)
                sources.expect([job.run for job in group])
                sink, end = None, (-1, -1)  # one buffered sink while the runs land one after the other in one file
                for job in group:
                    if sink is None or (job.file, job.offset) != end:
                        if sink is not None:
                            sink.flush()
                        sink = FileSink(fds[job.file], job.offset, advances[job.file], buffered=True)
                    crc = copy_runs([job.run], sink, sources, job.crc is not None)
                    end = (job.file, job.offset + job.run[2])
                    if job.crc is not None:
                        with lock:
                            parts[job.file].setdefault(job.crc[0], []).append((job.crc[1], crc, job.run[2]))
                if sink is not None:
                    sink.flush()
        except BaseException:
            cancel.set()
            raise
        finally:
            sources.close()

    run_together([partial(run, share) for share in shares], cancel)
    return [{key: _combined(runs) for key, runs in by_key.items()} for by_key in parts]


def _shares(work: list[list[_Job]], threads: int) -> list[list[list[_Job]]]:
    """The groups cut into `threads` consecutive shares of about equal bytes: the threads read parts of the sources far
    apart, and so mostly write different files (a DCP reshard 4 -> 3 whose threads took neighbouring groups both wrote
    the first rank file, queueing for its inode lock)."""
    total = sum(job.run[2] for group in work for job in group)
    shares: list[list[list[_Job]]] = [[]]
    held = 0
    for group in work:
        if held >= total * len(shares) / threads and len(shares) < threads:
            shares.append([])
        shares[-1].append(group)
        held += sum(job.run[2] for job in group)
    return shares


def _combined(runs: list[tuple[int, int, int]]) -> int:
    """One CRC32 of a segment's runs, in their order."""
    runs.sort()
    crc = runs[0][1]
    for _, part, nbytes in runs[1:]:
        crc = crc32_combine(crc, part, nbytes)
    return crc
