"""Resharding a DeepSpeed ZeRO checkpoint to a new data-parallel world size that plain
`engine.load_checkpoint(dir)` accepts (no universal-checkpoint flag).

Every file is rewritten from the source's own trees: the same keys, pickle globals and
hyper-parameters, with the flat fp32 partitions and Adam moments re-cut for the new world size and
the bookkeeping that depends on it (dp_world_size, partition_count, group paddings, slice mappings,
stage-3 sub-groups and frozen fragments) recomputed. Tensor data is streamed piece by piece from
the source partitions. Rules: docs/formats.md §2.6-2.9.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core import computed
from ckpt_cli.core.dtypes import dtype_digest
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.paths import plain_component
from ckpt_cli.core.pickles.safe_pickle import TorchSize
from ckpt_cli.core.write.plan import Literal, OutputFile, WritePlan
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.deepspeed import layout as zl
from ckpt_cli.formats.deepspeed import pipeline as deepspeed_pipeline
from ckpt_cli.formats.deepspeed import regroup as deepspeed_regroup
from ckpt_cli.formats.deepspeed import stage0 as deepspeed_stage0
from ckpt_cli.formats.deepspeed.files import built, file_segments, outline, own, rekey_client_state, state_entry, tensorize
from ckpt_cli.formats.deepspeed.layout import Slot, ZeroLayout
from ckpt_cli.formats.deepspeed.rank_files import fragment_address
from ckpt_cli.formats.deepspeed.reader import LATEST, Source, ZeroSource
from ckpt_cli.formats.deepspeed.stage3_reshard import Stage3Reshard
from ckpt_cli.formats.deepspeed.template import BuiltSource


class DeepSpeedWriter:
    """Keeps no state between calls: plan() makes a Stage12Reshard or Stage3Reshard for the one checkpoint."""

    name = "deepspeed"
    dest_is_dir = True

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        src = ckpt.source
        if ckpt.format == "deepspeed" and isinstance(src, deepspeed_pipeline.PipelineSource) and options.world_size:
            return self._pipeline(ckpt, src, dest, options)
        if ckpt.format == "deepspeed" and isinstance(src, deepspeed_stage0.Stage0Source) and options.world_size:
            return Stage0Reshard(ckpt, src, options).plan(dest)
        if ckpt.format != "deepspeed" or not isinstance(src, (Source, BuiltSource)):
            raise UsageError("writing deepspeed needs a DeepSpeed source, or a training run's state (convert from dcp)")
        world = options.world_size  # set by ops/convert.layout_for from the registry row
        assert world, "a deepspeed write is planned with its world size"
        _refuse_views(ckpt, src.dtypes)
        zero_config = (src.model.tree.get("ds_config") or {}).get("zero_optimization") or {}
        reshard: Stage12Reshard | Stage3Reshard
        experts_note = None
        if src.stage == 3:
            if options.ep_size is not None:
                raise UsageError("--ep-size applies to DeepSpeed MoE checkpoints (ZeRO-1/2); this one is ZeRO-3")
            reshard = Stage3Reshard(ckpt, src, world, zero_config.get("sub_group_size", 10**9), options.per_rank_rule)
        else:
            round_robin = bool(zero_config.get("round_robin_gradients")) and src.stage in (1, 2)
            if round_robin and src.layout.alignment_padding:
                raise UsageError("reshard of checkpoints saved with both round_robin_gradients and parameter_alignment is not supported")
            target, experts_note = _expert_layout(src, world, options.ep_size, round_robin)
            reshard = Stage12Reshard(ckpt, src, world, round_robin, options.per_rank_rule, target)
        tag = plain_component(ckpt.tag or src.folder.name, f"{ckpt.path or 'the source'}: DeepSpeed tag")  # a folder name in DST
        files = reshard.files(tag)
        for name, rank_file in src.copies.items():  # MoE expert files: the same at every data-parallel size
            where = f"{tag}/{plain_component(name, f'{src.folder}: file name')}"
            files.append(OutputFile(where, file_segments(tensorize(rank_file), where)))
        files.append(OutputFile(LATEST, [Literal(tag.encode())], commit_marker=True))
        notes = (
            [
                f"wrote ZeRO-{src.stage} for {_ranks(world, 'data-parallel ')}; load it with a plain "
                f"engine.load_checkpoint() on {_ranks(world)} with the DeepSpeed config given"
            ]
            if isinstance(src, BuiltSource)
            else [
                f"resharded ZeRO-{src.stage or 1} from {src.world} to {_ranks(world, 'data-parallel ')}; load it with a plain "
                f"engine.load_checkpoint() on {_ranks(world)} with the same DeepSpeed config"
            ]
        )
        if reshard.per_rank_note:
            notes.append(reshard.per_rank_note)
        if experts_note:
            notes.append(experts_note)
        threads = 1 if isinstance(reshard, Stage3Reshard) and reshard.slivers() else None
        return WritePlan(self.name, dest, True, files, notes, threads)

    def _pipeline(self, ckpt: Checkpoint, src: deepspeed_pipeline.PipelineSource, dest: Path, options: WriteOptions) -> WritePlan:
        """Each pipeline stage resharded to the new data-parallel size (world size / stages), the layer files copied."""
        world, stages = options.world_size or 1, len(src.stages)
        _refuse_views(ckpt, src.dtypes)
        if world % stages:
            raise UsageError(
                f"--world-size {world} is not a multiple of the {stages} pipeline stages (the ranks are stages x data parallel)"
            )
        files, notes = [], []
        for stage in src.stages:
            plan = self.plan(stage, dest, dataclasses.replace(options, world_size=world // stages))
            files += [f for f in plan.files if f.relpath != LATEST]
            notes += [n for n in plan.notes[1:] if n not in notes]  # the per-rank and expert notes; the first is said below
        tag = plain_component(ckpt.tag or src.folder.name, f"{ckpt.path}: DeepSpeed tag")
        for name, layer in src.layers.items():
            where = f"{tag}/{plain_component(name, f'{src.folder}: file name')}"
            files.append(OutputFile(where, file_segments(tensorize(layer), where)))
        files.append(OutputFile(LATEST, [Literal(tag.encode())], commit_marker=True))
        said = (
            f"resharded {stages} pipeline stages from {src.data_parallel} to {_ranks(world // stages, 'data-parallel ')} each; load it "
            f"with a plain engine.load_checkpoint() on {_ranks(world)} with the same PipelineModule ({stages} stages) and DeepSpeed config"
        )
        return WritePlan(self.name, dest, True, files, [said, *notes])


def _refuse_views(ckpt: Checkpoint, read: bytes) -> None:
    """A reshard writes the source's files again: a view that selected, renamed or cast tensors cannot apply."""
    if dtype_digest(ckpt.tensors) != read:
        raise UsageError(
            "reshard of a DeepSpeed checkpoint copies every tensor as it is: --filter, prefixes, --dtype and --weights-only do not apply"
        )


