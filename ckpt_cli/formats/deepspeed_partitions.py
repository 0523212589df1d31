"""A read ZeRO checkpoint's flat partitions as logical tensors: each parameter's fp32 master weight and
optimizer state become pieces over the ranks' saved partitions, placed by the rules of deepspeed_layout.py."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ckpt_cli.core import dtypes
from ckpt_cli.core.model import Box, FlatRange, LazyPieces, Piece, StoredArray, TensorEntry
from ckpt_cli.core.safe_pickle import TensorRef
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError
from ckpt_cli.formats import deepspeed_layout as zl
from ckpt_cli.formats.deepspeed_layout import Slot


class ZeroFile(Protocol):
    """One file's tree: a read file's (tensors as TensorRefs) or a built one's (tensors as TensorEntries)."""

    @property
    def tree(self) -> Any: ...

    def array(self, ref: TensorRef) -> StoredArray: ...


def flat_pieces(start: int, numel: int, partitions: list[tuple[int, int, StoredArray, int]]) -> list[Piece]:
    """Pieces of global flat elements [start, start+numel) held by partitions (flat start, length, array, array start)."""
    pieces = []
    for p_start, p_len, array, a_start in partitions:
        if shared := zl.overlap(start, numel, p_start, p_len):
            lo, hi = shared
            pieces.append(Piece(FlatRange(lo - start, hi - lo), array, a_start + lo - p_start))
    return pieces


class Stage12Partitions:
    """Stage 1/2 and BF16_Optimizer: one flat fp32 buffer per param group, cut into W equal partitions.
    MoE (`experts`): an expert group is cut into W/ep_size partitions per expert-parallel rank, each holding that
    rank's experts under local ids; `order[r][g]` is where rank r's file keeps rank 0's group g (docs/formats.md §2.12)."""

    def __init__(
        self,
        model: ZeroFile,
        optims: Mapping[int, ZeroFile],
        world: int,
        stage: int | None,
        experts: zl.ExpertLayout | None = None,
        order: Mapping[int, list[int]] | None = None,
    ) -> None:
        self.model, self.optims, self.world, self.stage = model, optims, world, stage
        self.experts, self.order = experts, order
        self.osd = {r: o.tree["optimizer_state_dict"] for r, o in optims.items()}
        self.shapes: list[dict[str, zl.Shape]] = model.tree.get("param_shapes") or []
        base = self.osd[0]["base_optimizer_state"]
        self.state, self.groups = base.get("state", {}), base.get("param_groups", [])
        self.paddings = self.osd[0].get("param_alignment_paddings") or [None] * len(self.shapes)  # BF16_Optimizer saves none
        self.alignment_padding = any(any(p or []) for p in self.paddings)

    def offsets(self, g: int) -> list[Slot]:
        return zl.flat_slots(list(self.shapes[g].items()), self.paddings[g])

    def index(self, rank: int, g: int) -> int:
        """Where rank's file keeps group g."""
        return self.order[rank][g] if self.order else g

    def replicas(self, g: int) -> list[tuple[list[int], Callable[[str], str]]]:
        """Group g's flat buffers: the ranks holding its partitions in order, and the logical name of a param in it."""
        if self.experts is None:
            return [(list(range(self.world)), str)]
        return [
            (self.experts.holders(g, self.world, e), functools.partial(self.experts.name, ep_rank=e))
            for e in range(self.experts.ep_sizes[g])
        ]

    def _partitions(self, g: int, key: str | None, holders: list[int]) -> list[tuple[int, int, StoredArray, int]]:
        """Every holder's partition of group g's flat fp32 weights (key None) or of a moment: (flat start, saved length, array, 0)."""
        osd, k = self.osd[holders[0]], self.index(holders[0], g)
        saved = osd["single_partition_of_fp32_groups"][k].shape[0]
        size = zl.partition_size_of_saved(saved, osd["group_paddings"][k], self.stage is None)
        parts = []
        for d, r in enumerate(holders):
            osd, k = self.osd[r], self.index(r, g)
            ref = osd["single_partition_of_fp32_groups"][k] if key is None else osd["base_optimizer_state"]["state"][k][key]
            parts.append((d * size, ref.shape[0], self.optims[r].array(ref), 0))
        return parts

    def model_tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for g in range(len(self.shapes)):
            for holders, name_of in self.replicas(g):
                parts = self._partitions(g, None, holders)
                for slot in self.offsets(g):
                    name = name_of(slot.name)
                    out[name] = TensorEntry(name, dtypes.FLOAT32, slot.shape, "model", flat_pieces(slot.offset, slot.numel, parts))
        return out

    def optimizer_tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for g in range(len(self.shapes)):
            for key, ref in self.state.get(g, {}).items():
                if not isinstance(ref, TensorRef):
                    continue
                for holders, name_of in self.replicas(g):
                    if ref.shape:
                        parts = self._partitions(g, key, holders)
                    else:  # step: one 0-d value per group, the same on every rank
                        held = self.osd[holders[0]]["base_optimizer_state"]["state"][self.index(holders[0], g)][key]
                        step = [Piece(Box((), ()), self.optims[holders[0]].array(held))]
                    for slot in self.offsets(g):
                        pieces = flat_pieces(slot.offset, slot.numel, parts) if ref.shape else step
                        out.update(moment(Slot(name_of(slot.name), slot.shape, slot.offset), key, ref, pieces))
        return out

    def param_groups(self) -> list[dict[str, Any]]:
        return [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [name_of(n) for _, name_of in self.replicas(g) for n in self.shapes[g]],
            }
            for g, group in enumerate(self.groups)
        ]

    def details(self) -> dict[str, Any]:
        config = (self.model.tree.get("ds_config") or {}).get("zero_optimization") or {}
        return {"round_robin_gradients": bool(config.get("round_robin_gradients")), "alignment_padding": self.alignment_padding}


