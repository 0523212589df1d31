"""The writing commands as requests built from plain values, a prepared write, and the report of what it wrote.

`convert`, `reshard`, `merge` and `split` differ only in the Request they build (target format and layout);
the Python API (ckpt_cli/api.py) and the CLI both build them here, prepare them (metadata only: the plan)
and run them, so that both check, plan and word things the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from ckpt_cli import presets
from ckpt_cli.core import dtypes
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.sizes import parse_size
from ckpt_cli.core.training import PER_RANK_RULES, NameMap
from ckpt_cli.core.write.distributed import is_main_process
from ckpt_cli.errors import TORCH_INSTALL, UsageError
from ckpt_cli.formats.dcp.training import LAYOUTS
from ckpt_cli.ops import convert as convert_op
from ckpt_cli.ops.request import CrossOptions, Job, Request, SourceOptions
from ckpt_cli.ops.transform import Transform
from ckpt_cli.store import location

Size = int | str  # bytes, or as users write them: 5GB, 500MB, 2GiB


def transform(
    dtype: str = "keep",
    weights_only: bool = False,
    select: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    quantize: str | None = None,
) -> Transform:
    cast = dtypes.cast_target(dtype)
    if (cast is not None or quantize is not None) and not _have_torch():  # before any work, not after the plan's notes
        raise UsageError(f"converting dtypes needs torch, which is not installed: {TORCH_INSTALL}")
    if quantize is not None and quantize != "fp8":
        raise UsageError(f"--quantize {quantize!r}: ckpt quantizes to fp8 (block-scaled, 128 x 128) only")
    return Transform(tuple(select or ()), strip_prefix, add_prefix, weights_only, cast, quantize)


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


EpSize = Union[int, str, Sequence[str], Mapping[str, int], None]  # 4, "moe=4", ["2", "layers.3.moe=4"], {"": 2, "moe": 4}


def ep_sizes(value: EpSize) -> tuple[tuple[str, int], ...] | None:
    """--ep-size as (module, size) pairs: `E` sets every MoE layer not named otherwise (module ""), `MODULE=E` one layer."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        items = [f"{module}={size}" if module else str(size) for module, size in value.items()]
    else:
        items = [str(value)] if isinstance(value, (int, str)) else [str(v) for v in value]
    out: dict[str, int] = {}
    for item in items:
        module, _, size = item.rpartition("=")
        try:
            number = int(size)
        except ValueError:
            number = 0
        if number < 1:
            raise UsageError(f"--ep-size {item!r}: give E or MODULE=E with E a positive whole number")
        out[str(module)] = number
    return tuple(out.items())


def write_options(
    world_size: int | None,
    max_shard_size: Size | None,
    num_shards: int | None,
    tp: int | None = None,
    ep_size: EpSize = None,
) -> WriteOptions:
    if max_shard_size and num_shards:
        raise UsageError("give --max-shard-size or --num-shards, not both")
    if world_size is not None and world_size < 1 or num_shards is not None and num_shards < 1 or tp is not None and tp < 1:
        raise UsageError("--world-size, --tp and --num-shards are at least 1")
    if tp is not None and world_size is None:
        raise UsageError("--tp T needs --world-size N: the mesh is (N / T) x T (dp x tp)")
    if tp is not None and world_size is not None and world_size % tp:
        raise UsageError(f"--tp {tp} does not divide --world-size {world_size}: the mesh is (N / T) x T (dp x tp)")
    if ep_size is not None and world_size is None:
        raise UsageError("--ep-size E needs --world-size N (DeepSpeed MoE: E must divide N and the layer's expert count)")
    size = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if size is not None and size <= 0:
        raise UsageError(f"size must be positive, got '{max_shard_size}'")
    return WriteOptions(size or None, num_shards, world_size, tp, ep_size=ep_sizes(ep_size))


