"""ZeRO-3 resharded to a new world size: every parameter partitioned on its own (ceil(n/W) elements per rank), the
sub-groups re-formed, the frozen fragments re-cut, and each new rank's flat partitions made as a plan of copies from the
source's flats (core/copies.py). Rules: docs/formats.md §2.7-2.9. Used by formats/deepspeed/writer.py.
"""

from __future__ import annotations

import copy
import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, overload

from ckpt_cli.core import computed
from ckpt_cli.core.copies import Parts, PlannedFlat, SourceTable
from ckpt_cli.core.model import Checkpoint, FlatPart, TensorEntry, flat_entry
from ckpt_cli.core.pickles.safe_pickle import TorchSize
from ckpt_cli.core.write.plan import OutputFile, SharedBuild
from ckpt_cli.formats.deepspeed import layout as zl
from ckpt_cli.formats.deepspeed.files import built, file_segments, outline, own, rekey_client_state, state_entry, tensorize
from ckpt_cli.formats.deepspeed.rank_files import LazyRanks
from ckpt_cli.formats.deepspeed.reader import ZeroSource

SLIVER = 1 << 16  # elements: a rank's share of a param below which making its file is Python work, not copying bytes


class Stage3Reshard:
    """ZeRO-3 at a new world size: per-parameter partitions of ceil(n/W) elements, sub-groups re-formed
    (their number depends on W through the partition sizes), frozen fragments re-cut (docs/formats.md §2.7-2.9)."""

    def __init__(self, ckpt: Checkpoint, src: ZeroSource, world: int, sub_group_size: int | None, per_rank_rule: str = "wrap") -> None:
        self.ckpt, self.src, self.world = ckpt, src, world
        self.per_rank_rule: str = per_rank_rule
        self.per_rank_note: str | None = None
        self._template: dict[str, Any] | None = None  # the source optimizer file tensorized, its per-rank entries left out
        self._starts: dict[int, list[int]] = {}  # sub-group -> where each param's partition starts in a rank's flat
        self._entries: dict[tuple[int, str], list[TensorEntry]] = {}  # (sub-group, state key) -> its params' tensors
        self._tables: dict[tuple[int, str], SourceTable | None] = {}  # (sub-group, state key) -> where its tensors lie
        self._arrays: dict[int, tuple[Any, Any]] = {}  # sub-group -> its params' sizes and partition starts (numpy)
        self._model_files: dict[tuple[int, bool], list[Any]] = {}  # (old rank, is rank 0) -> a model-states file's segments
        shapes = src.layout.shapes
        groups = [[(name, tuple(shape)) for s in group["params"] for name, shape in shapes[s].items()] for group in src.layout.groups]
        self.subs, self.group_subs = zl.stage3_group_sub_groups(groups, world, sub_group_size)

    def slivers(self) -> bool:
        """Whether a rank's share of a param is small on average (< SLIVER elements): each rank file is then thousands
        of slivers gathered by Python arithmetic, and one writing thread is faster and smaller than two (measured:
        MoE ZeRO-3 2 -> 64 ranks 106 s / 174 MB on one, 113 s / 201 MB on two)."""
        params = [math.prod(shape) for sub in self.subs for _, shape in sub]
        return bool(params) and sum(params) < SLIVER * len(params) * self.world

    def partition(self, entry: TensorEntry, rank: int, name: str) -> TensorEntry:
        """Rank's ceil(n/W) elements of a parameter, zero-padded past its end."""
        start, end = zl.stage3_rank_range(entry.numel, self.world, rank)
        return computed.flat(name, entry.dtype, zl.stage3_partition_size(entry.numel, self.world), [(0, entry, start, end - start)])

    def flat(self, s: int, key: str, rank: int, name: str) -> TensorEntry:
        """Rank's flat partition of sub-group s: its params' partitions end to end. Where each param lies is the same on
        every rank; what a rank holds of it follows from the rank's number: a plan of copies from the source's runs
        (core/copies.py), made by numpy over all the params at once, or (where the source is not plain bytes) part by part."""
        if (s, key) not in self._entries:
            if s not in self._starts:
                self._starts[s] = [slot.offset for slot in zl.stage3_slots(self.subs[s], self.world)]
            self._entries[s, key] = [state_entry(self.ckpt, name, key) for name, _ in self.subs[s]]
        starts, entries = self._starts[s], self._entries[s, key]
        length = starts[-1] + zl.stage3_partition_size(entries[-1].numel, self.world)  # stage3_flat_numel, from the starts
        parts = Stage3RankParts(starts, entries, self.world, rank)
        if any(e.derived is not None for e in entries):  # computed tensors (Orbax arrays): no stored bytes to plan copies of
            return computed.flat(name, entries[-1].dtype, length, list(parts))
        table = functools.partial(self._table, s, key)
        plan = functools.partial(self._plan, s, rank)
        return flat_entry(name, PlannedFlat(entries[-1].dtype, length, parts, starts, table, plan))

    def _table(self, s: int, key: str) -> SourceTable | None:
        if (s, key) not in self._tables:
            entries = self._entries[s, key]
            self._tables[s, key] = SourceTable.of(entries, entries[-1].dtype)
        return self._tables[s, key]

    def _plan(self, s: int, rank: int) -> Parts:
        import numpy as np

        if s not in self._arrays:
            numels = np.array([math.prod(shape) for _, shape in self.subs[s]], dtype=np.int64)
            self._arrays[s] = numels, np.array(self._starts[s], dtype=np.int64)
        return zl.stage3_rank_parts(*self._arrays[s], self.world, rank)

    def files(self, tag: str) -> list[OutputFile]:
        out = []
        for rank in range(self.world):
            name = f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            model = SharedBuild(self._model_file, rank, name)
            out.append(OutputFile(name, model()) if rank == 0 else built(name, model, self.ckpt))  # rank 0's now: it sets the notes
            name = f"{tag}/{self.src.optim_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            out.append(built(name, functools.partial(self._rank_file, self._optimizer, rank, name), self.ckpt))
        return out

    @staticmethod
    def _rank_file(tree_of: Callable[[int], Any], rank: int, name: str) -> list[Any]:
        return file_segments(tree_of(rank), name)

    def _which(self, rank: int) -> int:
        # Every rank saves its own model states at stage 3, client state included (a per-rank RNG, say), and loads
        # its own: new rank r starts from old rank r mod W ('wrap', as the per-rank rule), else from rank 0.
        return rank % len(self.src.models) if self.per_rank_rule == "wrap" else 0

    def _model_file(self, rank: int, name: str) -> list[Any]:
        """Rank's model-states file: without frozen fragments (cut per rank) the same bytes for every rank but 0 that
        starts from one old rank (the archive's folder is `archive`, not the file's name), so made once for each:
        2,000 placeholders tensorized and pickled 1,024 times had been most of a 2 -> 1,024 reshard."""
        key = (self._which(rank), rank == 0)
        if key in self._model_files:
            return self._model_files[key]
        tree = self._model_states(rank)
        segments = file_segments(tree, name)
        if not tree.get("frozen_param_fragments"):
            self._model_files[key] = segments
        return segments

    def _model_states(self, rank: int) -> Any:
        models, which = self.src.models, self._which(rank)
        tree = tensorize(models.unkept(which) if isinstance(models, LazyRanks) else models[which])
        tree["dp_world_size"] = self.world
        self.per_rank_note = rekey_client_state(tree, self.world, self.per_rank_rule)
        tree["param_shapes"] = [OrderedDict((n, TorchSize(shape)) for n, shape in sub) for sub in self.subs]
        fragments = tree.get("frozen_param_fragments")
        if fragments:
            for pname in fragments:
                fragments[pname] = self.partition(self.ckpt.tensors[pname], rank, f"frozen.{pname}")
        if rank:
            tree["shared_params"] = {}  # DeepSpeed records aliases on global rank 0 only
        return tree

    def _optimizer(self, rank: int) -> Any:
        if self._template is None:
            self._template = tensorize(self.src.optims[0], outline(self.src.optims[0], ("fp32_flat_groups",)))
        tree = own(self._template, ("optimizer_state_dict", "optimizer_state_dict"))
        osd = tree["optimizer_state_dict"]
        osd["partition_count"] = self.world
        inner = osd["optimizer_state_dict"]
        template = inner["state"].get(0, {})
        inner["state"] = {
            s: {
                key: (copy.copy(value) if not value.shape else self.flat(s, key, rank, f"{key}.{s}"))
                for key, value in template.items()
                if isinstance(value, TensorEntry)
            }
            for s in range(len(self.subs))
        }
        inner["param_groups"] = [{**group, "params": self.group_subs[i]} for i, group in enumerate(inner["param_groups"])]
        osd["fp32_flat_groups"] = [self.flat(s, "", rank, f"fp32.{s}") for s in range(len(self.subs))]
        return tree


class Stage3RankParts(Sequence[FlatPart]):
    """A rank's parts of a stage 3 flat partition (FlatPart), made as indexed: ceil(n/W) elements of each param from
    element rank * ceil(n/W), at the param's start (the same on every rank). 20,000 params, 3 flats a file."""

    __slots__ = ("starts", "entries", "world", "rank")

    def __init__(self, starts: list[int], entries: list[TensorEntry], world: int, rank: int) -> None:
        self.starts, self.entries, self.world, self.rank = starts, entries, world, rank

    def __len__(self) -> int:
        return len(self.entries)

    @overload
    def __getitem__(self, i: int) -> FlatPart: ...
    @overload
    def __getitem__(self, i: slice) -> list[FlatPart]: ...
    def __getitem__(self, i: int | slice) -> FlatPart | list[FlatPart]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        entry = self.entries[i]
        start, end = zl.stage3_rank_range(entry.numel, self.world, self.rank)
        return self.starts[i], entry, start, end - start
