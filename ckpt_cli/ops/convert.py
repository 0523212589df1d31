"""`convert`, `reshard`, `merge`, `split`: one streamed copy from a reader to a writer.

The commands differ only in the target format and layout they choose; each builds a WritePlan
from metadata (shown by --dry-run) and hands it to the executor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ckpt_cli import store
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Checkpoint, unsafe_value_problem
from ckpt_cli.core.reading import BLOCK_BYTES
from ckpt_cli.core.training import StateOptions
from ckpt_cli.core.write import distributed, executor
from ckpt_cli.core.write.plan import TensorData, WritePlan
from ckpt_cli.core.write.sinks import Progress
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import registry
from ckpt_cli.formats.runs import read as run_read
from ckpt_cli.ops import adapters, crossframework, name_map, quant_views, runs, structure, transform
from ckpt_cli.ops.request import CrossSettings, Job, Request
from ckpt_cli.ops.resolve import missing_marker
from ckpt_cli.ops.source import open_checkpoint

__all__ = ["CrossSettings", "Job", "Request", "prepare", "run"]

# Measured floors of resident memory: the CLI alone (plain byte copies never import torch), and
# with torch imported (casts, checksums, strided pieces).
BASE_RSS = 40 * 10**6
TORCH_RSS = 260 * 10**6


def prepare(request: Request, predicted_chunks: bool = True) -> Job:
    """Open the source once and plan the write (metadata only; nothing is written). `predicted_chunks`: DCP chunks in
    object storage may be laid out from a parsed twin and checked when fetched (one process only: a rank that met a
    chunk laid out otherwise could not run the write again alone; formats/dcp/twins.py)."""
    src = request.source
    predicted_chunks = predicted_chunks and distributed.rank_and_world() is None
    ckpt = open_checkpoint(request.src, src.format, src.tag, src.trust_pickle, predicted_chunks=predicted_chunks)
    unsafe = ckpt.unsafe_values()
    if unsafe:  # a value whose pickle names a global outside the allow list is never copied (its loader would run it)
        raise DataError(f"refusing to copy a pickled value the allow list rejects: {unsafe_value_problem(unsafe[0])}")
    refuse_broken(ckpt, request.src)
    if run_read.is_run(ckpt):
        return runs.plan_run(ckpt, request, plan_checkpoint)
    return plan_checkpoint(ckpt, request)


def plan_checkpoint(ckpt: Checkpoint, request: Request) -> Job:
    """Plan the write of an opened (and checked) checkpoint."""
    target = registry.get(request.to) if request.to else reshard_target(ckpt.format, request.write)
    writer = registry.writer(target.name)
    write, t, cross = dataclasses.replace(request.write, per_rank_rule=request.cross.per_rank), request.transform, request.cross
    carries = carries_training_state(ckpt, target, t, cross)
    write = layout_for(target, write, None if carries else ckpt.world_size)
    if target.casts_itself:  # the writer types each tensor from --dtype / --quantize (GGUF: norms stay F32)
        write = dataclasses.replace(write, dtype=t.dtype.name if t.dtype else None, quantize=t.quantize)
        t = dataclasses.replace(t, dtype=None, quantize=None)
    elif t.quantize not in (None, "fp8"):
        raise UsageError(f"--quantize {t.quantize}: a GGUF block type, for --to gguf (hf, safetensors and torch take fp8)")
    adapter = request.source.adapter
    if adapter is not None:
        adapters.check_combination(cross.names_given, carries or _keeps_partitions(ckpt, target, t), adapter)
    if carries:
        names = cross.names
        if names.changes_tensors():
            raise UsageError(
                "a name map's split, permute, stack, unstack, transpose, reshape, scale and zero apply to weight exports (hf, "
                "safetensors, torch), not to training-state conversions, which rename parameters only"
            )
        view = training_view(ckpt, target, t, write, cross)
    else:
        source = transform.without_copies(ckpt, t) if ckpt.format != target.name else ckpt
        source = with_hf_config(source, cross.hf_config, target.name)
        if adapter is not None and t.quantize is not None:  # merged first, then quantized
            source = adapters.applied(source, adapter, t.dtype)
        source = quant_views.for_write(source, t.dtype, t.quantize, target.name)
        if adapter is not None and t.quantize is None:  # into the weights a quantized source dequantizes to
            source = adapters.applied(source, adapter, t.dtype)
        view = transform.apply(name_map.weights_view(source, cross.names) if cross.names_given else source, t)
        view.notes.extend(preset_hint(ckpt, target, cross))
    plan = writer.plan(view, request.dest, write)
    return Job(plan, list(view.notes) + plan.notes, (str(request.src), *(f.path for f in ckpt.files)), ckpt.format)


def with_hf_config(ckpt: Checkpoint, folder: Path | None, target: str) -> Checkpoint:
    """The checkpoint with --hf-config's companions (config.json, generation config, tokenizer) in place of its own;
    for an adapter folder, its adapter_config.json."""
    if folder is None:
        return ckpt
    from ckpt_cli.formats.companions import COMPANIONS, companions_in

    found, notes = companions_in(folder, ("adapter_config.json",) if target == "adapter" else COMPANIONS)
    return dataclasses.replace(ckpt, companions={**ckpt.companions, **found}, notes=[*ckpt.notes, *notes])


def preset_hint(ckpt: Checkpoint, target: registry.Format, cross: CrossSettings) -> list[str]:
    """A note naming the preset whose layout the source's names show, for an export that gave no name map."""
    if cross.names_given or not target.tensors_only:
        return []
    from ckpt_cli import presets

    found = presets.suggest(ckpt)
    if found is None:
        return []
    return [f"these tensor names look like '{found}': --preset {found} maps them for Hugging Face ({presets.describe(found)[:120]}...)"]