def cross_options(
    layout: str | None = None,
    zero_stage: int | None = None,
    ds_config: str | Path | None = None,
    rename: Sequence[str] | None = None,
    name_map: str | Path | None = None,
    per_rank: str = "wrap",
    preset: str | None = None,
    hf_config: str | Path | None = None,
) -> CrossOptions:
    if layout is not None and layout not in LAYOUTS:
        raise UsageError(f"--layout is one of {', '.join(LAYOUTS)}, not '{layout}'")
    if per_rank not in PER_RANK_RULES:
        raise UsageError(f"--per-rank-state is one of {', '.join(PER_RANK_RULES)}, not '{per_rank}'")
    if preset and name_map:
        raise UsageError("give --preset or --name-map, not both (a preset is a name map; add --rename for more)")
    base = presets.load(preset) if preset else NameMap.from_yaml(Path(name_map)) if name_map else NameMap()
    names = base.with_renames(list(rename or []))
    config = Path(ds_config) if ds_config is not None else None
    return CrossOptions(layout, zero_stage, config, names, per_rank, bool(rename or name_map or preset), _hf_config_dir(hf_config))


def _hf_config_dir(path: str | Path | None) -> Path | None:
    """--hf-config DIR: a folder holding config.json (and the tokenizer files a release carries)."""
    if path is None:
        return None
    folder = location(path)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise UsageError(f"--hf-config {path}: not a folder holding config.json (the Hugging Face model's config)")
    return folder


@dataclass
class WriteReport:
    """What a write wrote (or, for a dry run, would write): the target format, destination, files with their
    sizes and tensor counts, total bytes, the estimated peak memory and the notes (what was dropped, tied,
    chosen). `written` is False for a dry run. `to_json()` is the document `--dry-run --json` prints.
    The per-file lists are made when first asked for (a wide write's files are made again to list them)."""

    job: Job = field(repr=False)
    written: bool = False

    @property
    def format(self) -> str:
        return self.job.plan.format

    @property
    def destination(self) -> str:
        return str(self.job.plan.dest)

    @property
    def total_bytes(self) -> int:
        return self.job.plan.total_bytes

    @property
    def tensor_bytes(self) -> int:
        return self.job.plan.data_bytes

    @property
    def largest_tensor_bytes(self) -> int:
        return self.job.plan.largest_tensor_bytes()

    @property
    def notes(self) -> list[str]:
        return list(self.job.notes)

    @property
    def file_count(self) -> int:
        return len(self.job.plan.files)

    @functools.cached_property
    def files(self) -> list[dict[str, Any]]:
        return convert_op.file_list(self.job.plan)

    @functools.cached_property
    def placement(self) -> dict[str, str]:  # tensor name -> file
        return convert_op.placement(self.job.plan)

    @functools.cached_property
    def estimated_peak_rss(self) -> int:
        return convert_op.estimate_peak(self.job.plan)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "destination": self.destination,
            "files": self.files,
            "total_bytes": self.total_bytes,
            "tensor_bytes": self.tensor_bytes,
            "largest_tensor_bytes": self.largest_tensor_bytes,
            "estimated_peak_rss": self.estimated_peak_rss,
            "notes": self.notes,
            "placement": self.placement,
            "written": self.written,
        }


@dataclass
class PreparedWrite:
    """A planned write (the source opened and checked, the destination's files laid out), not yet run."""

    request: Request
    job: Job

    @property
    def notes(self) -> list[str]:
        """What the plan chose or drops (tied weights written once, state a target cannot hold), for the user."""
        return self.job.notes

    @property
    def total_bytes(self) -> int:
        return self.job.plan.total_bytes

    @property
    def format(self) -> str:
        return self.job.plan.format

    @property
    def source_format(self) -> str:
        return self.job.source_format

    def dry_run(self, overwrite: bool = False) -> WriteReport:
        """The plan, with a note when the real run would refuse the destination."""
        try:
            convert_op.check_destination(self.job, overwrite)
        except UsageError as exc:
            self.job.notes.append(f"the real run will refuse: {exc}")
        return WriteReport(self.job, written=False)

    def check_destination(self, overwrite: bool = False) -> None:
        """UsageError (before any work) when the destination exists and may not be replaced; under torchrun, rank 0 checks."""
        if is_main_process():
            convert_op.check_destination(self.job, overwrite)

    def write(self, overwrite: bool = False, progress: Callable[[int], None] | None = None, workers: int | None = None) -> WriteReport:
        """Run the write (staged, then committed at once; on error or interrupt nothing is left at the destination)."""
        self.check_destination(overwrite)
        convert_op.run(self.job, overwrite, progress, workers)
        return WriteReport(self.job, written=True)


