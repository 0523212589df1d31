"""Resharding a DeepSpeed ZeRO checkpoint to a new data-parallel world size that plain
`engine.load_checkpoint(dir)` accepts (no universal-checkpoint flag).

Every file is rewritten from the source's own trees: the same keys, pickle globals and
hyper-parameters, with the flat fp32 partitions and Adam moments re-cut for the new world size and
the bookkeeping that depends on it (dp_world_size, partition_count, group paddings, slice mappings,
stage-3 sub-groups and frozen fragments) recomputed. Tensor data is streamed piece by piece from
the source partitions. Rules: ../shared/FORMATS.md §2.6-2.9.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Box, Checkpoint, ObjectEntry, Piece, TensorEntry, concat_flat, sub_tensor
from ckpt_cli.core.plan import Literal, OutputFile, WritePlan
from ckpt_cli.core.safe_pickle import TensorRef, TorchSize
from ckpt_cli.core.tree import flatten, path_name, unflatten
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.deepspeed import ENGINE_KEYS, LATEST, LAYOUT_KEYS, RankFile, Source, fragment_address
from ckpt_cli.formats.deepspeed_template import BuiltSource, TreeFile
from ckpt_cli.formats.torch_save import torch_file_segments


def tensorize(rank_file: RankFile | TreeFile) -> Any:
    """A copy of the file's tree whose tensors are TensorEntries over the stored bytes (module weights may tie)."""

    def convert(value: Any, under_module: bool) -> Any:
        if isinstance(value, TensorRef):
            array = rank_file.array(value)
            return TensorEntry(
                "",
                value.dtype,
                value.shape,
                "model" if under_module else "other",
                [Piece(Box((0,) * len(value.shape), value.shape), array)],
            )
        if isinstance(value, dict):
            out = type(value)() if isinstance(value, OrderedDict) else {}
            for k, v in value.items():
                out[k] = convert(v, under_module or k == "module")
            return out
        if isinstance(value, list):
            return [convert(v, under_module) for v in value]
        if isinstance(value, tuple) and any(isinstance(v, TensorRef) for v in value):
            return tuple(convert(v, under_module) for v in value)
        return copy.deepcopy(value)

    return convert(rank_file.tree, False)


def file_segments(tree: Any, where: str) -> list[Any]:
    """torch.save segments for a tree whose leaves are TensorEntries and plain values."""
    leaves, values, containers = flatten(tree, lambda v: isinstance(v, TensorEntry), where)
    tensors = {}
    for path, entry in leaves:
        name = path_name(path)
        tensors[name] = dataclasses.replace(entry, name=name, path=path)
    objects = {path_name(p): ObjectEntry(path_name(p), v, "other", p) for p, v in values}
    return torch_file_segments(Checkpoint("deepspeed", where, tensors, objects, containers=containers))


AnySource = Source | BuiltSource  # a read DeepSpeed checkpoint, or one built from a training state


def rekey_client_state(tree: dict[str, Any], world: int, rule: str) -> str | None:
    """Apply the per-rank rule (ops/crossframework.py) to the client state of a model-states tree in place."""
    from ckpt_cli.ops.crossframework import apply_per_rank_rule

    client = {k: v for k, v in tree.items() if k not in LAYOUT_KEYS and k not in ENGINE_KEYS}
    if not client:
        return None
    tensors, values, containers = flatten(client, lambda v: isinstance(v, TensorEntry), "client state")
    entries, note = apply_per_rank_rule([ObjectEntry(path_name(p), v, "other", p) for p, v in tensors + values], world, rule)
    if note:
        for key in client:
            del tree[key]
        tree.update(unflatten([(e.path, e.value) for e in entries], containers))
    return note


def round_robin_order(count: int, world: int) -> list[int]:
    """Original indices in DeepSpeed's round-robin flat order: all i % W == 0, then 1, ... (stage_1_and_2.py)."""
    return [i for j in range(min(world, count)) for i in range(j, count, world)]


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


