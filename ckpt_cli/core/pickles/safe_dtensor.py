"""DTensors in pickles (per-rank `torch.save` of a sharded state dict), rebuilt as inert records, never importing
torch.distributed.

torch pickles a DTensor as a wrapper subclass: `_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor,
(DTensor, dtype, global size, stride, storage_offset, layout, device, requires_grad), (None, {"_local_tensor":
<tensor>, "_spec": <DTensorSpec>}))`. The DTensorSpec, DeviceMesh, its layout and the placements (Shard,
_StridedShard, Replicate, Partial) are NEWOBJ + BUILD of their classes' `__dict__`; TensorMeta and ShardOrderEntry
are NamedTuples (NEWOBJ with arguments). Here each class is a `Sealed` record a pickle can fill but not change, and
the DTensor becomes a `DTensorRef`: the local shard (a TensorRef), the spec, the global shape and dtype. What the
records mean (mesh coordinates, offsets) is read by formats/dtensor/layout.py. Facts: docs/formats.md.

The table is handed to the unpickler as extra globals by the formats that read DTensors; it is not part of the
base allow list, so a torch file holding DTensors read on its own is refused by name as before.
"""

from __future__ import annotations

from typing import Any

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.pickles import pickle_guard
from ckpt_cli.core.pickles import safe_pickle as sp
from ckpt_cli.core.pickles.frozen import Frozen, Sealed, frozen
from ckpt_cli.core.pickles.pickle_guard import PickleRefused, charge
from ckpt_cli.core.pickles.safe_pickle import TensorRef


class Record(metaclass=Sealed):
    """A pickled object's attributes (BUILD with a dict, or a (dict, slots) pair); NEWOBJ arguments under "args".
    Read them with `attr`: an attribute the pickle set may shadow anything looked up on the instance."""

    def __new__(cls, *args: Any) -> Any:
        obj = object.__new__(cls)
        if args:
            charge(len(args))
            obj.__dict__["args"] = args
        return obj

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise PickleRefused(f"a {type(self).__name__} state that is not a dict of attributes")
        charge(len(state))
        self.__dict__.update(state)


def attr(record: Record, name: str, default: Any = None) -> Any:
    """An attribute the pickle gave `record` (its NEWOBJ arguments: "args")."""
    return record.__dict__.get(name, default)


class SpecRec(Record):
    """DTensorSpec: mesh, placements, tensor_meta, shard_order, use_strided_shard_as_shard_order."""


class MeshRec(Record):
    """DeviceMesh: _layout (torch >= 2.9) or mesh (a tensor, before), _coordinate_on_dim, _rank, _mesh_dim_names."""


class LayoutRec(Record):
    """_MeshLayout: axes, one _FlatLayout per mesh dimension."""


class FlatLayoutRec(Record):
    """_FlatLayout: shape and stride of one mesh dimension over the rank map."""


class TensorMetaRec(Record):
    """TensorMeta(shape, stride, dtype), a NamedTuple."""


class ShardOrderRec(Record):
    """ShardOrderEntry(tensor_dim, mesh_dims), a NamedTuple."""


class ShardRec(Record):
    """Shard(dim)."""


class StridedShardRec(Record):
    """_StridedShard(dim, split_factor)."""


class ReplicateRec(Record):
    """Replicate()."""


class PartialRec(Record):
    """Partial(reduce_op): every rank holds a summand, not a shard."""


PLACEMENTS = (ShardRec, StridedShardRec, ReplicateRec, PartialRec)


@frozen
class DTensorClass(Frozen):
    """Stand-in for the DTensor class, as the `new_type` of _rebuild_from_type_v2."""


@frozen
class ShardedTensorClass(Frozen):
    """Stand-in for FSDP1's ShardedTensor class: named only to refuse it in words."""


@frozen
class Wrapper(Frozen):
    """What _rebuild_wrapper_subclass returns for a DTensor: the global tensor's metadata."""

    dtype: DType
    shape: tuple[int, ...]
    requires_grad: bool


