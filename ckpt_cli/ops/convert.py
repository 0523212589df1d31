"""`convert`, `reshard`, `merge`, `split`: one streamed copy from a reader to a writer.

The commands differ only in the target format and layout they choose; each builds a WritePlan
from metadata (shown by --dry-run) and hands it to the executor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core.executor import BLOCK_BYTES, Progress, execute
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Checkpoint, ObjectEntry, TensorEntry
from ckpt_cli.core.plan import TensorData, WritePlan
from ckpt_cli.core.sizes import human_bytes
from ckpt_cli.errors import UsageError
from ckpt_cli.formats import registry
from ckpt_cli.ops import crossframework, transform
from ckpt_cli.ops.crossframework import NameMap
from ckpt_cli.ops.source import open_checkpoint

# Measured floors of resident memory: the CLI alone (plain byte copies never import torch), and
# with torch imported (casts, checksums, strided pieces).
BASE_RSS = 40 * 10**6
TORCH_RSS = 260 * 10**6


@dataclass
class SourceOptions:
    format: str | None = None
    tag: str | None = None
    trust_pickle: bool = False


@dataclass(frozen=True)
class CrossOptions:
    """Carrying a run's training state between DeepSpeed and FSDP2 (convert --to dcp|deepspeed)."""

    layout: str | None = None  # DCP key layout to write: get_state_dict or torchtitan
    zero_stage: int | None = None  # DeepSpeed target
    ds_config: Path | None = None  # DeepSpeed target: the run's config (precision, clipping, batch size)
    names: NameMap = NameMap()
    per_rank: str = "wrap"  # rule for per-rank values under a new world size
    names_given: bool = False  # --rename or --name-map was passed


@dataclass
class Job:
    """A prepared write: the plan for the target and what to tell the user about it."""

    plan: WritePlan
    notes: list[str] = field(default_factory=list)


def prepare(
    src: str | Path,
    dest: str | Path,
    to: str,
    source: SourceOptions,
    t: transform.Transform,
    write: WriteOptions,
    cross: CrossOptions | None = None,
) -> Job:
    ckpt = open_checkpoint(src, source.format, source.tag, source.trust_pickle)
    cross = cross or CrossOptions()
    write = dataclasses.replace(write, per_rank_rule=cross.per_rank)
    if carries_training_state(ckpt, to, t, cross):
        view = training_view(ckpt, to, t, write, cross)
    else:
        view = transform.apply(ckpt, t)
        if to == "dcp":
            _rekey_per_rank(view, write.world_size or ckpt.world_size or 1, cross.per_rank)
    writer = registry.writer(to)
    if write.world_size is not None and to not in ("dcp", "deepspeed"):
        raise UsageError(f"--world-size applies to dcp and deepspeed targets, not {to}")
    if (write.num_shards or write.max_shard_size) and to != "hf":
        raise UsageError(f"--num-shards/--max-shard-size apply to hf targets, not {to}")
    plan = writer.plan(view, Path(dest), write)
    return Job(plan, list(view.notes) + plan.notes)


def carries_training_state(ckpt: Checkpoint, to: str, t: transform.Transform, cross: CrossOptions) -> bool:
    """Whether the write goes through the framework-neutral training state: DeepSpeed <-> DCP, a DCP key
    layout change, a DeepSpeed stage or config change, or parameter renames in a dcp/deepspeed target."""
    if to not in ("dcp", "deepspeed") or t.weights_only:
        return False
    if to == "deepspeed":
        if ckpt.format != "deepspeed" or cross.ds_config is not None:
            return True
        stage = ckpt.details.get("zero_stage")
        return cross.zero_stage not in (None, stage) or cross.names_given
    if ckpt.format == "deepspeed" or cross.names_given:
        return True
    return cross.layout is not None and crossframework.detect_layout(ckpt) != cross.layout


def training_view(ckpt: Checkpoint, to: str, t: transform.Transform, write: WriteOptions, cross: CrossOptions) -> Checkpoint:
    """The source's training state laid out for the target framework (names by FQN, moments, groups, step)."""
    from ckpt_cli.formats import deepspeed_template

    if t != transform.Transform():
        raise UsageError(
            "carrying training state between frameworks keeps every tensor as it is: --select, --strip-prefix, --add-prefix "
            "and --dtype do not apply (rename parameters with --rename or --name-map; --weights-only writes the weights alone)"
        )
    if not write.world_size:
        raise UsageError(f"writing {to} needs --world-size N")
    state = crossframework.from_checkpoint(ckpt, cross.names)
    if to == "dcp":
        if cross.zero_stage is not None or cross.ds_config is not None:
            raise UsageError("--zero-stage and --ds-config apply to deepspeed targets")
        return crossframework.to_dcp(state, cross.layout or "get_state_dict", write.world_size, cross.per_rank)
    if cross.layout is not None:
        raise UsageError("--layout applies to dcp targets")
    target = deepspeed_template.target(cross.ds_config, cross.zero_stage, write.world_size)
    if ckpt.format != "deepspeed":  # DeepSpeed records its ties (shared_params); DCP saves the tensor twice
        found = crossframework.find_ties(state)
        if found:
            state.tied.update(found)
            state.notes.append("tied weights (equal bytes): " + ", ".join(f"{a} -> {o}" for a, o in found.items()))
    return deepspeed_template.build(state, target, f"global_step{state.step or 0}", cross.per_rank)


