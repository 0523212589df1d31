"""Per-rank `torch.save` of a DTensor state dict: `model_world_size_W_rank_R.pt` (+ `optim_...`, `extra_state_...`),
as verl's FSDPCheckpointManager and SkyRL save FSDP1/FSDP2 models (read-only).

Every rank file is unpickled through the allow list with the DTensor stand-ins of core/pickles/safe_dtensor.py. A
DTensor's local shard is placed in the global tensor from its mesh coordinate and placements
(formats/dtensor/layout.py); ranks holding the same shard (Replicate on a mesh dim, a sub-mesh) are read once,
and every shard of the mesh must be present. A plain tensor (a buffer, a parameter FSDP was told to ignore, the
optimizer's step) is the same on every rank: it is read from rank 0, never concatenated. Facts: docs/formats.md.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.dtypes import dtype_digest
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Box, Checkpoint, FileInfo, ObjectEntry, PathKey, Piece, StoredArray, TensorEntry
from ckpt_cli.core.paths import read_regular_text, shown
from ckpt_cli.core.pickles import zipio
from ckpt_cli.core.pickles.safe_dtensor import DTENSOR_GLOBALS, DTensorRef, is_tensor
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.tree import flatten, path_name, unique_names
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.dtensor import layout as lay
from ckpt_cli.formats.dtensor.flat import FlatLayout, Param, read_flat
from ckpt_cli.formats.dtensor.mesh import check_order, layout_of
from ckpt_cli.formats.torch_save import crc_problems, open_archive, stored_array

RANK_FILE = re.compile(r"(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
KINDS = {"model": (), "optim": ("optimizer",)}  # kind -> key path prefix of its entries
ROLES = {"model": "model", "optim": "optimizer"}
STEP_FOLDER = re.compile(r"(?:global_)?step_?(\d+)$")  # verl: global_step_N/actor, SkyRL: step_N/policy


@dataclass
class RankFile:
    path: Path
    tree: Any
    records: dict[str, zipio.Record]


@dataclass(frozen=True)
class DTensorSource:
    """The folder and each kind's rank files in rank order (for check()), and what the writer lays out again: each
    DTensor's mesh and placements as rank 0 saved them, the dtype of every tensor read, and FSDP1's flat layout."""

    folder: Path
    files: dict[str, list[Path]]
    specs: dict[str, Spec] = dataclasses.field(default_factory=dict)
    dtypes: bytes = b""  # dtypes.dtype_digest of the tensors read
    flat: FlatLayout | None = None
    params: list[Param] = dataclasses.field(default_factory=list)
    not_read: dict[str, str] = dataclasses.field(default_factory=dict)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # fsdp_config.json as read ({} when absent)


@dataclass(frozen=True)
class Spec:
    """A DTensor's layout as rank 0 saved it: mesh shape, placements and the pickled spec (its mesh's attributes)."""

    mesh_shape: tuple[int, ...]
    placements: tuple[lay.Placement, ...]
    record: Any


def rank_file_sets(folder: Path) -> dict[str, dict[int, dict[int, Path]]]:
    """kind -> world size -> rank -> file."""
    sets: dict[str, dict[int, dict[int, Path]]] = {}
    for p in folder.iterdir():
        m = RANK_FILE.match(p.name)
        if m:
            sets.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[int(m.group(3))] = p
    return sets


def _complete(folder: Path, kind: str, worlds: dict[int, dict[int, Path]], world: int | None) -> list[Path]:
    """The files of one kind in rank order: one world size, every rank 0..W-1, nothing else."""
    if len(worlds) > 1 or (world is not None and world not in worlds):
        found = sorted(worlds) + ([] if world is None else [world])
        raise DataError(f"{folder}: rank files of world sizes {', '.join(map(str, sorted(set(found))))}; a checkpoint has one")
    ((size, ranks),) = worlds.items()
    missing = [r for r in range(size) if r not in ranks]
    if missing:
        raise DataError(f"{folder / f'{kind}_world_size_{size}_rank_{missing[0]}.pt'}: missing ({len(missing)} of {size} ranks missing)")
    extra = sorted(r for r in ranks if r >= size)
    if extra:
        raise DataError(f"{ranks[extra[0]]}: rank {extra[0]} of a world of {size}")
    return [ranks[r] for r in range(size)]


def _load(path: Path, options: ReadOptions) -> RankFile:
    return RankFile(path, *open_archive(path, options, DTENSOR_GLOBALS))


def _sub_array(array: StoredArray, local: tuple[int, ...], sizes: tuple[int, ...]) -> StoredArray:
    """The box of a local shard that starts at `local`, as a view of the same storage."""
    start = array.storage_offset + sum(o * st for o, st in zip(local, array.stride))
    return dataclasses.replace(array, shape=sizes, storage_offset=start)


def _dtensor(name: str, key: PathKey, role: str, leaves: list[tuple[RankFile, DTensorRef]], world: int) -> tuple[TensorEntry, Spec]:
    """One logical tensor from every rank's DTensor: each distinct shard once, placed by its mesh coordinate."""
    shape, dtype = leaves[0][1].shape, leaves[0][1].dtype
    first = None
    shards: dict[tuple[int, ...], list[Piece]] = {}
    for rank, (rf, ref) in enumerate(leaves):
        where = f"{rf.path}: '{name}'"
        if ref.shape != shape or ref.dtype != dtype:
            raise DataError(f"{where} is {ref.dtype}{list(ref.shape)}; rank 0 has it as {dtype}{list(shape)}")
        mesh_shape, coordinate, placements = layout_of(ref, shape, rank, where)
        if first is None:
            first = (mesh_shape, placements)
        elif (mesh_shape, placements) != first:
            raise DataError(
                f"{where} lies on a mesh {list(mesh_shape)} with {_shown(placements)}; rank 0's on {list(first[0])} with {_shown(first[1])}"
            )
        problem = lay.problem(shape, mesh_shape, coordinate, placements, world)
        if problem:
            raise DataError(f"{where}: {problem}")
        check_order(ref.spec, placements, where)
        runs = lay.index_runs(shape, mesh_shape, coordinate, placements)
        if lay.local_shape(runs) != ref.local.shape or ref.local.dtype != dtype:
            raise DataError(
                f"{where} holds a local shard {ref.local.dtype}{list(ref.local.shape)}; {_shown(placements)} at mesh coordinate "
                f"{list(coordinate)} of {list(mesh_shape)} give {dtype}{list(lay.local_shape(runs))}"
            )
        key_ = lay.shard_key(coordinate, placements)
        if key_ in shards:  # a replica of a shard already read
            continue
        array = stored_array(ref.local, rf.records, str(rf.path), name)
        shards[key_] = [Piece(Box(offsets, sizes), _sub_array(array, local, sizes)) for offsets, sizes, local in lay.boxes(runs)]
    assert first is not None
    for key_ in lay.all_shard_keys(*first):
        if key_ not in shards:
            raise DataError(
                f"{leaves[0][0].path.parent}: '{name}': no rank file holds the shard at mesh coordinate {list(key_)} ({_shown(first[1])})"
            )
    entry = TensorEntry(name, dtype, shape, role, [p for pieces in shards.values() for p in pieces], key)
    problem = entry.tiling_problem()
    if problem:
        raise DataError(f"{leaves[0][0].path.parent}: '{name}': the shards do not tile {list(shape)}: {problem}")
    return entry, Spec(first[0], first[1], leaves[0][1].spec)


