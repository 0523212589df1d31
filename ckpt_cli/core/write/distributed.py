"""One conversion spread over many processes and hosts with torchrun (SPEC §6).

Every rank plans the same output (plans are deterministic); the ranks take the data files one at a
time from a counter in torchrun's key-value store (`_claims`), whoever is free first, and write them
into one temporary folder beside the destination (which all hosts must see: a shared filesystem).
Rank 0 writes the commit markers (DCP .metadata, hf index, DeepSpeed latest) into it first, while the
others write data; after all ranks report success, it renames the folder into place. A failure on any rank
removes the temporary folder on every rank's behalf and fails them all. The result is
byte-identical to a single-process run.

A destination in object storage needs no shared filesystem: each rank uploads the data objects it
takes, and rank 0 uploads the commit markers once every rank's uploads have completed. A failure on any
rank makes every rank delete the objects it completed (in-flight uploads are aborted), so no
marker is written and nothing is left.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TypeVar

from ckpt_cli import interrupt, store
from ckpt_cli.core.write.executor import Take, default_guard, targets, worker_count, write_files
from ckpt_cli.core.write.plan import FileSizes, OutputFile, WritePlan
from ckpt_cli.core.write.sinks import Progress
from ckpt_cli.errors import CkptError, DataError
from ckpt_cli.store import Guard

T = TypeVar("T")
RANKS = "ranks"  # the owner that names the one temporary folder the ranks of a torchrun job share


def rank_and_world() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else None


def _all_ok(ok: bool) -> bool:
    """True when every rank is ok (an all-reduce of a flag; doubles as a barrier)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def share(files: list[T], rank: int, world: int) -> list[T]:
    """Rank's part of the files: a contiguous block. Writers list a rank's files together (DeepSpeed stage 3: model
    states, optimizer states, then the next rank's), so every other file (files[rank::world]) gave one process all
    the small model-states files and the other all the optimizer files: 2 processes were 1.4x faster than one."""
    return files[rank * len(files) // world : (rank + 1) * len(files) // world]


def _share_sizes(plan: WritePlan, mine: list[OutputFile]) -> None:
    """Tell every rank the sizes of the files the others made (a built file's size is known once made): the report of
    what was written then needs no rank to make another's files again."""
    import torch.distributed as dist

    index = {id(f): i for i, f in enumerate(plan.files)}
    sizes = [(index[id(f)], f.sizes) for f in mine if f.sizes is not None]
    gathered: list[list[tuple[int, FileSizes]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sizes)
    for told in gathered:
        for i, known in told or []:
            if plan.files[i].sizes is None:
                plan.files[i].sizes = known


def execute(
    plan: WritePlan, overwrite: bool = False, progress: Progress | None = None, workers: int | None = None, guard: Guard | None = None
) -> None:
    """Write this rank's share of the plan; rank 0 commits once every rank has succeeded (call it under
    torchrun, where rank_and_world() is not None; executor.execute is the one-process counterpart)."""
    import torch.distributed as dist

    context = rank_and_world()
    assert context is not None
    rank, world = context
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    try:
        _execute(plan, overwrite, progress, worker_count(workers, plan.threads), rank, world, default_guard(plan, guard))
    finally:
        if owned:
            dist.destroy_process_group()


def _execute(plan: WritePlan, overwrite: bool, progress: Progress | None, workers: int, rank: int, world: int, guard: Guard) -> None:
    targets(plan, plan.dest)  # every rank refuses a file name that leaves the destination, before anything is created
    # Marked as a write from before rank 0 makes the temporary: a SIGTERM that lands meanwhile is honoured inside
    # the `try` below, which removes it
    with interrupt.writing():
        write: store.Write | None = None
        error: BaseException | None = None
        if rank == 0:
            try:
                write = store.begin(plan.dest, plan.dest_is_dir, overwrite, guard, owner=RANKS)
            except CkptError as exc:
                error = exc
        if not _all_ok(error is None):
            raise error or DataError(f"{plan.dest}: rank 0 could not prepare the destination")
        if write is None:
            write = store.join(plan.dest, RANKS)
        data, markers = targets(plan, write.root)
        take = _claims(world)
        # Where the commit is a rename, rank 0 writes the markers first, into the temporary folder nobody reads before
        # the rename, while the other ranks take data files; in object storage they stay the last objects written.
        early = rank == 0 and store.renames(plan.dest)
        mine: list[tuple[Path, OutputFile]] = []
        try:
            interrupt.check()
            if early:
                write_files(write, markers, 1, progress)
            mine = write_files(write, data if take else share(data, rank, world), workers, progress, take)
            interrupt.check()
        except BaseException as exc:  # report to the other ranks before failing
            error = exc
        if _all_ok(error is None) and rank == 0:
            try:
                if early:  # still the newest files, as a one-process write leaves them
                    for target, _ in markers:
                        os.utime(target)
                else:
                    write_files(write, markers, 1, progress)
            except BaseException as exc:
                error = exc
        if not _all_ok(error is None):  # the temporary removed, every rank's completed objects deleted
            write.abort()
            raise error or DataError(f"{plan.dest}: another rank failed while writing; nothing was written")
    if rank == 0:
        write.commit()
    # Also the barrier: no rank returns before the destination exists. The markers' sizes too: a built marker (DCP
    # .metadata) is made by rank 0 alone.
    _share_sizes(plan, [out for _, out in mine + (markers if rank == 0 else [])])


_ROUNDS = [0]  # writes this process has made under torchrun: every rank makes the same, so the counters' keys agree


def _claims(world: int) -> Take | None:
    """The next data file for whichever rank is free first: a counter in torchrun's own key-value store, shared by
    the ranks' threads. A fixed split left rank 1 idle while rank 0 pickled a wide `.metadata` alone (docs/scale.md).
    None where the store cannot be reached (each rank then takes a fixed block)."""
    import torch.distributed as dist

    _ROUNDS[0] += 1
    try:
        kv = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    key, lock = f"ckpt/files/{_ROUNDS[0]}", threading.Lock()

    def take() -> int:
        with lock:
            return int(kv.add(key, 1)) - 1

    return take


def is_main_process() -> bool:
    context = rank_and_world()
    return context is None or context[0] == 0