def _rekey_per_rank(view: Checkpoint, world: int, rule: str) -> None:
    """Per-rank values (dataloader positions, RNG states) re-keyed for the new world size by `rule`."""
    extras = [*view.objects.values(), *(t for t in view.tensors.values() if t.role == "other")]
    entries, note = crossframework.apply_per_rank_rule(extras, world, rule)
    if note:
        view.objects = {e.name: e for e in entries if isinstance(e, ObjectEntry)}
        kept = {e.name: e for e in entries if isinstance(e, TensorEntry)}
        view.tensors = {n: t for n, t in view.tensors.items() if t.role != "other"} | kept
        view.notes.append(note)


def reshard_target(ckpt_format: str, write: WriteOptions) -> str:
    """`reshard` keeps the format; say plainly what each format can be resharded by."""
    if ckpt_format == "hf":
        if write.world_size is not None:
            raise UsageError("hf checkpoints are resharded by --num-shards or --max-shard-size, not --world-size")
        if not (write.num_shards or write.max_shard_size):
            raise UsageError("reshard of an hf checkpoint needs --num-shards N or --max-shard-size SIZE")
        return "hf"
    if ckpt_format in ("dcp", "deepspeed"):
        if write.world_size is None:
            raise UsageError(f"reshard of a {ckpt_format} checkpoint needs --world-size N")
        return ckpt_format
    raise UsageError(f"a {ckpt_format} checkpoint is one file; use 'ckpt split' to shard it")


def merge_target(dest: Path, keep_all: bool) -> str:
    suffix = dest.suffix
    if suffix == ".safetensors":
        if keep_all:
            raise UsageError("--all keeps optimizer and training state, which safetensors cannot hold; use a .pt destination")
        return "safetensors"
    if suffix in (".pt", ".pth", ".bin"):
        return "torch"
    raise UsageError(f"{dest}: merge writes DST.safetensors or DST.pt (.pth, .bin); got '{suffix or 'no extension'}'")


def estimate_peak(plan: WritePlan) -> int:
    """Peak resident memory the executor needs: the runtime plus bounded buffers."""
    buffers, needs_torch = 0, False
    for f in plan.files:
        for s in f.segments:
            if not isinstance(s, TensorData):
                continue
            streamed = s.crc_key is not None or any(p.data.dtype != s.dtype for p in s.tensor.pieces)
            if streamed:
                buffers = max(buffers, 3 * min(BLOCK_BYTES, s.size))
            for p in s.tensor.pieces:
                if not p.data.is_contiguous:
                    buffers = max(buffers, 2 * p.data.nbytes)
            needs_torch = needs_torch or streamed or not all(p.data.is_contiguous for p in s.tensor.pieces)
    return (TORCH_RSS if needs_torch else BASE_RSS) + buffers


def describe(job: Job) -> dict[str, Any]:
    """The plan as data: what --dry-run prints."""
    plan = job.plan
    return {
        "format": plan.format,
        "destination": str(plan.dest),
        "files": [{"path": f.relpath or plan.dest.name, "bytes": f.size, "tensors": len(f.tensor_names)} for f in plan.files],
        "total_bytes": plan.total_bytes,
        "tensor_bytes": plan.data_bytes,
        "largest_tensor_bytes": plan.largest_tensor_bytes(),
        "estimated_peak_rss": estimate_peak(plan),
        "notes": job.notes,
        "placement": {name: f.relpath or plan.dest.name for f in plan.files for name in f.tensor_names},
    }


def describe_text(job: Job) -> str:
    d = describe(job)
    lines = [f"plan: write {d['format']} to {d['destination']} ({len(d['files'])} files, {human_bytes(d['total_bytes'])})"]
    lines += [f"  {f['path']}  {human_bytes(f['bytes'])}  {f['tensors']} tensors" for f in d["files"]]
    lines.append(
        f"estimated peak memory: {human_bytes(d['estimated_peak_rss'])} (largest tensor {human_bytes(d['largest_tensor_bytes'])}, streamed)"
    )
    lines += [f"note: {n}" for n in d["notes"]]
    return "\n".join(lines)


def run(job: Job, overwrite: bool, progress: Progress | None = None, workers: int | None = None) -> None:
    execute(job.plan, overwrite=overwrite, progress=progress, workers=workers)
