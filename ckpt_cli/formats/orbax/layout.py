"""Where an Orbax save's parts lie, as orbax-checkpoint's CheckpointManager, Checkpointer and PyTree handlers write them.

    ROOT/                         a CheckpointManager's directory: one folder per step (name: the step, or prefix_step)
      7/                          a step folder: _CHECKPOINT_METADATA, commit_success.txt, one folder per item
        state/                    an item folder (PyTree/StandardCheckpointHandler): _METADATA, _sharding,
                                  array_metadatas/process_N, commit_success.txt, and the arrays: OCDBT
                                  (manifest.ocdbt, d/, ocdbt.process_N/) or one zarr folder per array
      8.orbax-checkpoint-tmp/     a save not committed yet (renamed to 8/ once every item is written)

A Checkpointer without a manager writes one item folder directly (what `StandardCheckpointer().save(path, tree)` makes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ckpt_cli.errors import DataError

TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax/checkpoint/_src/path/atomicity_types.py TMP_DIR_SUFFIX
COMMIT = "commit_success.txt"  # atomicity_types.COMMIT_SUCCESS_FILE: written last, before the rename
TREE_METADATA = "_METADATA"  # format_utils.PYTREE_METADATA_FILE
STEP_METADATA = "_CHECKPOINT_METADATA"  # metadata/checkpoint.py
SHARDING = "_sharding"  # metadata/sharding.py
ARRAY_METADATAS = "array_metadatas"  # metadata/array_metadata_store.py: one file per process, process_N
MANIFEST = "manifest.ocdbt"
PROCESS_DIR = re.compile(r"ocdbt\.process_(\d+)")  # ocdbt_process_spec.PROCESS_PREFIX + index


def is_item(path: Path) -> bool:
    """An item folder: its tree metadata, or the OCDBT files of one."""
    return (path / TREE_METADATA).is_file() or (path / MANIFEST).is_file()


def items_of(step: Path) -> list[Path]:
    """The item folders of a step folder, by name."""
    try:
        return sorted(p for p in step.iterdir() if p.is_dir() and not p.name.startswith(".") and is_item(p))
    except OSError:
        return []


def is_step(path: Path) -> bool:
    return (path / STEP_METADATA).is_file() or bool(items_of(path))


def unfinished(path: Path) -> bool:
    return TMP_SUFFIX in path.name


@dataclass(frozen=True)
class Save:
    """One save: the folder named (a step folder, or an item folder written by a Checkpointer alone), its items, and
    the step its folder name gives."""

    folder: Path
    items: tuple[Path, ...]
    step: int | None
    is_step: bool


def step_of(name: str) -> int | None:
    """CheckpointManager's step folder names: `7`, or `<prefix>_7` with step_prefix (orbax path/step.py)."""
    found = re.fullmatch(r"(?:.*_)?(\d+)", name)
    return int(found.group(1)) if found else None


def open_save(path: Path) -> Save:
    """The save at `path`, refused (DataError naming the folder or marker) when a save did not commit: a temporary
    folder, or a folder without commit_success.txt, which Orbax writes after every other file of it."""
    for folder in (path, *path.parents[:1]):
        if unfinished(folder):
            final = folder.name[: folder.name.index(TMP_SUFFIX)]
            raise DataError(
                f"{folder}: an unfinished Orbax save (a temporary folder that Orbax renames to '{final}' once the save "
                "commits): the save was interrupted or is still running; read a committed step"
            )
    if is_item(path):
        items: tuple[Path, ...] = (path,)
        step = step_of(path.parent.name) if (path.parent / STEP_METADATA).is_file() else None
        own = False
    else:
        items, step, own = tuple(items_of(path)), step_of(path.name), True
        if not items:
            raise DataError(f"{path}: an Orbax step folder with no item folder (no {TREE_METADATA} below it)")
        if not (path / COMMIT).is_file():
            raise DataError(f"{path / COMMIT}: missing: this Orbax save never committed (Orbax writes it after every other file)")
    for item in items:
        if not (item / COMMIT).is_file():
            raise DataError(f"{item / COMMIT}: missing: this Orbax item was never committed (Orbax writes it after every other file)")
        for inner in item.iterdir():
            if unfinished(inner):
                raise DataError(f"{inner}: an unfinished Orbax write inside a committed item")
    return Save(path, items, step, own)


def processes(item: Path, use_ocdbt: bool) -> int:
    """How many processes wrote the item: their OCDBT folders (ocdbt.process_N), else their array metadata files."""
    if use_ocdbt:
        found = [p for p in item.iterdir() if p.is_dir() and PROCESS_DIR.fullmatch(p.name)]
        if found:
            return len(found)
    meta = item / ARRAY_METADATAS
    return len([p for p in meta.iterdir() if p.name.startswith("process_")]) if meta.is_dir() else 1