def _ranks(n: int, kind: str = "") -> str:
    return f"{n} {kind}rank{'s' if n != 1 else ''}"


def _expert_layout(
    src: ZeroSource, world: int, asked: tuple[tuple[str, int], ...] | None, round_robin: bool
) -> tuple[ZeroLayout, str | None]:
    """MoE: the layout to write (the saved one, or its MoE groups rebuilt at new expert-parallel sizes: each kept where it
    divides the new world size, else changed, or all set by --ep-size) and a note saying what the load needs."""
    experts = src.layout.experts
    if experts is None:
        if asked is not None:
            raise UsageError("--ep-size applies to DeepSpeed MoE checkpoints (expert parallel); this one has no MoE layers")
        return src.layout, None
    current = deepspeed_regroup.module_ep_sizes(src.layout)
    num_experts = {m: experts.num_local[m] * ep for m, ep in current.items()}
    new = deepspeed_regroup.choose_ep_sizes(current, num_experts, world, asked)
    target: ZeroLayout = src.layout
    if new != current:
        if round_robin or src.layout.alignment_padding:
            raise UsageError(
                "changing ep_size of a checkpoint saved with round_robin_gradients or parameter_alignment is not supported; "
                f"give a --world-size that the expert-parallel sizes ({', '.join(map(str, sorted(set(current.values()))))}) divide"
            )
        target = deepspeed_regroup.regroup(src.layout, new)
    modules = experts.layers
    sizes = sorted({new[m] for m in modules})
    if new == current:
        said = f"kept the expert-parallel size{'s' if len(sizes) > 1 else ''} ({', '.join(f'ep_size_{e}' for e in sizes)})"
    else:
        why = "--ep-size" if asked is not None else f"the saved size does not divide --world-size {world}"
        changes = ", ".join(f"{m} {current[m]} -> {new[m]}" for m in modules if new[m] != current[m])
        said = f"changed the expert-parallel size ({changes}; {why}): experts regrouped to the new expert-parallel ranks"
    if len(sizes) > 1:
        order = ", ".join(dict.fromkeys(str(g.get("name")) for g in target.groups if g.get("moe")))
        return target, (
            f"{said}; every rank's optimizer file lists the MoE param groups in one order ({order}), which DeepSpeed builds "
            "from a set of group names: load with a PYTHONHASHSEED that gives every process that order"
        )
    return target, f"{said}; load with MoE layers built with ep_size={sizes[0]} and the same num_experts"


