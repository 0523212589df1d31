"""A write's segments as the executor needs them: a built file's made when it is written (and shared between files that
name the same tensors), and the source zip records their data is read from, checked on the way (core/write/crc.py).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from ckpt_cli.core.model import TensorEntry
from ckpt_cli.core.pickles.zipio import Record
from ckpt_cli.core.write.crc import RecordCheck
from ckpt_cli.core.write.plan import FileSizes, OutputFile, Segment, SharedBuild, TensorData, sizes_of


def records(tensors: Iterable[TensorEntry]) -> Iterator[tuple[str, Record]]:
    """The zip records (with their CRC32) the tensors' data is read from."""
    # An empty tensor reads nothing (a ZeRO-3 model-states file's 2,000 placeholders: their records hold no bytes).
    return ((a.path, a.record) for tensor in tensors if tensor.numel for a in tensor.stored_arrays() if a.record is not None)


def source_records(files: list[tuple[Path, OutputFile]]) -> RecordCheck:
    """The check of the zip records the files' tensor data is read from (a built file's are learnt as it is made)."""
    return RecordCheck(records(tensor for _, out in files for tensor in out.tensors()))


_NAME_LISTS: dict[tuple[str, ...], tuple[str, ...]] = {}  # the last few distinct lists of names
_NAME_LOCK = threading.Lock()  # the writing threads make files at once


def shared_names(names: list[str]) -> tuple[str, ...]:
    """`names` as one tuple shared by the files that name the same tensors, of interned strings: 512 ZeRO-3 rank
    files each name the same 20,000 placeholders (84 MB as lists of their own), 1,024 ranks the same 2,000 tensors."""
    key = tuple(sys.intern(n) for n in names)
    with _NAME_LOCK:
        found = _NAME_LISTS.get(key)
        if found is None:
            if len(_NAME_LISTS) >= 16:
                _NAME_LISTS.pop(next(iter(_NAME_LISTS)))
            found = _NAME_LISTS[key] = key
    return found


def made(out: OutputFile, check: RecordCheck | None) -> list[Segment]:
    """The file's segments; a built file's made now (held only while it is written), its source records learnt."""
    segments = _kept.pop(id(out), None) or out.parts()
    if out.build is not None:
        last = _made.get(id(segments))
        if last is None or last[0] is not segments:  # not the very segments a recent file was made of
            tensors = [s.tensor for s in segments if isinstance(s, TensorData)]
            last = (segments, list(records(tensors)), shared_names([t.name for t in tensors]), sizes_of(segments))
            if isinstance(out.build, SharedBuild):  # kept for the next file only where they are shared: not a DCP file's
                with _NAME_LOCK:
                    if len(_made) >= 4:
                        _made.pop(next(iter(_made)))
                    _made[id(segments)] = last
        if check is not None:
            check.learn(last[1])
        if out.names is None:  # what the write report lists, without making the segments again
            out.names = last[2]
        if out.sizes is None:
            out.sizes = last[3]
    return segments


# The last few shared builds' segments (plan.SharedBuild), with their source records, tensor names and sizes: a list that
# several files are made of (ZeRO-3 model-states files of 2,000 placeholders, between the optimizer files) is walked once.
_made: dict[int, tuple[list[Segment], list[tuple[str, Record]], tuple[str, ...], FileSizes]] = {}


# Built files' segments made for a way of writing that did not apply (core/write/source_order.py), kept for the way that
# does: a built file is made once (a 1,024-rank reshard that made each rank file twice took twice as long).
_kept: dict[int, list[Segment]] = {}


def keep(out: OutputFile, segments: list[Segment]) -> None:
    """Hand `segments` to the next `made(out)` instead of making them again."""
    if out.build is not None:
        _kept[id(out)] = segments


def forget_kept() -> None:
    _kept.clear()
