"""Per-rank DTensor files written again at another world size, as verl's FSDPCheckpointManager (and SkyRL) saves
them: `model_`, `optim_` and `extra_state_world_size_W_rank_R.pt` for every rank, `fsdp_config.json` and the
`huggingface/` config and tokenizer, so that the manager's `load_checkpoint` resumes the run on W processes.

Each DTensor is written as torch pickles one (core/pickles/safe_dtensor.py describes the pickle): the rank's local shard,
its DTensorSpec and the DeviceMesh of the new world, `Shard(d)` cut as `torch.chunk` cuts it (the last shards
short or empty). The mesh keeps every attribute rank 0 saved except those the world size and rank decide (layout,
rank map, rank, coordinate); the cached hashes are left for torch to compute. Plain tensors (buffers, Adam's step)
are the same on every rank. FSDP1's flat optimizer state is laid out again per FlatParameter at the new size
(formats/dtensor/flat.py). Only 1-D meshes are re-laid (verl's FSDP mesh); HSDP and tensor-parallel meshes are
refused by name. Facts: docs/formats.md §8.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

from ckpt_cli.core.boxes import sub_box
from ckpt_cli.core.dtypes import BY_NAME, dtype_digest
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Checkpoint, ObjectEntry, PathKey, TensorEntry, contiguous_strides
from ckpt_cli.core.paths import plain_component
from ckpt_cli.core.pickles import pickler
from ckpt_cli.core.pickles.pickler import Global, Instance, Reduce
from ckpt_cli.core.pickles.safe_dtensor import MeshRec, ShardOrderRec, SpecRec, attr
from ckpt_cli.core.pickles.safe_pickle import TorchSize
from ckpt_cli.core.tree import unflatten
from ckpt_cli.core.write.plan import Literal, OutputFile, WritePlan
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.dtensor import flat as dtensor_flat
from ckpt_cli.formats.dtensor import layout as lay
from ckpt_cli.formats.dtensor.reader import DTensorSource, Spec, saved_by_fsdp1
from ckpt_cli.formats.torch_save import Storage, archive, storage_id, tensor_reduce

SPEC_MODULE = "torch.distributed.tensor._dtensor_spec"
PLACEMENTS = "torch.distributed.tensor.placement_types"
# DeviceMesh attributes that depend on the world size or the saving rank: written anew
_MESH_REWRITTEN = {"_layout", "_rank_map", "_flatten_rank_map", "_rank", "_coordinate_on_dim", "_hash"}
_SPEC_REWRITTEN = {"mesh", "placements", "tensor_meta", "shard_order", "_hash", "args"}  # DTensorSpec attributes written anew


class _RankArchive:
    """One rank file being described: the storages its pickle refers to, in order."""

    def __init__(self) -> None:
        self.storages: list[tuple[str, TensorEntry | bytes]] = []

    def tensor(self, entry: TensorEntry) -> Reduce:
        storage = Storage(str(len(self.storages)), entry.dtype, entry.numel)
        self.storages.append((storage.key, entry))
        return tensor_reduce(storage, entry.shape)

    def int32s(self, values: list[int]) -> Reduce:
        storage = Storage(str(len(self.storages)), BY_NAME["int32"], len(values))
        self.storages.append((storage.key, struct.pack(f"<{len(values)}i", *values)))
        return tensor_reduce(storage, (len(values),))

    def segments(self, tree: Any) -> list[Any]:
        return archive(pickler.dumps(tree, storage_id), self.storages)


def mesh_problem(spec: Spec, name: str) -> str | None:
    """Why this DTensor cannot be laid out at another world size (None: it can)."""
    mesh = attr(spec.record, "mesh")
    if len(spec.mesh_shape) != 1:
        dims = f"{len(spec.mesh_shape)}-D mesh {list(spec.mesh_shape)}"
        return f"'{name}' lies on a {dims} (HSDP or tensor parallel); ckpt re-lays 1-D FSDP meshes"
    if spec.placements[0].kind != "shard":
        return f"'{name}' is placed {spec.placements[0]}; ckpt re-lays Shard(d) placements"
    if not isinstance(mesh, MeshRec) or attr(mesh, "_layout") is None:
        return f"'{name}' lies on a DeviceMesh pickled by torch before 2.9 (no _layout); ckpt writes torch >= 2.9 meshes"
    if attr(mesh, "_root_mesh") is not None or attr(mesh, "_flatten_mapping") not in (None, {}):
        return f"'{name}' lies on a sub-mesh or a flattened mesh; ckpt re-lays a root 1-D mesh"
    odd = [k for k, v in mesh.__dict__.items() if k not in _MESH_REWRITTEN and k != "args" and not _plain(v)]
    odd += [k for k, v in spec.record.__dict__.items() if k not in _SPEC_REWRITTEN and not _plain(v)]
    order = attr(spec.record, "shard_order")
    if order is not None and not (
        isinstance(order, tuple)
        and all(isinstance(o, ShardOrderRec) and isinstance(attr(o, "args"), tuple) and _plain(attr(o, "args")) for o in order)
    ):
        odd.append("shard_order")
    if odd:
        return f"'{name}': its DTensor attribute '{odd[0]}' holds an object ckpt does not write"
    return None


def mesh_of(spec: Spec) -> tuple[Any, ...]:
    """What tells one saved mesh from another (every DTensor of a rank file is written on one mesh)."""
    mesh = attr(spec.record, "mesh")
    return spec.mesh_shape, attr(mesh, "_mesh_dim_names"), attr(mesh, "_device_type")


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (str, int, float, bool))


def _mesh(record: MeshRec, world: int, rank: int, out: _RankArchive) -> Instance:
    """The DeviceMesh of `world` ranks as rank `rank` pickles it (torch >= 2.9: `__getstate__` is `__dict__`)."""
    # _FlatLayout coalesces: a dimension of size 1 is dropped, so a one-rank mesh's layout is shape () stride ()
    shape, stride = ((world,), (1,)) if world > 1 else ((), ())
    axis = Instance(Global("torch.distributed._mesh_layout", "_FlatLayout"), {"shape": shape, "stride": stride})
    new = {
        "_layout": Instance(Global("torch.distributed._mesh_layout", "_MeshLayout"), {"axes": (axis,)}),
        "_rank_map": out.int32s(list(range(world))),
        "_flatten_rank_map": tuple(range(world)),
        "_rank": rank,
        "_coordinate_on_dim": (rank,),
        "_hash": None,  # torch computes it when first asked (a saved one is another process's string hashes)
    }
    state = {k: new.get(k, v) for k, v in record.__dict__.items() if k != "args"}
    return Instance(Global("torch.distributed.device_mesh", "DeviceMesh"), {**state, **new})


def _placement(p: lay.Placement) -> Instance:
    return Instance(Global(PLACEMENTS, "Shard"), {"dim": p.dim})


def _spec(spec: Spec, mesh: Instance, entry: TensorEntry) -> Instance:
    """The DTensorSpec rank 0 saved, on the new mesh (shard order and flags as saved; the hash left to torch)."""
    record: SpecRec = spec.record
    meta = Instance(Global(SPEC_MODULE, "TensorMeta"), args=(TorchSize(entry.shape), contiguous_strides(entry.shape), entry.dtype))
    order = attr(record, "shard_order")
    if isinstance(order, tuple):
        order = tuple(Instance(Global(SPEC_MODULE, "ShardOrderEntry"), args=attr(o, "args")) for o in order)
    new = {"mesh": mesh, "placements": tuple(_placement(p) for p in spec.placements), "tensor_meta": meta, "shard_order": order}
    state = {k: new.get(k, v) for k, v in record.__dict__.items() if k != "args"}
    return Instance(Global(SPEC_MODULE, "DTensorSpec"), {**state, **new, "_hash": None})


def _dtensor(entry: TensorEntry, spec: Spec, mesh: Instance, world: int, rank: int, out: _RankArchive) -> Reduce:
    """torch's pickle of the DTensor's rank-`rank` shard (torch/_tensor.py `_reduce_ex_internal` of a wrapper subclass)."""
    dim = spec.placements[0].dim
    start, count = lay.chunk(entry.shape[dim], world, rank)
    offsets = tuple(start if d == dim else 0 for d in range(len(entry.shape)))
    sizes = tuple(count if d == dim else n for d, n in enumerate(entry.shape))
    local = out.tensor(sub_box(entry, entry.name, offsets, sizes))
    cls = Global("torch.distributed.tensor", "DTensor")
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    device = Reduce(Global("torch", "device"), ("cpu",))
    wrapper = (cls, entry.dtype, tuple(entry.shape), contiguous_strides(entry.shape), 0, layout, device, False)
    slots = {"_local_tensor": local, "_spec": _spec(spec, mesh, entry)}
    return Reduce(
        Global("torch._tensor", "_rebuild_from_type_v2"), (Global("torch._utils", "_rebuild_wrapper_subclass"), cls, wrapper, (None, slots))
    )


@dataclasses.dataclass
class _Kinds:
    """The source's entries by the file kind they came from; keys are paths inside that kind's file."""

    model: list[tuple[PathKey, TensorEntry | ObjectEntry]]
    optim: list[tuple[PathKey, TensorEntry | ObjectEntry]]
    extra: list[tuple[PathKey, TensorEntry | ObjectEntry]]


def _kinds(ckpt: Checkpoint) -> _Kinds:
    kinds = _Kinds([], [], [])
    for entry in ckpt.entries():
        if entry.role == "optimizer" and entry.path[:1] == ("optimizer",):
            kinds.optim.append((entry.path[1:], entry))
        elif entry.role == "model":
            kinds.model.append((entry.path, entry))
        else:
            kinds.extra.append((entry.path, entry))
    return kinds


class DTensorWriter:
    name = "dtensor"
    dest_is_dir = True

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        src = ckpt.source
        if ckpt.format != "dtensor" or not isinstance(src, DTensorSource):
            raise UsageError(
                "writing dtensor (verl/SkyRL per-rank files) needs a dtensor source: reshard a verl or SkyRL checkpoint folder"
            )
        world = options.world_size  # set by ops/convert.layout_for from the registry row
        assert world, "a dtensor write is planned with its world size"
        if dtype_digest(ckpt.tensors) != src.dtypes:
            raise UsageError(
                "reshard of per-rank DTensor files copies every tensor as it is: "
                "--filter, prefixes, --dtype and --weights-only do not apply"
            )
        if "optim" in src.not_read:
            raise UsageError(f"{src.folder}: the optimizer files cannot be written at another size: {src.not_read['optim']}")
        if world > 1 and not src.specs and src.params:
            raise UsageError(
                f"{src.folder}: the model files hold no DTensor (FSDP1 on one rank saves plain tensors), so there is no "
                "device mesh to lay out at more ranks; convert the run to DCP instead (ckpt convert SRC DST --to dcp --world-size N)"
            )
        meshes = {mesh_of(spec) for spec in src.specs.values()}
        for name, spec in src.specs.items():
            problem = mesh_problem(spec, name)
            if problem is None and len(meshes) > 1:
                problem = f"'{name}' lies on one of {len(meshes)} different device meshes; ckpt re-lays a run on one 1-D mesh"
            if problem:
                raise UsageError(f"{src.folder}: {problem}; convert the run to DCP instead (ckpt convert SRC DST --to dcp --world-size N)")
        kinds = _kinds(ckpt)
        old = len(src.files["model"])
        # FSDP1 on one rank runs NO_SHARD, whose SHARDED_STATE_DICT holds plain tensors (its state-dict hooks skip
        # unsharded handles; a flat optimizer state says FSDP1 too); FSDP2 keeps DTensors on a one-rank mesh
        plain = world == 1 and (saved_by_fsdp1(src.config) or src.flat is not None)
        files = []
        for r in range(world):
            for kind, parts in (("model", kinds.model), ("optim", kinds.optim), ("extra_state", kinds.extra)):
                if kind in src.files:
                    name = f"{kind}_world_size_{world}_rank_{r}.pt"
                    files.append(OutputFile(name, build=_RankBuild(ckpt, src, kind, parts, world, r, options.per_rank_rule, plain)))
        files += _side_files(ckpt, src, world)
        version = ckpt.details.get("fsdp_version")
        said = f"resharded {'FSDP' + str(version) + ' ' if version else ''}per-rank DTensor files from {old} to {world} ranks"
        notes = [f"{said}; load them with the checkpoint manager's load_checkpoint on {world} processes"]
        if world != old and src.files.get("extra_state"):
            notes.append(f"per-rank RNG states ({old} ranks -> {world}): rule '{options.per_rank_rule}'")
        return WritePlan(self.name, dest, True, files, notes)


@dataclasses.dataclass
class _RankBuild:
    """Makes one rank file's segments when it is written (a reshard to many ranks holds one file's at a time)."""

    ckpt: Checkpoint
    src: DTensorSource
    kind: str
    parts: list[tuple[PathKey, TensorEntry | ObjectEntry]]
    world: int
    rank: int
    rule: str
    plain: bool  # DTensors written as plain tensors (FSDP1 on one rank)

    def __call__(self) -> list[Any]:
        out = _RankArchive()
        mesh = None
        items: list[tuple[PathKey, Any]] = []
        containers = self.ckpt.containers
        if self.kind == "optim" and self.src.flat is not None:
            items = self._flat_optim(out)
        elif self.kind == "extra_state":
            items, containers = self._extra(out)
        else:
            for path, entry in self.parts:
                if isinstance(entry, ObjectEntry):
                    items.append((path, entry.value))
                elif entry.name in self.src.specs and not self.plain:
                    spec = self.src.specs[entry.name]
                    mesh = mesh or _mesh(attr(spec.record, "mesh"), self.world, self.rank, out)
                    items.append((path, _dtensor(entry, spec, mesh, self.world, self.rank, out)))
                else:
                    items.append((path, out.tensor(entry)))
            if self.kind == "optim":
                containers = {k[1:]: v for k, v in containers.items() if k[:1] == ("optimizer",)}
        return out.segments(unflatten(items, containers) if items else {})

    def _flat_optim(self, out: _RankArchive) -> list[tuple[PathKey, Any]]:
        src = self.src
        assert src.flat is not None
        state = dtensor_flat.flat_state(src.flat, src.params, self.ckpt.tensors, self.world, self.rank)
        items: list[tuple[PathKey, Any]] = [
            (("state", k, key), out.tensor(entry)) for k, keys in state.items() for key, entry in keys.items()
        ]
        for path, entry in self.parts:
            if isinstance(entry, ObjectEntry) and path == ("param_groups",):
                items.append((path, dtensor_flat.flat_groups(src.flat, entry.value)))
            elif isinstance(entry, ObjectEntry) and path[:1] != ("state",):
                items.append((path, entry.value))
        return items

    def _extra(self, out: _RankArchive) -> tuple[list[tuple[PathKey, Any]], dict[PathKey, str]]:
        """Rank 0's scheduler (and the rest), and the RNG state of the old rank this one takes by the per-rank rule
        (core/training.py apply_per_rank_rule: wrap takes rank r mod W, first rank 0's, drop none)."""
        old = len(self.src.files["extra_state"])
        keep = {"wrap": self.rank % old, "first": 0}.get(self.rule)
        items: list[tuple[PathKey, Any]] = []
        for path, entry in self.parts:
            if path[:1] == ("rng",):
                if keep is None or path[1] != keep:
                    continue
                path = ("rng", *path[2:])
            elif path in (("world_size",), ("rank",)) and isinstance(entry, ObjectEntry) and type(entry.value) is int:  # SkyRL
                items.append((path, self.world if path == ("world_size",) else self.rank))
                continue
            items.append((path, entry.value if isinstance(entry, ObjectEntry) else out.tensor(entry)))
        containers: dict[PathKey, str] = {}
        for k, v in self.ckpt.containers.items():
            if k[:1] != ("rng",):
                containers[k] = v
            elif len(k) > 1 and k[1] == keep:
                kept: PathKey = ("rng", *k[2:])  # bound first: mypy takes a starred tuple in brackets for 3.11 syntax
                containers[kept] = v
        return items, containers


def _side_files(ckpt: Checkpoint, src: DTensorSource, world: int) -> list[OutputFile]:
    """fsdp_config.json with the new world size, and the model's config and tokenizer under huggingface/."""
    files = []
    if src.config:
        doc = {**src.config, "world_size": world}
        files.append(OutputFile("fsdp_config.json", [Literal(json.dumps(doc, indent=4).encode())]))
    for name, where in ckpt.companions.items():
        data = where if isinstance(where, bytes) else Path(where).read_bytes()
        files.append(OutputFile(f"huggingface/{plain_component(name, f'{src.folder}: companion file')}", [Literal(data)]))
    return files


WRITER = DTensorWriter()