def _shown(placements: tuple[lay.Placement, ...]) -> str:
    return "(" + ", ".join(map(str, placements)) + ")"


def _same_everywhere(leaves: list[tuple[RankFile, TensorRef]]) -> bool:
    """Whether every rank holds the very same plain tensor (view and stored bytes, by the zip's CRC)."""

    def fingerprint(rf: RankFile, ref: TensorRef) -> tuple[Any, ...]:
        rec = rf.records.get(f"data/{ref.storage.key}")
        return ref.dtype, ref.shape, ref.stride, ref.storage_offset, rec.size if rec else None, rec.crc if rec else None

    return len({fingerprint(rf, ref) for rf, ref in leaves}) == 1


def _plain(name: str, key: PathKey, role: str, leaves: list[tuple[RankFile, TensorRef]]) -> TensorEntry:
    rf, ref = leaves[0]
    piece = Piece(Box((0,) * len(ref.shape), ref.shape), stored_array(ref, rf.records, str(rf.path), name))
    return TensorEntry(name, ref.dtype, ref.shape, role, [piece], key)


@dataclass
class _Kind:
    """The entries one kind of rank file contributes."""

    tensors: dict[str, TensorEntry] = dataclasses.field(default_factory=dict)
    objects: dict[str, ObjectEntry] = dataclasses.field(default_factory=dict)
    containers: dict[PathKey, str] = dataclasses.field(default_factory=dict)
    not_read: str | None = None
    differing: list[str] = dataclasses.field(default_factory=list)  # plain model tensors whose ranks disagree: rank 0's read
    specs: dict[str, Spec] = dataclasses.field(default_factory=dict)
    flat: FlatLayout | None = None


