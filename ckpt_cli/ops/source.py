"""Opening a checkpoint: resolve the path once (ops/resolve: a run root, a run checkpoint, a core format and its tag),
read its metadata, choose among a run root's checkpoints (the newest complete one, or --tag's), note the choices made."""

from __future__ import annotations

from pathlib import Path

from ckpt_cli.core import heap
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint
from ckpt_cli.errors import DataError
from ckpt_cli.formats import registry
from ckpt_cli.formats.runs import read as run_read
from ckpt_cli.ops.resolve import Found, Resolved, relative, resolve
from ckpt_cli.ops.structure import structure_problems


def open_checkpoint(
    path: str | Path | Resolved,
    format: str | None = None,
    tag: str | None = None,
    trust_pickle: bool = False,
    layout_only: bool = False,
    pieces_when_read: bool = False,
    predicted_chunks: bool = False,
) -> Checkpoint:
    """Read a checkpoint's metadata (no tensor data) from any supported format or framework run folder; `layout_only`:
    what inspect reports, no more, `pieces_when_read` and `predicted_chunks` (ReadOptions), for a checkpoint named directly. `path`: a
    path string, or the value resolve() made of one (then `format` and `tag` are those it was resolved with)."""
    with heap.collector_paused():  # the read's objects are not garbage: see heap.collector_paused
        resolved = path if isinstance(path, Resolved) else resolve(path, format, tag)
        ckpt = open_resolved(resolved, trust_pickle, layout_only, pieces_when_read, predicted_chunks)
    heap.read_done()
    return ckpt


def open_resolved(
    resolved: Resolved, trust_pickle: bool, layout_only: bool = False, pieces_when_read: bool = False, predicted_chunks: bool = False
) -> Checkpoint:
    """Read what `resolved` names, detecting nothing again: a run root's chosen checkpoint (read whole: the newest
    *complete* one is chosen), a run checkpoint, or a checkpoint of a core format (which detection found or --format
    named: `forced`) with the notes of its tag and of the run checkpoint it is one part of."""
    if resolved.level == "root":
        return choose(resolved, trust_pickle)
    if resolved.run is not None:
        return run_read.read(resolved.run, ReadOptions(tag=resolved.tag, trust_pickle=trust_pickle, layout_only=layout_only))
    fmt = resolved.format
    assert fmt is not None  # levels checkpoint and tagged always have one
    path, fmt, tag = registry.tagged(resolved.location, fmt, resolved.tag, resolved.forced)
    ckpt = fmt.reader.read(path, ReadOptions(tag, trust_pickle, layout_only, pieces_when_read, predicted_chunks))
    if tag and not ckpt.tag:
        ckpt.tag = tag
    if resolved.note:
        ckpt.notes.append(resolved.note)
    return ckpt


def open_found(found: Found, tag: str | None, trust_pickle: bool) -> Checkpoint:
    """The checkpoint `found` names, read whole as detection found it (nothing is detected again): a run checkpoint
    read with its parts and companions, or one of a core format (`tag`: one of its own tags)."""
    fmt = registry.get(found.format) if found.run is None else None
    return open_resolved(Resolved(found.path, "checkpoint" if fmt else "run", fmt, run=found.run, tag=tag), trust_pickle)


CHOSEN = "(ckpt ls lists them); using '"  # in the note choose() adds


def choice_notes(ckpt: Checkpoint) -> list[str]:
    """The notes choose() added: which checkpoint of a run root was taken (and which were skipped), for the commands
    that show no other note of the reader's (verify)."""
    return [n for n in ckpt.notes if CHOSEN in n or n.startswith("skipped '")]


def choose(resolved: Resolved, trust_pickle: bool) -> Checkpoint:
    """The checkpoint of a run root that `--tag` named (resolve), else the newest complete one of its candidates: the
    one rule that `ckpt ls` marks, with a note naming the choice and how to pick another."""
    root, found = resolved.location, resolved.members
    if resolved.chosen is not None:
        ckpt = open_found(resolved.chosen, None, trust_pickle)
        ckpt.tag = ckpt.tag or relative(resolved.chosen, root)
        return ckpt
    skipped: list[str] = []
    for candidate in resolved.candidates:
        try:
            ckpt = open_found(candidate, None, trust_pickle)  # a full read: its structure decides
            problems = structure_problems(ckpt)
        except DataError as exc:
            problems = [str(exc)]
        if problems:
            skipped.append(f"skipped '{relative(candidate, root)}', incomplete or damaged: {problems[0]}")
            continue
        ckpt.tag = ckpt.tag or relative(candidate, root)
        how = "the newest complete one" if skipped else "the newest"
        several = resolved.runs_in_root > 1
        where = f" in {resolved.runs_in_root} runs" if several else ""
        how += " of those directly in it" if several else ""
        ckpt.notes.insert(
            0,
            f"{root}: {len(found)} checkpoints{where} {CHOSEN}{relative(candidate, root)}', {how}; --tag PATH picks another",
        )
        ckpt.notes[1:1] = skipped
        return ckpt
    raise DataError(f"{root}: none of its {len(found)} checkpoints is complete; {skipped[0]}")