class DeepSpeedWriter:
    name = "deepspeed"
    dest_is_dir = True

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        src = ckpt.source
        if ckpt.format != "deepspeed" or not isinstance(src, (Source, BuiltSource)):
            raise UsageError("writing deepspeed needs a DeepSpeed source, or a training run's state (convert from dcp)")
        world = options.world_size
        if not world:
            raise UsageError("writing deepspeed needs --world-size N (the new data-parallel size)")
        if {n: t.dtype for n, t in ckpt.tensors.items()} != src.dtypes:
            raise UsageError(
                "reshard of a DeepSpeed checkpoint copies every tensor as it is: --select, prefixes, --dtype "
                "and --weights-only do not apply"
            )
        zero_config = (src.model.tree.get("ds_config") or {}).get("zero_optimization") or {}
        self.round_robin = bool(zero_config.get("round_robin_gradients")) and src.stage in (1, 2)
        if self.round_robin and src.layout.details()["alignment_padding"]:
            raise UsageError("reshard of checkpoints saved with both round_robin_gradients and parameter_alignment is not supported")
        tag = ckpt.tag or src.folder.name
        self.per_rank_rule, self.per_rank_note = options.per_rank_rule, None
        if src.stage == 3:
            stage3 = Stage3Reshard(ckpt, src, world, zero_config.get("sub_group_size", 10**9), options.per_rank_rule)
            files = stage3.files(tag)
            self.per_rank_note = stage3.per_rank_note
        else:
            files = [OutputFile(f"{tag}/mp_rank_00_model_states.pt", self._model_states(src, world, tag))]
            for rank in range(world):
                name = f"{tag}/{src.optim_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
                files.append(OutputFile(name, self._optimizer_file(ckpt, src, world, rank, name)))
        files.append(OutputFile(LATEST, [Literal(tag.encode())], commit_marker=True))
        notes = (
            [
                f"wrote ZeRO-{src.stage} for {world} data-parallel ranks; load it with a plain "
                f"engine.load_checkpoint() on {world} ranks with the DeepSpeed config given"
            ]
            if isinstance(src, BuiltSource)
            else [
                f"resharded ZeRO-{src.stage or 1} from {src.world} to {world} data-parallel ranks; load it with a plain "
                f"engine.load_checkpoint() on {world} ranks with the same DeepSpeed config"
            ]
        )
        if self.per_rank_note:
            notes.append(self.per_rank_note)
        return WritePlan(self.name, dest, True, files, notes)

    def _model_states(self, src: AnySource, world: int, tag: str) -> list[Any]:
        tree = tensorize(src.model)
        tree["dp_world_size"] = world  # the one value load_checkpoint compares with the live world size
        self.per_rank_note = rekey_client_state(tree, world, self.per_rank_rule)
        if self.round_robin:  # param_shapes records the flat order, which round robin makes depend on W
            tree["param_shapes"] = [
                OrderedDict((n, TorchSize(shape)) for n, shape, _ in self._params(src, g, world)) for g in range(len(src.layout.shapes))
            ]
        return file_segments(tree, f"{tag}/mp_rank_00_model_states.pt")

    def _params(self, src: AnySource, g: int, world: int) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, offset) of group g's params in the new flat order."""
        params = src.layout.offsets(g)
        if not self.round_robin:
            return params  # the order, and with it the alignment pads, do not depend on W
        saved = round_robin_order(len(params), src.world)  # position k of the saved flat holds original param saved[k]
        original = [params[k] for k in sorted(range(len(params)), key=saved.__getitem__)]
        reordered = [original[i] for i in round_robin_order(len(original), world)]
        out, offset = [], 0
        for name, shape, _ in reordered:
            out.append((name, shape, offset))
            offset += math.prod(shape)
        return out

    def _mapping_offsets(self, src: AnySource, g: int, world: int) -> list[tuple[str, tuple[int, ...], int]]:
        """param_slice_mappings walk the params in their original order; without alignment pads DeepSpeed takes
        running sums in that order, ignoring round robin (mixed_precision_linkage.py; reproduced to match its files)."""
        params = self._params(src, g, world)
        if not self.round_robin:
            return params
        position = {orig: k for k, orig in enumerate(round_robin_order(len(params), world))}
        original = [params[position[i]] for i in range(len(params))]
        out, offset = [], 0
        for name, shape, _ in original:
            out.append((name, shape, offset))
            offset += math.prod(shape)
        return out

    def _optimizer_file(self, ckpt: Checkpoint, src: AnySource, world: int, rank: int, where: str) -> list[Any]:
        layout = src.layout
        tree = tensorize(src.optims[0])
        osd = tree["optimizer_state_dict"]
        bf16_optimizer = src.stage is None
        fp32, paddings, mappings = [], [], []
        for g in range(len(layout.shapes)):
            params = self._params(src, g, world)
            end = params[-1][2] + math.prod(params[-1][1]) if params else 0  # N: data elements of the flat group
            part = _ceil_to(end, 2 * world) // world  # P' (stage_1_and_2.py: flat aligned to 2*W, cut in W)
            start = rank * part
            pad = (
                min(max(start + part - end, 0), part)
                if not bf16_optimizer
                else (_ceil_to(end, 2 * world) - end if rank == world - 1 else 0)
            )
            keep = part - pad if not bf16_optimizer else part  # BF16_Optimizer saves its fp32 partition padded
            fp32.append(self._flat(ckpt, params, "", start, keep, f"fp32.{g}"))
            state = osd["base_optimizer_state"]["state"].get(g)
            if state is not None:
                for key, value in list(state.items()):
                    if isinstance(value, TensorEntry) and value.shape:
                        state[key] = self._flat(ckpt, params, key, start, part, f"{key}.{g}")
            paddings.append(pad)
            mappings.append(
                OrderedDict(
                    (name, fragment_address(min(offset + math.prod(shape), start + part) - max(offset, start), max(offset, start) - start))
                    for name, shape, offset in params
                    if max(offset, start) < min(offset + math.prod(shape), start + part)
                )
            )
        osd["single_partition_of_fp32_groups"] = fp32
        osd["group_paddings"] = paddings
        osd["partition_count"] = [world] * len(fp32)
        if "param_slice_mappings" in osd:
            osd["param_slice_mappings"] = mappings
        return file_segments(tree, where)

    def _flat(
        self, ckpt: Checkpoint, params: list[tuple[str, tuple[int, ...], int]], key: str, start: int, length: int, name: str
    ) -> TensorEntry:
        """Elements [start, start+length) of a group's flat buffer: the params' master weights (key "") or moments."""
        parts = []
        dtype = None
        for pname, shape, offset in params:
            entry = ckpt.tensors[pname if not key else f"optimizer.state.{pname}.{key}"]
            dtype = entry.dtype
            lo, hi = max(offset, start), min(offset + math.prod(shape), start + length)
            if lo < hi:
                parts.append((lo - start, sub_tensor(entry, name, lo - offset, (hi - lo,))))
        assert dtype is not None
        return concat_flat(name, dtype, length, parts)