def prepare(request: Request) -> PreparedWrite:
    """Open the source, refuse what verify would reject, and plan the write (nothing is written)."""
    return PreparedWrite(request, convert_op.prepare(request))


def convert_request(
    src: str | Path,
    dest: str | Path,
    *,
    to: str,
    world_size: int | None = None,
    tp: int | None = None,
    dtype: str = "keep",
    max_shard_size: Size | None = None,
    num_shards: int | None = None,
    weights_only: bool = False,
    select: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    format: str | None = None,
    tag: str | None = None,
    trust_pickle: bool = False,
    layout: str | None = None,
    zero_stage: int | None = None,
    ds_config: str | Path | None = None,
    rename: Sequence[str] | None = None,
    name_map: str | Path | None = None,
    per_rank_state: str = "wrap",
    quantize: str | None = None,
    preset: str | None = None,
    hf_config: str | Path | None = None,
) -> Request:
    """`convert`: any readable checkpoint to the format `to` (`preset`: a built-in name map, ckpt_cli/presets;
    `hf_config`: the folder whose config.json, generation config and tokenizer files a Hugging Face export carries)."""
    return Request(
        location(src),
        location(dest),
        to,
        SourceOptions(format, tag, trust_pickle),
        transform(dtype, weights_only, select, strip_prefix, add_prefix, quantize),
        write_options(world_size, max_shard_size, num_shards, tp),
        cross_options(layout, zero_stage, ds_config, rename, name_map, per_rank_state, preset, hf_config),
    )


def reshard_request(
    src: str | Path,
    dest: str | Path,
    *,
    world_size: int | None = None,
    tp: int | None = None,
    ep_size: EpSize = None,
    num_shards: int | None = None,
    max_shard_size: Size | None = None,
    dtype: str = "keep",
    weights_only: bool = False,
    select: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    format: str | None = None,
    tag: str | None = None,
    trust_pickle: bool = False,
    layout: str | None = None,
    rename: Sequence[str] | None = None,
    name_map: str | Path | None = None,
    per_rank_state: str = "wrap",
) -> Request:
    """`reshard`: the source's own format in a new layout (world size, a dp x tp mesh for dcp with `tp`, or shards;
    `ep_size`: DeepSpeed MoE at a new expert-parallel size)."""
    return Request(
        location(src),
        location(dest),
        None,  # the source's own format
        SourceOptions(format, tag, trust_pickle),
        transform(dtype, weights_only, select, strip_prefix, add_prefix),
        write_options(world_size, max_shard_size, num_shards, tp, ep_size),
        cross_options(layout, None, None, rename, name_map, per_rank_state),
    )


def merge_request(
    src: str | Path,
    dest: str | Path,
    *,
    keep_all: bool = False,
    dtype: str = "keep",
    select: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    format: str | None = None,
    tag: str | None = None,
    trust_pickle: bool = False,
) -> Request:
    """`merge`: every shard into one DEST.safetensors or DEST.pt (model weights, unless `keep_all`)."""
    dest = location(dest)
    return Request(
        location(src),
        dest,
        convert_op.merge_target(dest, keep_all),
        SourceOptions(format, tag, trust_pickle),
        transform(dtype, not keep_all, select, strip_prefix, add_prefix),
    )


def split_request(
    src: str | Path,
    dest: str | Path,
    *,
    max_shard_size: Size | None = None,
    num_shards: int | None = None,
    dtype: str = "keep",
    select: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    format: str | None = None,
    tag: str | None = None,
    trust_pickle: bool = False,
) -> Request:
    """`split`: the model weights into a Hugging Face sharded folder with an index."""
    return Request(
        location(src),
        location(dest),
        "hf",
        SourceOptions(format, tag, trust_pickle),
        transform(dtype, True, select, strip_prefix, add_prefix),
        write_options(None, max_shard_size, num_shards),
    )