def leaves_of(flat: tuple[list[tuple[PathKey, Any]], Any, Any]) -> list[Any]:
    return [v for _, v in flat[0]]


def _read_kind(kind: str, files: list[RankFile], params: list[Param]) -> _Kind:
    """Model or optimizer files: the same keys on every rank, each tensor assembled from all of them. `params`: the
    model's parameters (its DTensors), which FSDP1's flat optimizer state is cut into."""
    out = _Kind()
    role, prefix = ROLES[kind], KINDS[kind]
    if all(rf.tree == {} for rf in files):  # SkyRL saves {} when it has no optimizer
        return out
    per_rank = [flatten(rf.tree, is_tensor, str(rf.path)) for rf in files]
    paths = [p for p, _ in per_rank[0][0]]
    for rf, (tensors, _, _) in zip(files[1:], per_rank[1:]):
        if [p for p, _ in tensors] != paths:
            mine = {p for p, _ in tensors}
            odd = next((p for p in paths if p not in mine), None) or next(p for p in mine if p not in set(paths))
            raise DataError(f"{rf.path}: its tensors differ from rank 0's (at '{path_name(odd)}')")
    keys = [(*prefix, *p) for p in paths] + [(*prefix, *p) for p, _ in per_rank[0][1]]
    names = unique_names(keys, str(files[0].path))
    for i, key in enumerate(keys[: len(paths)]):
        leaves = [(rf, part[0][i][1]) for rf, part in zip(files, per_rank)]
        if all(isinstance(v, DTensorRef) for _, v in leaves):
            out.tensors[names[i]], out.specs[names[i]] = _dtensor(names[i], key, role, leaves, len(files))
        elif not all(isinstance(v, TensorRef) for _, v in leaves):
            raise DataError(f"{files[0].path}: '{names[i]}' is a DTensor on some ranks and a plain tensor on others")
        elif _same_everywhere(leaves):
            out.tensors[names[i]] = _plain(names[i], key, role, leaves)
        elif kind == "optim":
            return _flat_kind(files, params, names[i])
        else:  # a buffer FSDP does not keep in sync (dcp.save too keeps one copy of a replicated plain tensor)
            out.tensors[names[i]] = _plain(names[i], key, role, leaves)
            out.differing.append(names[i])
    if out.differing and not any(isinstance(v, DTensorRef) for v in leaves_of(per_rank[0])):
        raise DataError(
            f"{files[0].path}: no DTensor, and plain tensors that differ between ranks ('{out.differing[0]}'): not a sharded state dict"
        )
    for (_, value), key, name in zip(per_rank[0][1], keys[len(paths) :], names[len(paths) :]):
        out.objects[name] = ObjectEntry(name, value, role, key)
    out.containers = {(*prefix, *p): k for p, k in per_rank[0][2].items()}
    return out