class Stage3Partitions:
    """Stage 3: every parameter partitioned on its own (ceil(n/W) per rank), concatenated per sub-group."""

    alignment_padding = False
    experts = None  # DeepSpeed refuses native MoE at stage 3 (engine.py _validate_zero3_moe_compatibility)

    def __init__(self, models: Mapping[int, ZeroFile], optims: Mapping[int, ZeroFile], world: int) -> None:
        self.models, self.optims, self.world = models, optims, world
        self.osd = {r: o.tree["optimizer_state_dict"] for r, o in optims.items()}
        self.shapes: list[dict[str, zl.Shape]] = models[0].tree.get("param_shapes") or []
        inner = self.osd[0].get("optimizer_state_dict") or {}
        self.state, self.groups = inner.get("state", {}), inner.get("param_groups", [])

    def offsets(self, s: int) -> list[Slot]:
        """Sub-group s's params in every rank's flat partition."""
        return zl.stage3_slots(list(self.shapes[s].items()), self.world)

    def _arrays(self, s: int, key: str | None) -> list[StoredArray]:
        """Each rank's flat partition of sub-group s: fp32 weights (key None) or a moment, of exactly the elements
        its parameters take (DeepSpeed copies it into a buffer of that size; zero_to_fp32 refuses any other)."""
        need = sum(zl.stage3_partition_size(slot.numel, self.world) for slot in self.offsets(s))
        arrays = []
        for r in range(self.world):
            osd = self.osd[r]
            ref = osd["fp32_flat_groups"][s] if key is None else osd["optimizer_state_dict"]["state"][s][key]
            array = self.optims[r].array(ref)
            if array.numel != need:
                raise DataError(
                    f"{self.optims[r].path}: the {'fp32 weights' if key is None else repr(key)} partition of sub-group {s} "
                    f"holds {array.numel} elements; its {len(self.shapes[s])} parameters take {need} at {self.world} ranks"
                )
            arrays.append(array)
        return arrays

    def _pieces(self, arrays: list[StoredArray], slot: Slot) -> list[Piece]:
        pieces = []
        for r, array in enumerate(arrays):
            start, end = zl.stage3_rank_range(slot.numel, self.world, r)
            if start < end:
                pieces.append(Piece(FlatRange(start, end - start), array, slot.offset))
        return pieces

    def _lazy_pieces(self, arrays: list[StoredArray], slot: Slot) -> LazyPieces:
        count = zl.stage3_rank_count(slot.numel, self.world)
        return LazyPieces(functools.partial(self._pieces, arrays, slot), count, by_layout=True)

    def model_tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for s in range(len(self.shapes)):
            arrays = self._arrays(s, None)
            for slot in self.offsets(s):
                pieces = self._lazy_pieces(arrays, slot)
                out[slot.name] = TensorEntry(slot.name, dtypes.FLOAT32, slot.shape, "model", pieces)
        return out

    def optimizer_tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for s in range(len(self.shapes)):
            slots = self.offsets(s)
            for key, ref in self.state.get(s, {}).items():
                if not isinstance(ref, TensorRef):
                    continue
                arrays = self._arrays(s, key) if ref.shape else []
                step = [Piece(Box((), ()), self.optims[0].array(ref))]
                for slot in slots:
                    out.update(moment(slot, key, ref, self._lazy_pieces(arrays, slot) if ref.shape else step))
        return out

    def param_groups(self) -> list[dict[str, Any]]:
        names = [list(shapes) for shapes in self.shapes]
        out = []
        for group in self.groups:
            params = [n for s in group.get("params", []) for n in (names[s] if s < len(names) else [])]
            out.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        return out

    def details(self) -> dict[str, Any]:
        return {"sub_groups": len(self.shapes)}


def moment(slot: Slot, key: str, ref: TensorRef, pieces: list[Piece] | LazyPieces) -> dict[str, TensorEntry]:
    """A param's optimizer state `key` as a logical tensor: its shape, or 0-d for a per-group scalar (step)."""
    path = ("optimizer", "state", slot.name, key)
    return {path_name(path): TensorEntry(path_name(path), ref.dtype, slot.shape if ref.shape else (), "optimizer", pieces, path)}