def refuse_broken(ckpt: Checkpoint, src: Path) -> None:
    """A source that `verify` rejects is never converted: the same structural checks (metadata only), before any write."""
    problems = structure.structure_problems(ckpt)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise DataError(f"refusing to convert a checkpoint that verify rejects: {problems[0]}{more}; see 'ckpt verify {src}'")


def _targets_by(kind: str) -> str:
    names = [n for n, f in registry.FORMATS.items() if f.reshard_by == kind and f.writable]
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def carries_training_state(ckpt: Checkpoint, target: registry.Format, t: transform.Transform, cross: CrossSettings) -> bool:
    """Whether the write goes through the framework-neutral training state: between two training formats, into a
    format whose writer needs one (DeepSpeed from a state dict), a layout change (ZeRO stage, DCP key layout), or
    parameter renames in a training target."""
    if target.training is None or t.weights_only:
        return False
    if cross.names_given:
        return True
    if ckpt.format != target.name:
        source = registry.FORMATS.get(ckpt.format)
        if source is not None and source.training is not None and target.writes_any_state_dict:
            return source.training.layout_of(ckpt) != "flat"  # weights alone (no optimizer) are written as they are
        return (source is not None and source.training is not None) or not target.writes_any_state_dict
    return target.training.changes_layout(ckpt, _state_options(write_world=None, cross=cross))


def _keeps_partitions(ckpt: Checkpoint, target: registry.Format, t: transform.Transform) -> bool:
    """A write whose writer lays out its own format's partitions from the source's (a DeepSpeed or dtensor reshard: the
    registry row's writes_any_state_dict False) keeps them: merged weights cannot go there, only into a weights write."""
    return not target.writes_any_state_dict and ckpt.format == target.name and not t.weights_only


def layout_for(target: registry.Format, write: WriteOptions, source_world: int | None) -> WriteOptions:
    """The one place the layout options meet the target's registry row: which options the target takes, and the world
    size a target laid out by ranks needs (--world-size, or for a weights write the source's where the row allows)."""
    if write.world_size is not None and target.reshard_by != "world_size":
        raise UsageError(f"--world-size applies to {_targets_by('world_size')} targets, not {target.name}")
    if write.tp is not None and not target.takes_tp:
        raise UsageError(f"--tp applies to {' and '.join(n for n, f in registry.FORMATS.items() if f.takes_tp)} targets, not {target.name}")
    if write.ep_size is not None and not target.takes_ep:
        takers = " and ".join(n for n, f in registry.FORMATS.items() if f.takes_ep)
        raise UsageError(f"--ep-size applies to {takers} targets (MoE, expert parallel), not {target.name}")
    if write.orbax_storage is not None and target.name != "orbax":
        raise UsageError(f"--orbax-storage applies to orbax targets, not {target.name}")
    splits = target.splits and not write.num_shards  # a split set by size (GGUF: gguf-split's --split-max-size)
    if (write.num_shards or write.max_shard_size) and target.reshard_by != "shards" and not splits:
        raise UsageError(f"--num-shards/--max-shard-size apply to {_targets_by('shards')} targets, not {target.name}")
    if target.reshard_by == "world_size" and target.writable and not write.world_size:
        if target.ranks_from_source and source_world:
            return dataclasses.replace(write, world_size=source_world)
        raise UsageError(f"writing {target.name} needs --world-size N ({target.ranks})")
    return write


def _state_options(write_world: int | None, cross: CrossSettings) -> StateOptions:
    return StateOptions(write_world or 0, cross.per_rank, cross.layout, cross.zero_stage, cross.ds_config)


