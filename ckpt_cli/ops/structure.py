"""The structural checks (metadata only, no tensor data): what `verify` always runs and what every writing command
runs on its source first. A run checkpoint (formats/runs/detect.py) is checked part by part and companion by companion."""

from __future__ import annotations

from ckpt_cli import store
from ckpt_cli.core.model import ZEROS, Checkpoint, LazyPieces
from ckpt_cli.errors import DataError
from ckpt_cli.formats import registry
from ckpt_cli.formats.runs import read as run_read
from ckpt_cli.ops import quantized


def format_check(ckpt: Checkpoint, deep: bool) -> list[str]:
    """The format's own checks (a run checkpoint: every part's and every companion's)."""
    if run_read.is_run(ckpt):
        return run_read.check(ckpt, deep)
    return registry.get(ckpt.format).reader.check(ckpt, deep)


def format_notes(ckpt: Checkpoint) -> list[str]:
    """What the format's checks suspect and cannot decide (a reader's optional `notes`): shown, never a problem."""
    if run_read.is_run(ckpt):
        return [note for _, part in ckpt.source.parts for note in format_notes(part)]
    notes = getattr(registry.get(ckpt.format).reader, "notes", None)
    return notes(ckpt) if notes is not None else []


def has_checksums(ckpt: Checkpoint) -> bool:
    """Whether a deep format check reads every tensor byte against a checksum (else verify --deep hashes them)."""
    if run_read.is_run(ckpt):
        return all(registry.get(part.format).has_checksums for part, _ in ckpt.source.parts)
    return registry.get(ckpt.format).has_checksums


def file_and_tiling_problems(ckpt: Checkpoint) -> list[str]:
    """Files present at their recorded sizes; pieces tile tensors; pieces inside their files."""
    problems: list[str] = []
    sizes: dict[str, int] = {}
    for info in ckpt.files:
        try:
            sizes[info.path] = store.size(info.path)
        except OSError:
            problems.append(f"{info.path}: missing")
            continue
        if sizes[info.path] != info.bytes:
            problems.append(f"{info.path}: size {sizes[info.path]} differs from the {info.bytes} bytes recorded")
    for t in ckpt.tensors.values():
        if isinstance(t.pieces, LazyPieces) and t.pieces.by_layout:
            continue
        try:  # lazily made pieces read their rank's file now: a short or missing record is one more problem
            problem = t.tiling_problem()
        except DataError as exc:
            problems.append(str(exc))
            continue
        if problem:
            problems.append(f"{ckpt.path}: tensor '{t.name}': {problem}")
        for piece in t.pieces:
            array = piece.data
            if array.path == ZEROS:
                continue
            size = sizes.get(array.path)
            if size is None:
                size = store.size(array.path) if store.exists(array.path) else -1
                sizes[array.path] = size
            _, end = array.extent()
            if size < 0:
                problems.append(f"{array.path}: missing (holds tensor '{t.name}')")
            elif end > size:
                problems.append(f"{array.path}: tensor '{t.name}' needs bytes up to {end} but the file has {size} (truncated)")
    return problems


def structure_problems(ckpt: Checkpoint) -> list[str]:
    """What verify without --deep finds (files, tiling, the format's own checks): metadata only, no tensor data
    read. Writing commands refuse a source with any (ops/convert.py prepare)."""
    problems = file_and_tiling_problems(ckpt)
    try:
        problems += format_check(ckpt, False)
    except DataError as exc:
        problems.append(str(exc))
    return problems + quantized.problems(ckpt, False)  # a quantized weight without its scales is broken too