@dataclass
class Stage12Reshard:
    """ZeRO-1/2 and BF16_Optimizer at a new world size: each group's flat buffer cut into W' equal partitions
    (re-ordered first under round_robin_gradients), group paddings and slice mappings recomputed (docs/formats.md §2.6)."""

    ckpt: Checkpoint
    src: ZeroSource
    world: int
    round_robin: bool
    per_rank_rule: str
    target: ZeroLayout  # the groups written: the source's, or its MoE groups at new expert-parallel sizes (deepspeed_regroup)
    per_rank_note: str | None = None
    _slots: dict[int, tuple[list[Slot], list[int]]] = dataclasses.field(default_factory=dict)  # group -> (slots, their ends)
    _template: dict[str, Any] | None = None  # the source optimizer file tensorized, its per-rank entries left out

    def files(self, tag: str) -> list[OutputFile]:
        mp = getattr(self.src, "pipeline_stage", None) or 0  # a pipeline stage's files carry its mp_rank
        name = f"{tag}/mp_rank_{mp:02d}_model_states.pt"
        out = [OutputFile(name, self._model_states(name))]
        for rank in range(self.world):
            name = f"{tag}/{self.src.optim_prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"
            out.append(built(name, functools.partial(self._optimizer_file, rank, name), self.ckpt))
        return out

    def partitioning(self, g: int, rank: int) -> tuple[int, int, Callable[[str], str]]:
        """Group g on a new rank: its partition count, the rank's partition, the logical name of a param in it
        (MoE: the expert-data-parallel group of the rank's expert-parallel rank, docs/formats.md §2.12)."""
        experts = self.target.experts
        if experts is None:
            return self.world, rank, str
        ep_rank, index = experts.position(g, self.world, rank)
        return experts.partition_count(g, self.world), index, functools.partial(experts.name, ep_rank=ep_rank)

    def slots(self, g: int) -> list[Slot]:
        """Group g's params in the new flat order."""
        if g not in self._slots:
            slots = self._order(g)
            self._slots[g] = (slots, [slot.end for slot in slots])
        return self._slots[g][0]

    def within(self, g: int, start: int, size: int) -> list[Slot]:
        """Group g's params with elements in [start, start+size)."""
        return zl.slots_within(self.slots(g), self._slots[g][1], start, size)

    def _order(self, g: int) -> list[Slot]:
        slots = self.target.offsets(g)
        if not self.round_robin:
            return slots  # the order, and with it the alignment pads, do not depend on W
        params = [(slot.name, slot.shape) for slot in slots]
        experts = self.target.experts
        old, new = (
            (experts.partition_count(g, self.src.world), experts.partition_count(g, self.world))
            if experts
            else (self.src.world, self.world)
        )
        return zl.flat_slots(zl.round_robin(zl.undo_round_robin(params, old), new))

    def _model_states(self, where: str) -> list[Any]:
        tree = tensorize(self.src.model)
        tree["dp_world_size"] = self.world  # the one value load_checkpoint compares with the live world size
        self.per_rank_note = rekey_client_state(tree, self.world, self.per_rank_rule)
        if self.round_robin or self.target is not self.src.layout:  # the flat order: round robin makes it depend on W
            groups = range(len(self.target.shapes))
            tree["param_shapes"] = [OrderedDict((slot.name, TorchSize(slot.shape)) for slot in self.slots(g)) for g in groups]
        return file_segments(tree, where)

    def _optimizer_file(self, rank: int, where: str) -> list[Any]:
        if self._template is None:
            remade = ("single_partition_of_fp32_groups", "group_paddings", "partition_count", "param_slice_mappings")
            self._template = tensorize(self.src.optims[0], outline(self.src.optims[0], remade))
        state_path = ("optimizer_state_dict", "base_optimizer_state", "state")  # what the rank rewrites: its own copies
        groups = self._template["optimizer_state_dict"]["base_optimizer_state"]["state"]
        tree = own(self._template, state_path, *[(*state_path, g) for g in groups])
        osd = tree["optimizer_state_dict"]
        if isinstance(self.target, deepspeed_regroup.Regrouped):
            self._regrouped(osd, self.target)
        bf16_optimizer = self.src.stage is None
        fp32, paddings, mappings, counts = [], [], [], []
        for g in range(len(self.target.shapes)):
            count, index, name_of = self.partitioning(g, rank)
            slots = self.slots(g)
            data = zl.flat_numel(slots)
            size = zl.partition_size(data, count)
            start = index * size
            pad = zl.group_padding(data, count, index, bf16_optimizer)
            here = self.within(g, start, size)
            dtypes = functools.partial(state_entry, self.ckpt, name_of(slots[0].name))  # a group's params share their dtypes
            fp32.append(self._flat(here, dtypes(""), "", start, zl.saved_partition_numel(size, pad, bf16_optimizer), f"fp32.{g}", name_of))
            state = osd["base_optimizer_state"]["state"].get(g)
            if state is not None:
                for key, value in list(state.items()):
                    if isinstance(value, TensorEntry) and value.shape:
                        state[key] = self._flat(here, dtypes(key), key, start, size, f"{key}.{g}", name_of)
            paddings.append(pad)
            counts.append(count)
            mappings.append(OrderedDict((name, fragment_address(n, at)) for name, n, at in zl.slice_mappings(here, start, size)))
        osd["single_partition_of_fp32_groups"] = fp32
        osd["group_paddings"] = paddings
        osd["partition_count"] = counts
        if "param_slice_mappings" in osd:
            osd["param_slice_mappings"] = mappings
        return file_segments(tree, where)

    @staticmethod
    def _regrouped(osd: dict[str, Any], target: deepspeed_regroup.Regrouped) -> None:
        """The optimizer file's per-group entries for the rebuilt groups: each takes its template group's state (the step;
        the moments are cut afterwards) and hyper-parameters, under its new name."""
        base = osd["base_optimizer_state"]
        saved = base["state"]
        base["state"] = {g: {k: copy.copy(v) for k, v in saved[t].items()} for g, t in enumerate(target.templates) if t in saved}
        base["param_groups"] = [{**copy.deepcopy(dict(group)), "params": [g]} for g, group in enumerate(target.groups)]
        if "param_alignment_paddings" in osd:  # compared with the live layout at load: one zero per param (no alignment)
            osd["param_alignment_paddings"] = [[0] * len(shapes) for shapes in target.shapes]

    def _flat(
        self, slots: list[Slot], like: TensorEntry, key: str, start: int, length: int, name: str, name_of: Callable[[str], str] = str
    ) -> TensorEntry:
        """Elements [start, start+length) of a group's flat buffer, of `like`'s dtype, from `slots` (those with elements
        there): the params' master weights (key "") or moments (`name_of`: a param's logical name; MoE: a local
        expert's global name)."""
        parts = []
        for slot in slots:
            if shared := zl.overlap(slot.offset, slot.numel, start, length):
                lo, hi = shared
                parts.append((lo - start, state_entry(self.ckpt, name_of(slot.name), key), lo - slot.offset, hi - lo))
        return computed.flat(name, like.dtype, length, parts)


