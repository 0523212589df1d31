"""A pickled DTensor's mesh shape, mesh coordinate and placements, read from the records core/pickles/safe_dtensor.py
builds and checked for type and range (a crafted file gets a one-line DataError, never a traceback).

DeviceMesh (torch >= 2.9) keeps its shape as a CuTe-style layout: `_layout` holds one `_FlatLayout` per mesh dim
whose size is the product of its `shape`; older versions kept the rank grid itself as the tensor `mesh`. Every
version pickles `_coordinate_on_dim`, the saving rank's coordinate (None off the mesh), and `_rank`, its global
rank. A DTensorSpec with `_StridedShard` placements leaves `shard_order` None; otherwise `shard_order` must be
the default left-to-right order of its placements (the only one `compute_local_shape_and_global_offset` knows).
"""

from __future__ import annotations

import math
from typing import Any

from ckpt_cli.core.paths import shown
from ckpt_cli.core.pickles.safe_dtensor import (
    DTensorRef,
    FlatLayoutRec,
    LayoutRec,
    MeshRec,
    PartialRec,
    ReplicateRec,
    ShardOrderRec,
    ShardRec,
    SpecRec,
    StridedShardRec,
    TensorMetaRec,
    attr,
)
from ckpt_cli.core.pickles.safe_pickle import MAX_DIMS, TensorRef
from ckpt_cli.errors import DataError
from ckpt_cli.formats.dtensor.layout import Placement


def _int(value: Any) -> bool:
    return type(value) is int


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, tuple | list) and len(value) <= MAX_DIMS and all(_int(v) for v in value):
        return tuple(value)
    return None


def placement(rec: Any, where: str) -> Placement:
    if isinstance(rec, ReplicateRec):
        return Placement("replicate")
    if isinstance(rec, PartialRec):
        op = attr(rec, "reduce_op")
        return Placement("partial", reduce_op=op if isinstance(op, str) else "sum")
    dim = attr(rec, "dim")
    if isinstance(rec, ShardRec) and _int(dim):
        return Placement("shard", dim)
    if isinstance(rec, StridedShardRec) and _int(dim) and _int(attr(rec, "split_factor")):
        return Placement("strided", dim, attr(rec, "split_factor"))
    raise DataError(f"{where}: a placement of an unknown form ({type(rec).__name__} {shown(getattr(rec, '__dict__', rec))})")


def mesh_shape(mesh: MeshRec, where: str) -> tuple[int, ...]:
    layout = attr(mesh, "_layout")
    if isinstance(layout, LayoutRec):
        axes = attr(layout, "axes")
        if isinstance(axes, tuple | list) and len(axes) <= MAX_DIMS and all(isinstance(a, FlatLayoutRec) for a in axes):
            sizes = []
            for axis in axes:
                shape = attr(axis, "shape")
                dims = (shape,) if _int(shape) else _ints(shape)
                if dims is None or any(d < 1 for d in dims):
                    break
                sizes.append(math.prod(dims))
            else:
                return tuple(sizes)
        raise DataError(f"{where}: a device mesh layout of an unknown form")
    grid = attr(mesh, "mesh")
    if isinstance(grid, TensorRef):  # before torch 2.9: the rank grid itself
        return grid.shape
    raise DataError(f"{where}: a device mesh without a shape (neither _layout nor mesh)")


def check_order(spec: SpecRec, placements: tuple[Placement, ...], where: str) -> None:
    """A saved shard_order must be the default left-to-right one (None: _StridedShard placements encode it)."""
    order = attr(spec, "shard_order")
    if order is None:
        return
    saved = []
    for entry in order if isinstance(order, tuple | list) else [None]:
        args = attr(entry, "args") if isinstance(entry, ShardOrderRec) else None
        if not isinstance(args, tuple) or len(args) != 2 or not _int(args[0]) or _ints(args[1]) is None:
            raise DataError(f"{where}: a shard order of an unknown form")
        saved.append((args[0], tuple(args[1])))
    default: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(placements):
        if p.shards:
            default.setdefault(p.dim, []).append(mesh_dim)
    if saved != sorted((d, tuple(m)) for d, m in default.items()):
        raise DataError(f"{where}: shard order {saved} is not the left-to-right order of its placements; ckpt reads that order only")


def layout_of(
    ref: DTensorRef, shape: tuple[int, ...], rank: int, where: str
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...]]:
    """(mesh shape, the saving rank's mesh coordinate, placements) of a DTensor saved by rank `rank`."""
    spec = ref.spec
    mesh, raw = attr(spec, "mesh"), attr(spec, "placements")
    if not isinstance(mesh, MeshRec) or not isinstance(raw, tuple | list) or len(raw) > MAX_DIMS:
        raise DataError(f"{where}: a DTensor spec without a device mesh and placements")
    placements = tuple(placement(p, where) for p in raw)
    dims = mesh_shape(mesh, where)
    coordinate = attr(mesh, "_coordinate_on_dim")
    if coordinate is None:
        raise DataError(f"{where}: saved by a rank outside its device mesh (no mesh coordinate)")
    if _ints(coordinate) is None:
        raise DataError(f"{where}: a mesh coordinate of an unknown form ({shown(coordinate)})")
    saved_by = attr(mesh, "_rank")
    if _int(saved_by) and saved_by != rank:
        raise DataError(f"{where}: saved by rank {saved_by}, in the file of rank {rank}")
    meta = attr(spec, "tensor_meta")
    if isinstance(meta, TensorMetaRec):
        args = attr(meta, "args")
        if isinstance(args, tuple) and args and _ints(args[0]) is not None and tuple(args[0]) != shape:
            raise DataError(f"{where}: its spec says shape {list(args[0])}, the tensor {list(shape)}")
    return dims, tuple(coordinate), placements