@frozen
class DTensorRef(Frozen):
    """A DTensor as pickled on one rank: its local shard and the spec that places it in the global tensor."""

    local: TensorRef
    spec: SpecRec
    shape: tuple[int, ...]  # global
    dtype: DType
    requires_grad: bool = False


pickle_guard.CHILDREN[Wrapper] = lambda w: []
pickle_guard.CHILDREN[DTensorRef] = lambda ref: [ref.local, ref.spec]


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, stride: Any, storage_offset: Any, *rest: Any) -> Wrapper:
    if not isinstance(cls, DTensorClass):
        raise PickleRefused("a tensor subclass other than DTensor")
    if not isinstance(dtype, DType):
        raise PickleRefused("a DTensor without a dtype")
    shape = sp._ints(size, "size")
    if any(n < 0 for n in shape):
        raise PickleRefused("a DTensor with a negative size")
    requires_grad = rest[2] is True if len(rest) >= 3 else False
    return Wrapper(dtype, shape, requires_grad)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch._tensor._rebuild_from_type_v2, with DTensor as one more tensor type (the others as the base allow list has them)."""
    if isinstance(new_type, ShardedTensorClass):
        raise PickleRefused("a ShardedTensor (FSDP1 SHARDED_STATE_DICT without a device mesh); ckpt reads DTensor shards")
    if not isinstance(new_type, DTensorClass):
        return sp._rebuild_from_type_v2(func, new_type, args, state)
    if not isinstance(args, tuple):
        raise PickleRefused("_rebuild_from_type_v2 of a DTensor without arguments")
    wrapper = func(*args)
    if not isinstance(wrapper, Wrapper):
        raise PickleRefused("a DTensor not rebuilt by _rebuild_wrapper_subclass")
    slots = state[1] if isinstance(state, tuple) and len(state) == 2 else state
    if not isinstance(slots, dict):
        raise PickleRefused("a DTensor without its local tensor and spec")
    local, spec = slots.get("_local_tensor"), slots.get("_spec")
    if not isinstance(local, TensorRef) or not isinstance(spec, SpecRec):
        raise PickleRefused("a DTensor whose local tensor or spec is missing")
    return DTensorRef(local, spec, wrapper.shape, wrapper.dtype, wrapper.requires_grad)


def _globals() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch.distributed._mesh_layout", "_MeshLayout"): LayoutRec,
        ("torch.distributed._mesh_layout", "_FlatLayout"): FlatLayoutRec,
    }
    for module in ("torch.distributed.tensor", "torch.distributed.tensor._api"):
        table[(module, "DTensor")] = DTensorClass()
    for module in ("torch.distributed._tensor", "torch.distributed._tensor.api"):  # before torch 2.5
        table[(module, "DTensor")] = DTensorClass()
    table[("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")] = ShardedTensorClass()
    for module in ("torch.distributed.device_mesh", "torch.distributed._tensor.device_mesh"):
        table[(module, "DeviceMesh")] = MeshRec
    # DTensorSpec and TensorMeta moved from placement_types to _dtensor_spec in torch 2.4.
    for module in (
        "torch.distributed.tensor._dtensor_spec",
        "torch.distributed._tensor._dtensor_spec",
        "torch.distributed._tensor.placement_types",
    ):
        table[(module, "DTensorSpec")] = SpecRec
        table[(module, "TensorMeta")] = TensorMetaRec
        table[(module, "ShardOrderEntry")] = ShardOrderRec
    for module in ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types"):
        table[(module, "Shard")] = ShardRec
        table[(module, "_StridedShard")] = StridedShardRec
        table[(module, "Replicate")] = ReplicateRec
        table[(module, "Partial")] = PartialRec
        table[(module, "_Partial")] = PartialRec
    return table


DTENSOR_GLOBALS = _globals()


def is_tensor(value: Any) -> bool:
    """A tensor leaf of a per-rank state dict: a plain tensor or a DTensor."""
    return isinstance(value, TensorRef | DTensorRef)