class Stage0Reshard:
    """DeepSpeed MoE without ZeRO at a new world size: the files do not depend on the data-parallel size, so they are
    written again as they are (dp_world_size recorded anew), unless the expert-parallel size changes: then each
    expert-parallel rank's optimizer file is rebuilt, its param groups as DeepSpeed builds them for the new ep_size
    (deepspeed/regroup.py) and each param's state taken by name (docs/formats.md §2.12)."""

    def __init__(self, ckpt: Checkpoint, src: deepspeed_stage0.Stage0Source, options: WriteOptions) -> None:
        _refuse_views(ckpt, src.dtypes)
        self.ckpt, self.src, self.world, self.rule = ckpt, src, options.world_size or 1, options.per_rank_rule
        files = src.files
        current = {m: files.ep for m in files.layout.layers}
        num_experts = {m: files.layout.num_local[m] * files.ep for m in current}
        new = deepspeed_regroup.choose_ep_sizes(current, num_experts, self.world, options.ep_size)
        if len(set(new.values())) > 1:
            raise UsageError("DeepSpeed MoE without ZeRO keeps one expert-parallel size for every MoE layer; give one --ep-size")
        self.ep = next(iter(new.values()))
        self.target: deepspeed_regroup.Regrouped | None = None
        if self.ep != files.ep:
            if files.shapes is None:
                raise UsageError(
                    f"{src.folder}: changing ep_size needs each optimizer entry's parameter, which ckpt could not tell (see inspect); "
                    f"give a --world-size that {files.ep} divides"
                )
            saved = deepspeed_regroup.Regrouped(files.shapes, files.groups, files.layout, list(range(len(files.groups))))
            self.target = deepspeed_regroup.regroup(saved, new)
        self.state: dict[str, list[tuple[str, TensorEntry]]] = {}
        for entry in ckpt.tensors.values():
            if entry.path and entry.path[:2] == ("optimizer", "state"):
                self.state.setdefault(str(entry.path[2]), []).append((str(entry.path[3]), entry))

    def plan(self, dest: Path) -> WritePlan:
        files, tag = self.src.files, plain_component(self.ckpt.tag or self.src.folder.name, f"{self.ckpt.path}: DeepSpeed tag")
        optimizers = [self._optimizer(e) for e in range(self.ep)] if self.target else None
        model = tensorize(files.model)
        model["dp_world_size"] = self.world
        per_rank_note = rekey_client_state(model, self.world, self.rule)
        if optimizers:
            model["optimizer"] = optimizers[0]  # rank 0's optimizer state, as DeepSpeed saves it there (an MoE load reads expp files)
        out = [OutputFile(f"{tag}/mp_rank_00_model_states.pt", file_segments(model, f"{tag}/mp_rank_00_model_states.pt"))]
        for f in [*files.experts.values(), *([] if optimizers else files.expp.values())]:  # written again as they are
            name = f"{tag}/{plain_component(f.path.name, f'{self.src.folder}: file name')}"
            out.append(OutputFile(name, file_segments(tensorize(f), name)))
        for e, optimizer in enumerate(optimizers or []):
            name = f"{tag}/expp_rank_{e}_mp_rank_00_optim_states.pt"
            out.append(OutputFile(name, file_segments({"optimizer": optimizer}, name)))
        out.append(OutputFile(LATEST, [Literal(tag.encode())], commit_marker=True))
        said = f"expert-parallel size {files.ep} -> {self.ep}, experts regrouped" if self.target else f"expert-parallel size {self.ep} kept"
        notes = [
            f"DeepSpeed MoE without ZeRO for {_ranks(self.world)} ({said}); load it with a plain engine.load_checkpoint() on "
            f"{_ranks(self.world)} with MoE layers built with ep_size={self.ep}"
        ]
        return WritePlan(DeepSpeedWriter.name, dest, True, out, notes + ([per_rank_note] if per_rank_note else []))

    def _optimizer(self, ep_rank: int) -> dict[str, Any]:
        """Expert-parallel rank `ep_rank`'s torch optimizer state_dict at the new ep_size: its params numbered in group order."""
        assert self.target is not None
        state: dict[int, dict[str, TensorEntry]] = {}
        groups = []
        index = 0
        for g, shapes in enumerate(self.target.shapes):
            params = []
            for local in shapes:
                name = self.target.experts.name(local, ep_rank)
                if name in self.state:
                    state[index] = {key: copy.copy(entry) for key, entry in self.state[name]}
                params.append(index)
                index += 1
            groups.append({**{k: copy.deepcopy(v) for k, v in self.target.groups[g].items() if k != "params"}, "params": params})
        return {"state": state, "param_groups": groups}


WRITER = DeepSpeedWriter()
