"""`ckpt convert`, `reshard`, `merge`, `split`: the writing commands, each a target layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import (
    AddPrefix,
    Dest,
    DryRun,
    DSConfig,
    DType,
    Format,
    Json,
    Layout,
    MaxShardSize,
    NameMapFile,
    NumShards,
    Overwrite,
    PerRankState,
    Quiet,
    Rename,
    Select,
    Source,
    StripPrefix,
    Tag,
    TrustPickle,
    WeightsOnly,
    Workers,
    WorldSize,
    ZeroStage,
)
from ckpt_cli.core import dtypes
from ckpt_cli.core.distributed import is_main_process
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.sizes import human_bytes, parse_size
from ckpt_cli.core.training import PER_RANK_RULES, NameMap
from ckpt_cli.errors import Interrupted, Terminated, UsageError
from ckpt_cli.formats.dcp_training import LAYOUTS
from ckpt_cli.formats.registry import FORMATS
from ckpt_cli.ops import convert as convert_op
from ckpt_cli.ops.transform import Transform


def _transform(dtype: str, weights_only: bool, select: list[str] | None, strip: str | None, add: str | None) -> Transform:
    cast = None if dtype == "keep" else dtypes.by_name(dtype)
    return Transform(tuple(select or ()), strip, add, weights_only, cast)


def _write_options(world_size: int | None, max_shard_size: str | None, num_shards: int | None) -> WriteOptions:
    if max_shard_size and num_shards:
        raise UsageError("give --max-shard-size or --num-shards, not both")
    return WriteOptions(parse_size(max_shard_size) if max_shard_size else None, num_shards, world_size)


def _cross_options(
    layout: str | None, zero_stage: int | None, ds_config: Path | None, rename: list[str] | None, name_map: Path | None, per_rank: str
) -> convert_op.CrossOptions:
    if layout is not None and layout not in LAYOUTS:
        raise UsageError(f"--layout is one of {', '.join(LAYOUTS)}, not '{layout}'")
    if per_rank not in PER_RANK_RULES:
        raise UsageError(f"--per-rank-state is one of {', '.join(PER_RANK_RULES)}, not '{per_rank}'")
    names = (NameMap.from_yaml(name_map) if name_map else NameMap()).with_renames(rename or [])
    return convert_op.CrossOptions(layout, zero_stage, ds_config, names, per_rank, bool(rename or name_map))


@dataclass(frozen=True)
class Output:
    """How a writing command reports and runs: the flags that do not change what is written."""

    overwrite: bool = False
    dry_run: bool = False
    quiet: bool = False
    json: bool = False
    workers: int | None = None


def plan_text(job: convert_op.Job) -> str:
    """What --dry-run prints: the files, their sizes and the notes."""
    d = convert_op.describe(job)
    lines = [f"plan: write {d['format']} to {d['destination']} ({len(d['files'])} files, {human_bytes(d['total_bytes'])})"]
    lines += [f"  {f['path']}  {human_bytes(f['bytes'])}  {f['tensors']} tensors" for f in d["files"]]
    lines.append(
        f"estimated peak memory: {human_bytes(d['estimated_peak_rss'])} (largest tensor {human_bytes(d['largest_tensor_bytes'])}, streamed)"
    )
    lines += [f"note: {n}" for n in d["notes"]]
    return "\n".join(lines)


def _run(request: convert_op.Request, out: Output) -> None:
    quiet = out.quiet or not is_main_process()  # under torchrun, rank 0 speaks for all
    dest = request.dest
    job = convert_op.prepare(request)
    if out.dry_run:
        if dest.exists() and not out.overwrite:
            job.notes.append(f"{dest} exists: the real run needs --overwrite")
        elif out.overwrite:
            try:
                convert_op.check_destination(job, out.overwrite)
            except UsageError as exc:
                job.notes.append(f"the real run will refuse: {exc}")
        output.emit_json(convert_op.describe(job)) if out.json else output.emit(plan_text(job))
        return
    if is_main_process():
        convert_op.check_destination(job, out.overwrite)
    for note in job.notes:
        output.info(f"note: {note}", quiet)
    with output.progress(job.plan.total_bytes, f"{job.plan.format} -> {dest.name}", quiet) as bar:
        try:
            convert_op.run(job, out.overwrite, bar, out.workers)
        except KeyboardInterrupt as exc:
            terminated = isinstance(exc, Terminated)
            what = "terminated (SIGTERM)" if terminated else "interrupted"
            raise Interrupted(f"{what}; nothing was written to {dest}", terminated) from None
    output.info(f"wrote {job.plan.format} {dest} ({len(job.plan.files)} files, {human_bytes(job.plan.total_bytes)})", quiet)


def convert(
    src: Source,
    dest: Dest,
    to: Annotated[
        str, typer.Option("--to", help=f"Target format: {', '.join(n for n, f in FORMATS.items() if f.writer)}.", show_default=False)
    ],
    world_size: WorldSize = None,
    dtype: DType = "keep",
    max_shard_size: MaxShardSize = None,
    num_shards: NumShards = None,
    weights_only: WeightsOnly = False,
    select: Select = None,
    strip_prefix: StripPrefix = None,
    add_prefix: AddPrefix = None,
    format_: Format = None,
    tag: Tag = None,
    trust_pickle: TrustPickle = False,
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
    json_: Json = False,
    workers: Workers = None,
    layout: Layout = None,
    zero_stage: ZeroStage = None,
    ds_config: DSConfig = None,
    rename: Rename = None,
    name_map: NameMapFile = None,
    per_rank_state: PerRankState = "wrap",
) -> None:
    """Convert any readable checkpoint to another format, streamed. Between DeepSpeed and dcp the whole training
    state moves (weights, Adam moments, param groups, step, scheduler, dataloader), so a run resumes in the other framework."""
    request = convert_op.Request(
        src,
        dest,
        to,
        convert_op.SourceOptions(format_, tag, trust_pickle),
        _transform(dtype, weights_only, select, strip_prefix, add_prefix),
        _write_options(world_size, max_shard_size, num_shards),
        _cross_options(layout, zero_stage, ds_config, rename, name_map, per_rank_state),
    )
    _run(request, Output(overwrite, dry_run, quiet, json_, workers))


def reshard(
    src: Source,
    dest: Dest,
    world_size: WorldSize = None,
    num_shards: NumShards = None,
    max_shard_size: MaxShardSize = None,
    dtype: DType = "keep",
    weights_only: WeightsOnly = False,
    select: Select = None,
    strip_prefix: StripPrefix = None,
    add_prefix: AddPrefix = None,
    format_: Format = None,
    tag: Tag = None,
    trust_pickle: TrustPickle = False,
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
    json_: Json = False,
    workers: Workers = None,
    layout: Layout = None,
    rename: Rename = None,
    name_map: NameMapFile = None,
    per_rank_state: PerRankState = "wrap",
) -> None:
    """Same format, new layout: --world-size N (dcp, deepspeed) or --num-shards/--max-shard-size (hf)."""
    request = convert_op.Request(
        src,
        dest,
        None,  # the source's own format
        convert_op.SourceOptions(format_, tag, trust_pickle),
        _transform(dtype, weights_only, select, strip_prefix, add_prefix),
        _write_options(world_size, max_shard_size, num_shards),
        _cross_options(layout, None, None, rename, name_map, per_rank_state),
    )
    _run(request, Output(overwrite, dry_run, quiet, json_, workers))


def merge(
    src: Source,
    dest: Dest,
    dtype: DType = "keep",
    all_: Annotated[
        bool, typer.Option("--all/--weights-only", help="Keep optimizer and training state (torch .pt only); default: model weights.")
    ] = False,
    select: Select = None,
    strip_prefix: StripPrefix = None,
    add_prefix: AddPrefix = None,
    format_: Format = None,
    tag: Tag = None,
    trust_pickle: TrustPickle = False,
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
    json_: Json = False,
    workers: Workers = None,
) -> None:
    """All shards into one file: DST.safetensors or DST.pt (model weights unless --all)."""
    request = convert_op.Request(
        src,
        dest,
        convert_op.merge_target(dest, all_),
        convert_op.SourceOptions(format_, tag, trust_pickle),
        _transform(dtype, not all_, select, strip_prefix, add_prefix),
    )
    _run(request, Output(overwrite, dry_run, quiet, json_, workers))


def split(
    src: Source,
    dest: Dest,
    max_shard_size: MaxShardSize = None,
    num_shards: NumShards = None,
    dtype: DType = "keep",
    select: Select = None,
    strip_prefix: StripPrefix = None,
    add_prefix: AddPrefix = None,
    format_: Format = None,
    tag: Tag = None,
    trust_pickle: TrustPickle = False,
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
    json_: Json = False,
    workers: Workers = None,
) -> None:
    """One file (or any checkpoint) into a Hugging Face sharded folder with an index (default shards: 5GB)."""
    request = convert_op.Request(
        src,
        dest,
        "hf",
        convert_op.SourceOptions(format_, tag, trust_pickle),
        _transform(dtype, True, select, strip_prefix, add_prefix),
        _write_options(None, max_shard_size, num_shards),
    )
    _run(request, Output(overwrite, dry_run, quiet, json_, workers))