def _flat_kind(files: list[RankFile], params: list[Param], differing: str) -> _Kind:
    """FSDP1's flat-parameter optimizer state (plain 1-D tensors that differ between ranks), per parameter."""
    flat = read_flat([(str(rf.path), rf.tree, rf.records) for rf in files], params, len(files))
    if isinstance(flat, str):
        return _Kind(not_read=f"'{differing}' is a plain tensor that differs between ranks (FSDP1's flat-parameter state): {flat}")
    return _Kind(tensors=flat.tensors, objects={flat.groups.name: flat.groups}, flat=flat.layout)


def _read_extra(files: list[RankFile]) -> _Kind:
    """extra_state files ({lr_scheduler, rng}): the RNG states differ by rank, each is kept as rng.R; the rest is rank 0's."""
    out = _Kind()
    parts = [(files[0], {k: v for k, v in files[0].tree.items() if k != "rng"} if isinstance(files[0].tree, dict) else files[0].tree)]
    parts += [(rf, {"rng": {r: rf.tree["rng"]}}) for r, rf in enumerate(files) if isinstance(rf.tree, dict) and "rng" in rf.tree]
    flat = [(rf, flatten(tree, is_tensor, str(rf.path))) for rf, tree in parts if tree]
    names = iter(unique_names([p for _, (t, o, _) in flat for p in [*(k for k, _ in t), *(k for k, _ in o)]], str(files[0].path)))
    for rf, (tensors, objects, containers) in flat:
        for key, ref in tensors:
            name = next(names)
            if not isinstance(ref, TensorRef):
                raise DataError(f"{rf.path}: '{name}' is a DTensor; ckpt reads plain tensors in extra_state files")
            out.tensors[name] = _plain(name, key, "other", [(rf, ref)])
        for key, value in objects:
            name = next(names)
            out.objects[name] = ObjectEntry(name, value, "other", key)
        out.containers.update(containers)
    return out


def saved_by_fsdp1(config: dict[str, Any]) -> bool:
    """What fsdp_config.json says: verl's FSDP_version 1, or SkyRL's strategy "fsdp"."""
    return config.get("FSDP_version") == 1 or config.get("fsdp_strategy") == "fsdp"


def fsdp_config(folder: Path, world: int) -> dict[str, Any]:
    """verl's fsdp_config.json ({FSDP_version, world_size}), checked against the rank files."""
    path = folder / "fsdp_config.json"
    if not path.is_file():
        return {}
    try:
        doc = structured.load_json(read_regular_text(path, max_bytes=1 << 20), str(path), DataError)
    except OSError:
        raise DataError(f"{path}: not a readable JSON file") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}: not a JSON object")
    if "world_size" in doc and doc["world_size"] != world:
        raise DataError(f"{path}: says world_size {shown(doc['world_size'])}; the folder holds rank files of world size {world}")
    return doc


