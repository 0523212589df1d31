"""A read ZeRO checkpoint's flat partitions as logical tensors: each parameter's fp32 master weight and
optimizer state become pieces over the ranks' saved partitions, placed by the rules of deepspeed/layout.py."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from ckpt_cli.core import dtypes
from ckpt_cli.core.model import Box, FlatRange, LazyPieces, Piece, StoredArray, TensorEntry
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError
from ckpt_cli.formats.deepspeed import layout as zl
from ckpt_cli.formats.deepspeed.layout import Slot


class ZeroFile(Protocol):
    """One file's tree: a read file's (tensors as TensorRefs) or a built one's (tensors as TensorEntries)."""

    @property
    def tree(self) -> Any: ...

    @property
    def path(self) -> Path | str: ...  # as messages name it

    def array(self, ref: TensorRef) -> StoredArray: ...


def flat_pieces(
    start: int, numel: int, partitions: list[tuple[int, int, StoredArray, int]], starts: list[int] | None = None
) -> list[Piece]:
    """Pieces of global flat elements [start, start+numel) held by partitions (flat start, length, array, array start).
    `starts`: the partitions' flat starts when they are in increasing order, so that only the few a param spans are
    looked at (a param of a 1,024-rank buffer spans one or two)."""
    if starts is not None:
        first = max(bisect.bisect_right(starts, start) - 1, 0)
        partitions = partitions[first : bisect.bisect_left(starts, start + numel, lo=first)]
    pieces = []
    for p_start, p_len, array, a_start in partitions:
        if shared := zl.overlap(start, numel, p_start, p_len):
            lo, hi = shared
            pieces.append(Piece(FlatRange(lo - start, hi - lo), array, a_start + lo - p_start))
    return pieces


def stage3_frozen_pieces(models: Mapping[int, ZeroFile], name: str, numel: int, world: int) -> list[Piece]:
    """A frozen parameter at stage 3: each rank's model states hold its ceil(n/W) fragment (docs/formats.md §2.8)."""
    parts = []
    for r in range(world):
        ref = models[r].tree["frozen_param_fragments"][name]
        start, end = zl.stage3_rank_range(numel, world, r)
        parts.append((start, end - start, models[r].array(ref), 0))
    return flat_pieces(0, numel, parts)


class OptimizerStates(Mapping[int, Any]):
    """Each rank's `optimizer_state_dict`, its file parsed when first asked for (inspect reads rank 0's alone);
    DataError naming a file that has none. `kept=False`: a rank file parsed here is not held beyond the next one
    (`LazyRanks.unkept`): a ZeRO-1/2 layout takes what it needs from each at once, and 1,024 parsed rank files of a
    20,000-parameter model held 16 MB, twice in a diff."""

    def __init__(self, optims: Mapping[int, ZeroFile], kept: bool = True) -> None:
        self.optims, self.kept = optims, kept

    def file(self, rank: int) -> ZeroFile:
        unkept = None if self.kept else getattr(self.optims, "unkept", None)
        return unkept(rank) if unkept is not None else self.optims[rank]

    def __getitem__(self, rank: int) -> Any:
        return state_of(self.file(rank), rank)

    def __iter__(self) -> Iterator[int]:
        return iter(self.optims)

    def __len__(self) -> int:
        return len(self.optims)


def state_of(file: ZeroFile, rank: int) -> dict[str, Any]:
    """The file's `optimizer_state_dict` (DataError naming the file that has none)."""
    osd = file.tree.get("optimizer_state_dict")
    if not isinstance(osd, dict):
        raise DataError(f"{getattr(file, 'path', f'rank {rank}')}: no optimizer_state_dict")
    return osd


class WholePiece:
    """Makes a stored tensor's one piece (slotted, not a closure: an MoE model-states file holds 20,000)."""

    __slots__ = ("file", "ref")

    def __init__(self, file: ZeroFile, ref: TensorRef) -> None:
        self.file, self.ref = file, ref

    def __call__(self) -> list[Piece]:
        ref = self.ref
        return [Piece(Box((0,) * len(ref.shape), ref.shape), self.file.array(ref))]