class Stage3Reshard:
    """ZeRO-3 at a new world size: per-parameter partitions of ceil(n/W) elements, sub-groups re-formed
    (their number depends on W through the partition sizes), frozen fragments re-cut (FORMATS §2.7-2.9)."""

    def __init__(self, ckpt: Checkpoint, src: AnySource, world: int, sub_group_size: int | None, per_rank_rule: str = "wrap") -> None:
        self.ckpt, self.src, self.world = ckpt, src, world
        self.per_rank_rule, self.per_rank_note = per_rank_rule, None
        layout = src.layout
        by_sub = [list(shapes.items()) for shapes in layout.shapes]
        self.subs: list[list[tuple[str, tuple[int, ...]]]] = []
        self.group_subs: list[list[int]] = []
        for group in layout.groups:
            params = [(name, tuple(shape)) for s in group["params"] for name, shape in by_sub[s]]
            subs = self._sub_groups(params, sub_group_size)
            self.group_subs.append(list(range(len(self.subs), len(self.subs) + len(subs))))
            self.subs += subs

    def _pn(self, shape: tuple[int, ...]) -> int:
        return -(-math.prod(shape) // self.world)

    def _sub_groups(self, params: list[tuple[str, tuple[int, ...]]], size: int | None) -> list[list[tuple[str, tuple[int, ...]]]]:
        """stage3.py _create_fp16_sub_groups: close a sub-group once its partition elements reach sub_group_size."""
        if size is None or size >= sum(self._pn(shape) for _, shape in params):
            return [params]
        subs, current, total = [], [], 0
        for i, (name, shape) in enumerate(params):
            current.append((name, shape))
            total += self._pn(shape)
            if total >= size or i == len(params) - 1:
                subs.append(current)
                current, total = [], 0
        return subs

    def partition(self, entry: TensorEntry, rank: int, name: str) -> TensorEntry:
        """Rank's ceil(n/W) elements of a parameter, zero-padded past its end."""
        pn = self._pn(entry.shape)
        start, end = rank * pn, min((rank + 1) * pn, entry.numel)
        parts = [(0, sub_tensor(entry, name, start, (end - start,)))] if end > start else []
        return concat_flat(name, entry.dtype, pn, parts)

    def flat(self, sub: list[tuple[str, tuple[int, ...]]], key: str, rank: int, name: str) -> TensorEntry:
        parts, pos, dtype = [], 0, None
        for pname, shape in sub:
            entry = self.ckpt.tensors[pname if not key else f"optimizer.state.{pname}.{key}"]
            dtype = entry.dtype
            parts.append((pos, self.partition(entry, rank, name)))
            pos += self._pn(shape)
        assert dtype is not None
        return concat_flat(name, dtype, pos, parts)

    def files(self, tag: str) -> list[OutputFile]:
        out = []
        for rank in range(self.world):
            name = f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            out.append(OutputFile(name, file_segments(self._model_states(rank), name)))
            name = f"{tag}/{self.src.optim_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            out.append(OutputFile(name, file_segments(self._optimizer(rank), name)))
        return out

    def _model_states(self, rank: int) -> Any:
        # Every rank saves its own model states at stage 3, client state included (a per-rank RNG, say), and loads
        # its own: new rank r starts from old rank r mod W ('wrap', as the per-rank rule), else from rank 0.
        old = len(self.src.models)
        tree = tensorize(self.src.models[rank % old if self.per_rank_rule == "wrap" else 0])
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
        tree = tensorize(self.src.optims[0])
        osd = tree["optimizer_state_dict"]
        osd["partition_count"] = self.world
        inner = osd["optimizer_state_dict"]
        template = inner["state"].get(0, {})
        inner["state"] = {
            s: {
                key: (copy.copy(value) if not value.shape else self.flat(sub, key, rank, f"{key}.{s}"))
                for key, value in template.items()
                if isinstance(value, TensorEntry)
            }
            for s, sub in enumerate(self.subs)
        }
        inner["param_groups"] = [{**group, "params": self.group_subs[i]} for i, group in enumerate(inner["param_groups"])]
        osd["fp32_flat_groups"] = [self.flat(sub, "", rank, f"fp32.{s}") for s, sub in enumerate(self.subs)]
        return tree


WRITER = DeepSpeedWriter()