def training_view(
    ckpt: Checkpoint, target: registry.Format, t: transform.Transform, write: WriteOptions, cross: CrossSettings
) -> Checkpoint:
    """The source's training state laid out for the target framework (names by FQN, moments, groups, step)."""
    assert target.training is not None
    if t != transform.Transform():
        raise UsageError(
            "carrying training state between frameworks keeps every tensor as it is: --filter, --exclude, --strip-prefix, --add-prefix "
            "and --dtype do not apply (rename parameters with --rename or --name-map; --weights-only writes the weights alone)"
        )
    state = crossframework.from_checkpoint(ckpt, cross.names)
    return target.training.write_state(state, _state_options(write.world_size, cross))


def reshard_target(ckpt_format: str, write: WriteOptions) -> registry.Format:
    """`reshard` keeps the format; say plainly what each format can be resharded by."""
    fmt = registry.get(ckpt_format)
    if fmt.reshard_by == "shards":
        if write.world_size is not None:
            raise UsageError(f"{fmt.name} checkpoints are resharded by --num-shards or --max-shard-size, not --world-size")
        if not (write.num_shards or write.max_shard_size):
            raise UsageError(f"reshard of an {fmt.name} checkpoint needs --num-shards N or --max-shard-size SIZE")
    elif fmt.reshard_by == "world_size":
        if write.world_size is None:
            raise UsageError(f"reshard of a {fmt.name} checkpoint needs --world-size N")
        if fmt.reshards_into:
            return registry.get(fmt.reshards_into)
    elif fmt.not_resharded:
        raise UsageError(f"ckpt cannot reshard a {fmt.name} checkpoint: {fmt.not_resharded}")
    else:
        raise UsageError(f"a {fmt.name} checkpoint is one file; use 'ckpt split' to shard it")
    return fmt


def merge_target(dest: Path, keep_all: bool) -> str:
    """The one-file format `merge` writes to `dest`, by its suffix (each format's `merge_suffixes`)."""
    suffix = dest.suffix
    found = next((f for f in registry.FORMATS.values() if suffix in f.merge_suffixes), None)
    if found is None:
        known = [s for f in registry.FORMATS.values() for s in f.merge_suffixes]
        raise UsageError(f"{dest}: merge writes one of DST{', DST'.join(known)}; got '{suffix or 'no extension'}'")
    if keep_all and found.tensors_only:
        keeps = next(f.merge_suffixes[0] for f in registry.FORMATS.values() if f.merge_suffixes and not f.tensors_only)
        raise UsageError(f"--all keeps optimizer and training state, which {found.name} cannot hold; use a {keeps} destination")
    return found.name


def estimate_peak(plan: WritePlan) -> int:
    """Peak resident memory the executor needs: the runtime plus bounded buffers."""
    buffers, needs_torch = 0, False
    for f in plan.files:
        if f.build is not None:  # not made for an estimate: its largest tensor streamed through torch (DCP, DeepSpeed files)
            buffers, needs_torch = max(buffers, 3 * min(BLOCK_BYTES, f.measured().largest)), True
            continue
        for s in f.segments:
            if not isinstance(s, TensorData):
                continue
            arrays = s.tensor.stored_arrays()
            streamed = s.crc_key is not None or s.tensor.derived is not None or any(a.dtype != s.dtype for a in arrays)
            if streamed:
                buffers = max(buffers, 3 * min(BLOCK_BYTES, s.size))
            for a in arrays:
                if not a.is_contiguous:
                    buffers = max(buffers, 2 * a.nbytes)
            computed_in_numpy = getattr(s.tensor.derived, "without_torch", False)  # GGUF's quantized tensors
            needs_torch = needs_torch or (streamed and not computed_in_numpy) or not all(a.is_contiguous for a in arrays)
    return (TORCH_RSS if needs_torch else BASE_RSS) + buffers


def guard(job: Job) -> store.Guard:
    """--overwrite replaces an existing checkpoint (any format the registry detects, or one a write left without its
    commit marker in object storage), an empty folder or, with a single-file output, a file; never a source or a
    folder holding one."""
    return store.Guard(job.sources + executor.plan_sources(job.plan), _replaceable)


def _replaceable(path: Path) -> bool:
    return registry.detect(path) is not None or not store.renames(path) and missing_marker(path) is not None


def check_destination(job: Job, overwrite: bool) -> None:
    """Refuse (exit 2) a destination the write may not replace, before any work is done."""
    store.check_destination(job.plan.dest, overwrite, job.plan.dest_is_dir, guard(job))


def run(job: Job, overwrite: bool, progress: Progress | None = None, workers: int | None = None) -> None:
    execute = distributed.execute if distributed.rank_and_world() is not None else executor.execute  # ranks share the files under torchrun
    execute(job.plan, overwrite=overwrite, progress=progress, workers=workers, guard=guard(job))