class SlotPieces:
    """Makes one param's pieces of a stage 1/2 flat buffer (slotted, not a closure: an MoE checkpoint holds 60,000)."""

    __slots__ = ("layout", "g", "key", "holders", "slot")

    def __init__(self, layout: Stage12Partitions, g: int, key: str | None, holders: list[int], slot: Slot) -> None:
        self.layout, self.g, self.key, self.holders, self.slot = layout, g, key, holders, slot

    def __call__(self) -> list[Piece]:
        return self.layout.slot_pieces(self.g, self.key, self.holders, self.slot)


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
        self.osd = OptimizerStates(optims, kept=False)
        self._sizes: dict[tuple[int, int], int] = {}
        self._offsets: dict[int, list[Slot]] = {}
        self._parts: dict[tuple[int, str | None, int], tuple[list[tuple[int, int, StoredArray, int]], list[int] | None]] = {}
        self.shapes: list[dict[str, zl.Shape]] = model.tree.get("param_shapes") or []
        base = self.osd[0]["base_optimizer_state"]
        self.state, self.groups = base.get("state", {}), base.get("param_groups", [])
        self.paddings = self.osd[0].get("param_alignment_paddings") or [None] * len(self.shapes)  # BF16_Optimizer saves none
        self.alignment_padding = any(any(p or []) for p in self.paddings)

    def offsets(self, g: int) -> list[Slot]:
        if g not in self._offsets:  # asked for once per state key: a group of thousands of params
            self._offsets[g] = zl.flat_slots(list(self.shapes[g].items()), self.paddings[g])
        return self._offsets[g]

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

    def _partition_size(self, g: int, holder: int) -> int:
        """The size of each partition of group g, as `holder`'s file tells (its saved partition and padding)."""
        if (g, holder) not in self._sizes:
            osd, k = self.osd[holder], self.index(holder, g)
            saved, padding = osd["single_partition_of_fp32_groups"][k].shape[0], osd["group_paddings"][k]
            self._sizes[g, holder] = zl.partition_size_of_saved(saved, padding, self.stage is None)
        return self._sizes[g, holder]

    def _partitions(self, g: int, holders: list[int]) -> dict[str | None, list[tuple[int, int, StoredArray, int]]]:
        """Every holder's partition of group g's flat fp32 weights (key None) and of each moment: (flat start, saved
        length, array, 0) by key. Each holder's file is parsed once for all of them, and not kept."""
        size = self._partition_size(g, holders[0])
        keys = [None, *(key for key, ref in self.state.get(g, {}).items() if isinstance(ref, TensorRef) and ref.shape)]
        parts: dict[str | None, list[tuple[int, int, StoredArray, int]]] = {key: [] for key in keys}
        for d, r in enumerate(holders):
            file = self.osd.file(r)
            osd, k = state_of(file, r), self.index(r, g)
            for key in keys:
                ref = osd["single_partition_of_fp32_groups"][k] if key is None else _moment(osd, k, key, file)
                parts[key].append((d * size, ref.shape[0], file.array(ref), 0))
        return parts

    def _lazy_pieces(self, g: int, key: str | None, holders: list[int], slot: Slot) -> LazyPieces:
        """The param's pieces over the holders' partitions, made (and the partitions read) when asked for, and not
        kept; their count follows from the partition size, which the first holder's file tells."""
        size = self._partition_size(g, holders[0])
        count = (slot.offset + slot.numel - 1) // size - slot.offset // size + 1 if slot.numel and size else 0
        return LazyPieces(SlotPieces(self, g, key, holders, slot), count, keep=False)

    def slot_pieces(self, g: int, key: str | None, holders: list[int], slot: Slot) -> list[Piece]:
        at = (g, key, holders[0])
        if at not in self._parts:
            for name, parts in self._partitions(g, holders).items():
                starts = [p[0] for p in parts]
                self._parts[g, name, holders[0]] = parts, starts if starts == sorted(starts) else None
        return flat_pieces(slot.offset, slot.numel, *self._parts[at])

    def model_tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for g in range(len(self.shapes)):
            for holders, name_of in self.replicas(g):
                for slot in self.offsets(g):
                    name = name_of(slot.name)
                    out[name] = TensorEntry(name, dtypes.FLOAT32, slot.shape, "model", self._lazy_pieces(g, None, holders, slot))
        return out

    def optimizer_tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for g in range(len(self.shapes)):
            for key, ref in self.state.get(g, {}).items():
                if not isinstance(ref, TensorRef):
                    continue
                for holders, name_of in self.replicas(g):
                    if not ref.shape:  # step: one 0-d value per group, the same on every rank
                        file = self.osd.file(holders[0])
                        held = _moment(state_of(file, holders[0]), self.index(holders[0], g), key, file)
                        step = [Piece(Box((), ()), file.array(held))]
                    for slot in self.offsets(g):
                        pieces = self._lazy_pieces(g, key, holders, slot) if ref.shape else step
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


def _moment(osd: dict[str, Any], k: int, key: str, file: ZeroFile) -> TensorRef:
    """Group k's state `key` in a stage 1/2 rank file (DataError naming the file where it is missing: rank 0's has it)."""
    try:
        ref = osd["base_optimizer_state"]["state"][k][key]
    except (KeyError, IndexError, TypeError):
        ref = None
    if not isinstance(ref, TensorRef):
        raise DataError(f"{getattr(file, 'path', 'a rank file')}: no optimizer state {key!r} for group {k}, which rank 0's file has")
    return ref


