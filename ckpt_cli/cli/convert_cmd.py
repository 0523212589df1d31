"""`ckpt convert`, `reshard`, `merge`, `split`: the writing commands, each a target layout."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import (
    AddPrefix,
    Dest,
    DryRun,
    DSConfig,
    DType,
    ExpertParallel,
    Format,
    HFConfig,
    Json,
    Layout,
    MaxShardSize,
    NameMapFile,
    NumShards,
    Overwrite,
    PerRankState,
    Preset,
    Quantize,
    Quiet,
    Rename,
    Select,
    SelectOld,
    Source,
    StripPrefix,
    Tag,
    TensorParallel,
    TrustPickle,
    WeightsOnly,
    Workers,
    WorldSize,
    WriteManifest,
    ZeroStage,
)
from ckpt_cli.core.sizes import human_bytes
from ckpt_cli.errors import DataError, Interrupted, Terminated
from ckpt_cli.formats.registry import FORMATS

if TYPE_CHECKING:
    from ckpt_cli import api


def is_main_process() -> bool:
    from ckpt_cli.core.write.distributed import is_main_process as main

    return main()


def _api():  # noqa: ANN202 - the API module, imported when a command runs (`ckpt --help` imports no format)
    from ckpt_cli import api

    return api


@dataclass(frozen=True)
class Output:
    """How a writing command reports and runs: the flags that do not change what is written."""

    overwrite: bool = False
    dry_run: bool = False
    quiet: bool = False
    json: bool = False
    workers: int | None = None
    manifest: Path | None = None  # --write-manifest: digests of the output, read back from the page cache


def plan_text(report: api.WriteReport) -> str:
    """What --dry-run prints: the files, their sizes and the notes."""
    lines = [f"plan: write {report.format} to {report.destination} ({report.file_count} files, {human_bytes(report.total_bytes)})"]
    lines += [f"  {f['path']}  {human_bytes(f['bytes'])}  {f['tensors']} tensors" for f in report.files]
    lines.append(
        f"estimated peak memory: {human_bytes(report.estimated_peak_rss)} "
        f"(largest tensor {human_bytes(report.largest_tensor_bytes)}, streamed)"
    )
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _run(request: api.Request, out: Output) -> None:
    quiet = out.quiet or not is_main_process()  # under torchrun, rank 0 speaks for all
    dest = request.dest
    prepared = _api().prepare(request)
    if out.dry_run:
        report = prepared.dry_run(out.overwrite)
        output.emit_json(report.to_json()) if out.json else output.emit(plan_text(report))
        return
    prepared.check_destination(out.overwrite)
    if out.manifest is not None and is_main_process():
        _api().check_manifest_destination(out.manifest, out.overwrite)  # before any work, as verify does
    for note in prepared.notes:
        output.info(f"note: {note}", quiet)
    started = time.monotonic()
    with output.progress(lambda: prepared.total_bytes, f"{prepared.source_format} -> {prepared.format}", quiet) as bar:
        try:
            report = prepared.write(out.overwrite, bar, out.workers)
        except KeyboardInterrupt as exc:
            terminated = isinstance(exc, Terminated)
            what = "terminated (SIGTERM)" if terminated else "interrupted"
            raise Interrupted(f"{what}; nothing was written to {dest}", terminated) from None
    output.info(f"wrote {report.format} {dest} ({report.file_count} files, {human_bytes(report.total_bytes)})", quiet)
    if out.manifest is not None and is_main_process():
        checked = _api().verify(dest, write_manifest=out.manifest, overwrite=out.overwrite)
        if not checked.ok:  # the output fails its own structural check: a bug, said as one
            raise DataError(f"{dest}: the output fails verify, no manifest written: {checked.problems[0]}")
        output.info(f"wrote manifest {out.manifest}", quiet)
    if out.json and is_main_process():  # what was written, for scripts: the plan's document, and the run's facts
        manifest = str(out.manifest) if out.manifest is not None else None
        output.emit_json({**report.to_json(), "seconds": round(time.monotonic() - started, 3), "manifest": manifest})


def convert(
    src: Source,
    dest: Dest,
    to: Annotated[
        str,
        typer.Option(
            "--to", metavar="FORMAT", help=f"Target format: {', '.join(n for n, f in FORMATS.items() if f.writable)}.", show_default=False
        ),
    ],
    world_size: WorldSize = None,
    tp: TensorParallel = None,
    dtype: DType = "keep",
    max_shard_size: MaxShardSize = None,
    num_shards: NumShards = None,
    weights_only: WeightsOnly = False,
    filter_: Select = None,
    select: SelectOld = None,
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
    write_manifest: WriteManifest = None,
    layout: Layout = None,
    zero_stage: ZeroStage = None,
    ds_config: DSConfig = None,
    rename: Rename = None,
    name_map: NameMapFile = None,
    per_rank_state: PerRankState = "wrap",
    quantize: Quantize = None,
    preset: Preset = None,
    hf_config: HFConfig = None,
) -> None:
    """Convert any readable checkpoint to another format, streamed. Between DeepSpeed and dcp the whole training
    state moves (weights, Adam moments, param groups, step, scheduler, dataloader), so a run resumes in the other framework."""
    globs = _globs(filter_, select, quiet)
    request = _api().convert_request(
        src, dest, to=to, world_size=world_size, tp=tp, dtype=dtype, max_shard_size=max_shard_size, num_shards=num_shards,
        weights_only=weights_only, select=globs, strip_prefix=strip_prefix, add_prefix=add_prefix, format=format_, tag=tag,
        trust_pickle=trust_pickle, layout=layout, zero_stage=zero_stage, ds_config=ds_config, rename=rename, name_map=name_map,
        per_rank_state=per_rank_state, quantize=quantize, preset=preset, hf_config=hf_config,
    )  # fmt: skip
    _run(request, Output(overwrite, dry_run, quiet, json_, workers, write_manifest))


def _globs(filters: list[str] | None, former: list[str] | None, quiet: bool) -> list[str] | None:
    """--filter's globs, with those given by its former name --select (said in a note)."""
    if former:
        output.info("note: --select is now --filter, as in inspect and diff; --select is still taken in this release", quiet)
    return [*(filters or []), *(former or [])] or None


