"""One resolve: a path string (with --format and --tag) becomes one frozen value, from names and magic bytes alone
(nothing is read): its store location, what level it is (a checkpoint, a tag folder of a format with tags of its own,
a run checkpoint of a framework, a run root holding several), its format row, the run checkpoint or run root, the
checkpoints a run root holds and the one --tag names. inspect, open, verify, diff and every writer open through it
(ops/source.open_resolved, which chooses among a run root's checkpoints), and each folder or file it looks at is
detected once per call. The walk under a run root (find) is here alone; ops/runs.listing (`ckpt ls`) reads its rows."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ckpt_cli import store
from ckpt_cli.core.tags import named as tags_named
from ckpt_cli.core.tags import step_in
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import registry
from ckpt_cli.formats.runs import detect as runs
from ckpt_cli.formats.runs.detect import RunCheckpoint

SEARCH_DEPTH = 4  # Lightning: ROOT/lightning_logs/version_0/checkpoints/NAME.ckpt
# Files inside run checkpoints that the root search must not take for checkpoints of their own.
COMPANION_FILE = re.compile(r"(training_args\.bin|optimizer.*|scheduler.*|rng_state.*|random_states.*|custom_checkpoint.*|meta\.pt)")

# checkpoint: one checkpoint of a core format; tagged: a folder of a format with tags of its own (DeepSpeed's latest +
# global_stepN: its reader picks the tag); run: a framework's run checkpoint; root: a folder holding several checkpoints.
Level = Literal["checkpoint", "tagged", "run", "root"]


@dataclass(frozen=True)
class Found:
    """A checkpoint under a run root: where, which framework wrote it (None: a bare core format), its format, and the
    run checkpoint detection found there (opened as it is, not detected again)."""

    path: Path
    framework: str | None
    format: str
    run: RunCheckpoint | None = field(default=None, compare=False, repr=False)

    @property
    def name_step(self) -> int | None:
        """The step a name states (checkpoint-500, epoch=0-step=4.ckpt, step-100, step_100.pt, global_step7,
        accelerate's checkpoint_3 counts saves), or its folder's (global_step_N/actor); None for names without one
        (last.ckpt, epoch=3-val_loss=0.12.ckpt)."""
        for part in (self.path.name, self.path.parent.name):  # verl, SkyRL: global_step_N/actor, step_N/policy
            step = step_in(part)
            if step is not None:
                return step
        return None

    def order(self) -> tuple[int, int]:
        """Oldest first: by the step in the name, then by modification time; names without a step (Lightning's
        last.ckpt, a copy of a newer one) come first, so a stated step wins."""
        step = self.name_step
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            mtime = 0
        return (step if step is not None else -1, mtime)


@dataclass(frozen=True)
class Resolved:
    """What a path names. `format`: the row of the checkpoint itself (a run checkpoint's: its primary part's; None
    for a run root or a layout refused by name). `run`: the run checkpoint (level run). `root`: the run root (level
    root). `members`: every checkpoint under a run root, oldest first (what ls and inspect list). `chosen`: the member
    --tag names; without --tag the newest complete one of `candidates` (newest first) is chosen when opened, since
    only a read tells a complete one. `tag`: --tag, for the checkpoint's own reader (levels checkpoint, tagged).
    `note`: where a checkpoint that is one part of a run checkpoint has its whole (part_note)."""

    location: Path
    level: Level
    format: registry.Format | None
    forced: bool = False  # --format named the format: nothing was detected
    run: RunCheckpoint | None = None
    root: Path | None = None
    members: tuple[Found, ...] = ()
    candidates: tuple[Found, ...] = ()
    chosen: Found | None = None
    runs_in_root: int = 1  # how many runs (run_of) the members belong to
    tag: str | None = None
    note: str | None = None


def resolve(path: str | Path, format: str | None = None, tag: str | None = None) -> Resolved:
    """Resolve `path` once: UsageError (or DataError for an unfinished write in object storage) when it names nothing
    readable, with the wording every command has used."""
    where = store.location(path)  # s3://bucket/prefix: a store.Location
    store.fresh()  # listings and blocks cached by an earlier command in this process may be stale
    if not store.renames(where):
        problem = missing_marker(where)
        if problem:
            raise DataError(problem)
    if not where.exists():
        raise UsageError(f"{where}: no such file or folder")
    if format is not None:
        named = registry.get(format)
        return Resolved(where, "tagged" if named.own_tags else "checkpoint", named, forced=True, tag=tag)
    holder = registry.member_of(where)
    if holder is not None:
        folder, owner = holder
        whole = runs.is_part_of(folder)  # the DCP folder of a Trainer or accelerate save: name the whole save
        what, at = (f"the {whole[0].framework} checkpoint", whole[1]) if whole else (f"the {owner.name} checkpoint", folder)
        raise UsageError(
            f"{where}: one file of {what} {at}, not a checkpoint by itself; point at that folder "
            "(or name --format to read this one file alone)"
        )
    run = runs.detect(where)
    if run is not None:
        return Resolved(where, "run", registry.get(run.parts[0].format) if run.parts else None, run=run, tag=tag)
    fmt = registry.detect(where)
    seen: dict[Path, Found | None] = {where: Found(where, None, fmt.name) if fmt is not None else None}
    if fmt is not None and (fmt.own_tags or not where.is_dir() or _names_itself_whole(where, fmt)):
        return _itself(where, fmt, tag)
    found = find(where, seen=seen) if where.is_dir() else []
    if fmt is not None and not any(f.path != where and _beside_own_files(f, where, fmt) for f in found):
        return _itself(where, fmt, tag)  # nothing below it but its own files: the checkpoint itself
    if not found:
        raise UsageError(not_found_message(where))
    return _root(where, found, tag)


def _itself(where: Path, fmt: registry.Format, tag: str | None) -> Resolved:
    return Resolved(where, "tagged" if fmt.own_tags else "checkpoint", fmt, tag=tag, note=part_note(where))


def _root(root: Path, found: list[Found], tag: str | None) -> Resolved:
    """A run root: the member --tag names (a path under the root, or a folder name), else the candidates of root_run()
    newest first, the one rule `ckpt ls` marks."""
    parents = sorted({run_of(f, root) for f in found})
    if tag is not None:
        by_path = {relative(f, root): f for f in found}
        named = [by_path[r] for r in tags_named(tag, list(by_path))] or [f for f in found if f.path.name == tag]
        if len(named) != 1:
            known = ", ".join(relative(f, root) for f in found)
            raise UsageError(f"{root}: {'no' if not named else 'more than one'} checkpoint '{tag}' under this run root (found: {known})")
        return Resolved(root, "root", None, root=root, members=tuple(found), chosen=named[0], runs_in_root=len(parents), tag=tag)
    run = root_run(root, found)
    if run is None:  # several runs (or Lightning versions) in folders of their own: which is "newest" is the user's call
        shown = ", ".join(f"{root / p.removesuffix('/*')}" for p in parents[:4])
        shown += f" and {len(parents) - 4} more" if len(parents) > 4 else ""
        raise UsageError(f"{root}: holds the checkpoints of {len(parents)} runs ({shown}); point at one (ckpt ls {root} lists them all)")
    candidates = tuple(reversed([f for f in found if run_of(f, root) == run]))
    return Resolved(root, "root", None, root=root, members=tuple(found), candidates=candidates, runs_in_root=len(parents))


def _names_itself_whole(folder: Path, fmt: registry.Format) -> bool:
    """A folder its own index or metadata names whole (an hf release beside its original/, a consolidated DCP save
    beside its sharded/) is that checkpoint; only a loose model.safetensors leaves the folder to the one rule."""
    members = re.compile(fmt.members or "$^")
    try:
        return any(members.fullmatch(p.name) for p in folder.iterdir() if not p.name.startswith(".") and not p.is_dir())
    except OSError:
        return True


def _beside_own_files(found: Found, folder: Path, fmt: registry.Format) -> bool:
    """Whether a checkpoint found under a folder that reads as one of a core format (an hf folder by its
    `model.safetensors`) is not one of its own files (demo/ beside its dcp/ and run/, a Trainer output_dir with
    checkpoint-N/): then the folder is a run root like any other folder holding several."""
    top = folder / found.path.relative_to(folder).parts[0]
    if top.is_dir():
        return not top.is_symlink()
    own = re.compile(f"{fmt.members or '$^'}|model\\.safetensors")  # the hf single-file layout reads model.safetensors
    return not own.fullmatch(top.name)


def identify(path: Path) -> Found | None:
    run = runs.detect(path)
    if run is not None:
        return Found(path, run.framework, run.parts[0].format if run.parts else "-", run)
    if path.is_file() and (COMPANION_FILE.fullmatch(path.name) or registry.member_of(path) or runs.foreign(path)):
        return None  # a run checkpoint's own file, or another tool's (np.savez, a plain pickle): never a damaged checkpoint
    fmt = registry.detect(path)
    return Found(path, None, fmt.name) if fmt is not None else None


def find(root: Path, depth: int = SEARCH_DEPTH, seen: dict[Path, Found | None] | None = None) -> list[Found]:
    """Every checkpoint under `root` (none inside another), oldest first; `root` itself when it is a run checkpoint,
    or a checkpoint with nothing below it but its own files (a DCP or hf folder). `seen`: what is already known of a
    path (identify's answer), so that nothing is detected twice."""
    known = seen if seen is not None else {}

    def identified(path: Path) -> Found | None:
        if path not in known:
            known[path] = identify(path)
        return known[path]

    found: list[Found] = []
    itself = identified(root)
    if itself is not None and itself.framework is not None:
        return [itself]

    def walk(folder: Path, left: int) -> None:
        try:
            children = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            if registry.later_part(child):
                continue  # its set is listed at its first part
            hit = identified(child)
            if hit is not None:
                found.append(hit)
            elif left > 1 and child.is_dir() and not child.is_symlink():
                walk(child, left - 1)

    walk(root, depth)
    if not found and itself is not None:
        return [itself]
    return sorted(found, key=Found.order)


def relative(found: Found, root: Path) -> str:
    return str(found.path.relative_to(root))


def run_of(found: Found, root: Path) -> str:
    """Which run a checkpoint belongs to: its folder under the root, with a folder named by a step (verl's
    global_step_N/actor) standing for the step, not for a run of its own."""
    if found.path == root:
        return "."
    folder = found.path.parent.relative_to(root)
    if found.path.name == found.path.parent.name or step_in(found.path.parent.name) is None:
        return str(folder)
    return str(folder.parent) + "/*"


def root_run(root: Path, found: list[Found]) -> str | None:
    """The run (run_of) whose newest complete checkpoint a command given `root` takes: its only run, or, when it
    holds several, the checkpoints directly in it (demo/ beside demo/run/); None: several runs and none of its own."""
    parents = {run_of(f, root) for f in found}
    return parents.pop() if len(parents) == 1 else "." if "." in parents else None


def not_found_message(path: Path, listing: bool = False) -> str:
    """Why `path` holds no checkpoint, and where to point instead when it is inside one (`listing`: for `ckpt ls`,
    which takes no --format)."""
    inside = runs.is_part_of(path)
    if inside is not None:
        run, at = inside
        return f"{path}: not a checkpoint by itself; it is inside the {run.framework} checkpoint {at}: point at that folder"
    known = ", ".join(registry.FORMATS)
    if listing:
        return (
            f"{path}: no checkpoint in any known format ({known}) below it; ckpt inspect SRC --format NAME reads one that is not detected"
        )
    return f"{path}: not a checkpoint in any known format ({known}), and no checkpoint below it; use --format to say which"


def part_note(path: Path) -> str | None:
    """A checkpoint that is only one part of a run checkpoint: say where the whole one is."""
    inside = runs.is_part_of(path)
    if inside is None:
        return None
    run, at = inside
    return f"{path} is one part of the {run.framework} checkpoint {at}; point at {at} to include its optimizer and framework state"


def missing_marker(path: Path) -> str | None:
    """Why a prefix in object storage holds an unfinished write: data objects without the commit marker that a
    write uploads last (each format's `Commit` in the registry: DCP `.metadata`, the hf index, DeepSpeed `latest`).
    Object storage has no rename, so the marker is all that tells a finished checkpoint from an interrupted one
    (locally a write is renamed into place)."""
    if not path.is_dir():
        return None
    entries = {p.name: p for p in path.iterdir()}  # one listing for every format's check
    commit = next((f.commit for f in registry.FORMATS.values() if f.commit is not None and f.commit.missing(entries)), None)
    if commit is None:
        return None
    pending = len(store.unfinished(path))
    uploads = f", {pending} upload(s) never completed" if pending else ""
    return (
        f"{path}: incomplete {commit.what}: {commit.has} but no {commit.shown}, the commit marker a write uploads last{uploads}; "
        "a write was interrupted or is still running (rerun it with --overwrite)"
    )
