"""Tensor data that passes unchanged from one object to another of the same store, copied by the store itself.

An output object's tensor data whose bytes are stored bytes of an object in the destination's own store (no cast,
no CRC wanted by the output, no source record still to check against its CRC32) is handed to the object's writer as
byte ranges (`copy`) instead of bytes: S3 copies them with UploadPartCopy or CopyObject, Azure a whole blob with Copy
Blob From URL (store/parts.py), so they never pass through this process. The rest of the file streams as before; so
does all of it where the store copies whole objects only (Azure) and the file cannot be one (its data from several
objects, or not all of it copyable): a held range the store cannot copy is fetched range by range, with no reads ahead
across them.
Data whose source records carry a CRC32 (torch zips, DCP chunks, DeepSpeed rank files) is never copied unseen: reading
it is how a damaged source is refused.
"""

from __future__ import annotations

from typing import Any

from ckpt_cli.core.model import ZEROS
from ckpt_cli.core.reading import ByteRun, SourceFiles, byte_runs
from ckpt_cli.core.write.crc import RecordCheck
from ckpt_cli.core.write.plan import Deferred, Segment, TensorData
from ckpt_cli.core.write.sinks import write_segments
from ckpt_cli.store import predicted


def planned(segments: list[Segment], sink: Any, check: RecordCheck | None) -> dict[int, list[ByteRun]]:
    """id(segment) -> its byte runs, for the segments the sink's store copies on its side ({} where it copies none:
    a local file, another store, or a file with CRC-dependent trailers, which need every byte seen)."""
    copies = getattr(sink, "copies", None)
    if copies is None or any(isinstance(s, Deferred) for s in segments):
        return {}
    found: dict[int, list[ByteRun]] = {}
    for seg in segments:
        if not isinstance(seg, TensorData) or seg.crc_key is not None or not seg.tensor.numel:
            continue
        runs = byte_runs(seg.tensor, seg.dtype)
        if runs and all(p != ZEROS and copies(p) and not _checked_when_read(check, p, o, n) for p, o, n in runs):
            found[id(seg)] = runs
    if not getattr(sink, "copies_ranges", False) and not whole_object(segments, found):
        return {}  # a store that copies whole objects only: the rest streams, fetched ahead across the file's runs
    return found


def _checked_when_read(check: RecordCheck | None, path: str, offset: int, nbytes: int) -> bool:
    """Whether bytes of a source are checked as they pass: a record's CRC32, or an item laid out by prediction (whether
    or not another file's read checked it already: what a write reads is planned before it starts)."""
    return (check is not None and check.wants(path, offset, nbytes)) or predicted.laid_out(path, offset, offset + nbytes)


def whole_object(segments: list[Segment], found: dict[int, list[ByteRun]]) -> bool:
    """Whether the file may be one source object whole: all its tensor data copied, from one object."""
    tensors = [s for s in segments if isinstance(s, TensorData) and s.tensor.numel]
    return bool(tensors) and len(found) == len(tensors) and len({p for runs in found.values() for p, _, _ in runs}) == 1


def write(segments: list[Segment], sink: Any, sources: SourceFiles, copied: dict[int, list[ByteRun]]) -> None:
    """The file's bytes in order: the copied segments as ranges, the others through write_segments."""
    if not copied:
        write_segments(segments, sink, sources)
        return
    for seg in segments:
        runs = copied.get(id(seg))
        if runs is None:
            write_segments([seg], sink, sources)
            continue
        for path, offset, nbytes in runs:
            sink.copy(path, offset, nbytes)