class DTensorRanksReader:
    name = "dtensor"

    def detect(self, path: Path) -> bool:
        if path.is_file():
            m = RANK_FILE.match(path.name)
            return m is not None and m.group(1) == "model"
        return path.is_dir() and any(RANK_FILE.match(p.name) and p.name.startswith("model_") for p in path.iterdir())

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        if path.is_file():
            m = RANK_FILE.match(path.name)
            which = f"rank {m.group(3)} of {m.group(2)}" if m else "one rank"
            raise UsageError(f"{path}: {which} of a per-rank DTensor checkpoint; read the folder that holds every rank: {path.parent}")
        sets = rank_file_sets(path)
        model = _complete(path, "model", sets.get("model", {}), None)
        world = len(model)
        config = fsdp_config(path, world)
        listed: dict[str, list[Path]] = {
            "model": model,
            **{k: _complete(path, k, sets[k], world) for k in ("optim", "extra_state") if k in sets},
        }
        tensors: dict[str, TensorEntry] = {}
        objects: dict[str, ObjectEntry] = {}
        containers: dict[PathKey, str] = {}
        notes, not_read = [], {}
        specs: dict[str, Spec] = {}
        params: list[Param] = []
        flat = None
        # FSDP1 on one rank (NO_SHARD) saves plain tensors: every model tensor is then taken as a parameter
        one_rank_fsdp1 = world == 1 and saved_by_fsdp1(config)
        for kind, paths in listed.items():
            loaded = [_load(p, options) for p in paths]
            part = _read_extra(loaded) if kind == "extra_state" else _read_kind(kind, loaded, params)
            if kind == "model":
                params = [Param(n, t.shape) for n, t in part.tensors.items() if n in part.specs or one_rank_fsdp1]
            elif kind == "optim" and one_rank_fsdp1 and not part.not_read:
                flat_part = _flat_kind(loaded, params, "optimizer.state")
                part = part if flat_part.not_read else flat_part
            pattern = path / f"{kind}_world_size_{world}_rank_*.pt"
            if part.flat is not None:
                flat = part.flat
                notes.append(
                    f"{pattern}: FSDP1's flat optimizer state, read per parameter "
                    f"({len(part.flat.units)} FlatParameters, one per wrapped unit)"
                )
            if part.not_read:
                not_read[kind] = part.not_read
                notes.append(f"{pattern}: not read: {part.not_read}")
                continue
            if part.differing:
                shown_names = ", ".join(part.differing[:5]) + (" ..." if len(part.differing) > 5 else "")
                notes.append(
                    f"{pattern}: plain tensors that differ between ranks, read from rank 0 (dcp.save too keeps one copy): {shown_names}"
                )
            clash = (part.tensors.keys() | part.objects.keys()) & (tensors.keys() | objects.keys())
            if clash:
                raise DataError(f"{paths[0]}: '{sorted(clash)[0]}' is also a name in the model file")
            tensors.update(part.tensors)
            objects.update(part.objects)
            containers.update(part.containers)
            specs.update(part.specs)
        files = [FileInfo(str(p), p.stat().st_size) for paths in listed.values() for p in paths]
        step = STEP_FOLDER.search(path.resolve().parent.name)
        companions, found_notes = _hf_companions(path)
        return Checkpoint(
            format=self.name,
            path=str(path),
            tensors=tensors,
            objects=objects,
            files=files,
            step=int(step.group(1)) if step else None,
            world_size=world,
            containers=containers,
            details=_details(tensors, listed, config, not_read),
            notes=notes + found_notes,
            source=DTensorSource(
                path,
                {k: list(v) for k, v in listed.items()},
                specs,
                dtype_digest(tensors),
                flat,
                params,
                not_read,
                config,
            ),
            companions=companions,
        )

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        source = ckpt.source
        if not isinstance(source, DTensorSource):
            raise TypeError(f"{ckpt.path}: DTensorRanksReader.check needs the checkpoint its read() returned")
        problems = []
        listed = {p.name for paths in source.files.values() for p in paths}
        for worlds in rank_file_sets(source.folder).values():
            for ranks in worlds.values():
                problems += [f"{p}: not part of the checkpoint (another save's leftover?)" for p in ranks.values() if p.name not in listed]
        return problems + (crc_problems(p for paths in source.files.values() for p in paths) if deep else [])


def _details(
    tensors: dict[str, TensorEntry], listed: dict[str, list[Path]], config: dict[str, Any], not_read: dict[str, str]
) -> dict[str, Any]:
    details: dict[str, Any] = {"rank_files": sum(len(v) for v in listed.values()), "kinds": ", ".join(listed)}
    if isinstance(config.get("FSDP_version"), int):  # verl
        details["fsdp_version"] = config["FSDP_version"]
    if isinstance(config.get("fsdp_strategy"), str):  # SkyRL
        details["fsdp_strategy"] = config["fsdp_strategy"]
    details["sharded_tensors"] = sum(1 for t in tensors.values() if len(t.pieces) > 1)
    if not_read:
        details["not_read"] = not_read
    return details


def _hf_companions(path: Path) -> tuple[dict[str, str | bytes], list[str]]:
    """The model's config and tokenizer that verl's checkpoint manager saves beside the rank files (`huggingface/`,
    docs/formats.md §8.1): a Hugging Face export of the run carries them, as verl's own merger does."""
    folder = path / "huggingface"
    if not folder.is_dir():
        return {}, []
    from ckpt_cli.formats.companions import companions_in

    return companions_in(folder)


READER = DTensorRanksReader()