class Stage3Pieces:
    """One param's pieces over the ranks' stage 3 flat partitions (a RangeLayout)."""

    __slots__ = ("layout", "s", "key", "slot")

    def __init__(self, layout: Stage3Partitions, s: int, key: str | None, slot: Slot) -> None:
        self.layout, self.s, self.key, self.slot = layout, s, key, slot

    def __call__(self) -> list[Piece]:
        return self.layout.slot_pieces(self.s, self.key, self.slot)

    def span(self, start: int, count: int) -> list[Piece]:
        return self.layout.slot_pieces_in(self.s, self.key, self.slot, start, count)

    def arrays(self) -> list[StoredArray]:
        return self.layout.flats(self.s, self.key)


class Stage3Partitions:
    """Stage 3: every parameter partitioned on its own (ceil(n/W) per rank), concatenated per sub-group."""

    alignment_padding = False
    experts = None  # DeepSpeed refuses native MoE at stage 3 (engine.py _validate_zero3_moe_compatibility)

    def __init__(self, models: Mapping[int, ZeroFile], optims: Mapping[int, ZeroFile], world: int) -> None:
        self.models, self.optims, self.world = models, optims, world
        self.osd = OptimizerStates(optims)
        self._flats: dict[tuple[int, str | None], list[StoredArray]] = {}
        self.shapes: list[dict[str, zl.Shape]] = models[0].tree.get("param_shapes") or []
        inner = self.osd[0].get("optimizer_state_dict") or {}
        self.state, self.groups = inner.get("state", {}), inner.get("param_groups", [])

    def offsets(self, s: int) -> list[Slot]:
        """Sub-group s's params in every rank's flat partition."""
        return zl.stage3_slots(list(self.shapes[s].items()), self.world)

    def flats(self, s: int, key: str | None) -> list[StoredArray]:
        """Each rank's flat partition of sub-group s: fp32 weights (key None) or a moment, of exactly the elements
        its parameters take (DeepSpeed copies it into a buffer of that size; zero_to_fp32 refuses any other)."""
        if (s, key) in self._flats:
            return self._flats[s, key]
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
        self._flats[s, key] = arrays
        return arrays

    def flat_problems(self) -> list[str]:
        """Every rank's flats read and their sizes checked (what the lazily made pieces rely on): the first problem."""
        try:
            for s in range(len(self.shapes)):
                self.flats(s, None)
                for key, ref in self.state.get(s, {}).items():
                    if isinstance(ref, TensorRef) and ref.shape:
                        self.flats(s, key)
        except DataError as exc:
            return [str(exc)]
        return []

    def slot_pieces(self, s: int, key: str | None, slot: Slot) -> list[Piece]:
        pieces = []
        for r, array in enumerate(self.flats(s, key)):
            start, end = zl.stage3_rank_range(slot.numel, self.world, r)
            if start < end:
                pieces.append(Piece(FlatRange(start, end - start), array, slot.offset))
        return pieces

    def slot_pieces_in(self, s: int, key: str | None, slot: Slot, start: int, count: int) -> list[Piece]:
        """The pieces of elements [start, start + count): rank r holds [r * ceil(n / W), (r + 1) * ceil(n / W))."""
        if count <= 0 or slot.numel == 0:
            return []
        part = -(-slot.numel // self.world)
        arrays = self.flats(s, key)
        pieces = []
        for r in range(start // part, min(self.world, (start + count - 1) // part + 1)):
            lo, hi = zl.stage3_rank_range(slot.numel, self.world, r)
            if lo < hi:
                pieces.append(Piece(FlatRange(lo, hi - lo), arrays[r], slot.offset))
        return pieces

    def _lazy_pieces(self, s: int, key: str | None, slot: Slot) -> LazyPieces:
        return LazyPieces.of(Stage3Pieces(self, s, key, slot), zl.stage3_rank_count(slot.numel, self.world))

    def model_tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for s in range(len(self.shapes)):
            for slot in self.offsets(s):
                out[slot.name] = TensorEntry(slot.name, dtypes.FLOAT32, slot.shape, "model", self._lazy_pieces(s, None, slot))
        return out

    def optimizer_tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for s in range(len(self.shapes)):
            slots = self.offsets(s)
            for key, ref in self.state.get(s, {}).items():
                if not isinstance(ref, TensorRef):
                    continue
                step = [Piece(Box((), ()), self.optims[0].array(ref))]
                for slot in slots:
                    out.update(moment(slot, key, ref, self._lazy_pieces(s, key, slot) if ref.shape else step))
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
    name = path_name(path)
    return {name: TensorEntry(name, ref.dtype, slot.shape if ref.shape else (), "optimizer", pieces, path)}