def reshard(
    src: Source,
    dest: Dest,
    world_size: WorldSize = None,
    tp: TensorParallel = None,
    ep_size: ExpertParallel = None,
    num_shards: NumShards = None,
    max_shard_size: MaxShardSize = None,
    dtype: DType = "keep",
    weights_only: WeightsOnly = False,
    filter_: Select = None,
    select: SelectOld = None,
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
    write_manifest: WriteManifest = None,
    layout: Layout = None,
    rename: Rename = None,
    name_map: NameMapFile = None,
    per_rank_state: PerRankState = "wrap",
) -> None:
    """Same format, new layout: --world-size N (dcp, deepspeed, dtensor; dcp on an N/T x T mesh with --tp T) or
    --num-shards/--max-shard-size (hf). With --tp, FSDP2 + tensor parallel: each tensor split along the dims its source
    chunks show. DeepSpeed MoE: each expert-parallel size kept where it divides N, else the largest that does, or
    --ep-size E; experts regrouped."""
    globs = _globs(filter_, select, quiet)
    request = _api().reshard_request(
        src, dest, world_size=world_size, tp=tp, ep_size=ep_size, num_shards=num_shards, max_shard_size=max_shard_size, dtype=dtype,
        weights_only=weights_only, select=globs, strip_prefix=strip_prefix, add_prefix=add_prefix, format=format_, tag=tag,
        trust_pickle=trust_pickle, layout=layout, rename=rename, name_map=name_map, per_rank_state=per_rank_state,
    )  # fmt: skip
    _run(request, Output(overwrite, dry_run, quiet, json_, workers, write_manifest))


def merge(
    src: Source,
    dest: Dest,
    dtype: DType = "keep",
    all_: Annotated[
        bool, typer.Option("--all/--weights-only", help="Keep optimizer and training state (torch .pt only); default: model weights.")
    ] = False,
    filter_: Select = None,
    select: SelectOld = None,
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
    write_manifest: WriteManifest = None,
) -> None:
    """All shards into one file: DST.safetensors or DST.pt (model weights unless --all)."""
    globs = _globs(filter_, select, quiet)
    request = _api().merge_request(
        src, dest, keep_all=all_, dtype=dtype, select=globs, strip_prefix=strip_prefix, add_prefix=add_prefix,
        format=format_, tag=tag, trust_pickle=trust_pickle,
    )  # fmt: skip
    _run(request, Output(overwrite, dry_run, quiet, json_, workers, write_manifest))


def split(
    src: Source,
    dest: Dest,
    max_shard_size: MaxShardSize = None,
    num_shards: NumShards = None,
    dtype: DType = "keep",
    filter_: Select = None,
    select: SelectOld = None,
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
    write_manifest: WriteManifest = None,
) -> None:
    """One file (or any checkpoint) into a Hugging Face sharded folder with an index (default shards: 5GB)."""
    globs = _globs(filter_, select, quiet)
    request = _api().split_request(
        src, dest, max_shard_size=max_shard_size, num_shards=num_shards, dtype=dtype, select=globs, strip_prefix=strip_prefix,
        add_prefix=add_prefix, format=format_, tag=tag, trust_pickle=trust_pickle,
    )  # fmt: skip
    _run(request, Output(overwrite, dry_run, quiet, json_, workers, write_manifest))
