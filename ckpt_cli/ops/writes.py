"""The writing commands as requests built from plain values, a prepared write, and the report of what it wrote.

`convert`, `reshard`, `merge` and `split` differ only in the Request they build (target format and layout);
the Python API (ckpt_cli/api.py) and the CLI both build them here, prepare them (metadata only: the plan)
and run them, so that both check, plan and word things the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from ckpt_cli import options, presets
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.sizes import parse_size
from ckpt_cli.core.training import PER_RANK_RULES, NameMap
from ckpt_cli.core.write.distributed import is_main_process
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.dcp.training import LAYOUTS
from ckpt_cli.ops import convert as convert_op
from ckpt_cli.ops import transform
from ckpt_cli.ops.request import CrossSettings, Job, Request
from ckpt_cli.ops.verify import VerifyOptions, check_manifest_destination, verify
from ckpt_cli.options import ORBAX_STORAGES, CrossOptions, LayoutOptions, Options
from ckpt_cli.store import location
from ckpt_cli.store.predicted import Mispredicted

Progress = Callable[[int], None]  # called with the number of bytes written since the last call
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


def write_options(layout: LayoutOptions) -> WriteOptions:
    world_size, tp, num_shards, max_shard_size = layout.world_size, layout.tp, layout.num_shards, layout.max_shard_size
    if max_shard_size and num_shards:
        raise UsageError("give --max-shard-size or --num-shards, not both")
    if world_size is not None and world_size < 1 or num_shards is not None and num_shards < 1 or tp is not None and tp < 1:
        raise UsageError("--world-size, --tp and --num-shards are at least 1")
    if tp is not None and world_size is None:
        raise UsageError("--tp T needs --world-size N: the mesh is (N / T) x T (dp x tp)")
    if tp is not None and world_size is not None and world_size % tp:
        raise UsageError(f"--tp {tp} does not divide --world-size {world_size}: the mesh is (N / T) x T (dp x tp)")
    if layout.ep_size is not None and world_size is None:
        raise UsageError("--ep-size E needs --world-size N (DeepSpeed MoE: E must divide N and the layer's expert count)")
    size = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if size is not None and size <= 0:
        raise UsageError(f"size must be positive, got '{max_shard_size}'")
    if layout.orbax_storage is not None and layout.orbax_storage not in ORBAX_STORAGES:
        raise UsageError(f"--orbax-storage is one of {', '.join(ORBAX_STORAGES)}, not '{layout.orbax_storage}'")
    return WriteOptions(size or None, num_shards, world_size, tp, ep_size=ep_sizes(layout.ep_size), orbax_storage=layout.orbax_storage)


def cross_settings(cross: CrossOptions) -> CrossSettings:
    if cross.layout is not None and cross.layout not in LAYOUTS:
        raise UsageError(f"--layout is one of {', '.join(LAYOUTS)}, not '{cross.layout}'")
    if cross.per_rank_state not in PER_RANK_RULES:
        raise UsageError(f"--per-rank-state is one of {', '.join(PER_RANK_RULES)}, not '{cross.per_rank_state}'")
    if cross.preset and cross.name_map:
        raise UsageError("give --preset or --name-map, not both (a preset is a name map; add --rename for more)")
    name_map = Path(cross.name_map) if cross.name_map else None
    base = presets.load(cross.preset) if cross.preset else NameMap.from_yaml(name_map) if name_map else NameMap()
    names = base.with_renames(list(cross.rename or []))
    config = Path(cross.ds_config) if cross.ds_config is not None else None
    given = bool(cross.rename or cross.name_map or cross.preset)
    return CrossSettings(cross.layout, cross.zero_stage, config, names, cross.per_rank_state, given, _hf_config_dir(cross.hf_config))


def _hf_config_dir(path: str | Path | None) -> Path | None:
    """--hf-config DIR: a folder holding config.json (and the tokenizer files a release carries), or a PEFT adapter's
    adapter_config.json."""
    if path is None:
        return None
    folder = location(path)
    if not folder.is_dir() or not any((folder / n).is_file() for n in ("config.json", "adapter_config.json")):
        raise UsageError(f"--hf-config {path}: not a folder holding config.json (the Hugging Face model's config) or adapter_config.json")
    return folder


def request(command: str, src: str | Path, dest: str | Path, to: str | None, chosen: Options) -> Request:
    """The Request of writing command `command` (convert, reshard, merge, split) with its options' groups: its target
    (convert: `to`; reshard: the source's own format; merge: by the destination's suffix; split: hf) and what it keeps
    (merge: the weights unless --all; split: the weights)."""
    dest = location(dest)
    select = chosen.select
    target = convert_op.merge_target(dest, select.all) if command == "merge" else {"convert": to, "split": "hf"}.get(command)
    weights_only = {"merge": not select.all, "split": True}.get(command, select.weights_only)
    return Request(
        location(src),
        dest,
        target,
        chosen.source,
        transform.from_options(select, weights_only),
        write_options(chosen.layout),
        cross_settings(chosen.cross),
    )


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
        """What the plan chose or drops (tied weights written once, state a target cannot hold), for the user."""
        return list(self.job.notes)

    @property
    def file_count(self) -> int:
        return len(self.job.plan.files)

    @property
    def source_format(self) -> str:
        return self.job.source_format

    @functools.cached_property
    def files(self) -> list[dict[str, Any]]:  # each output file's path, bytes and tensor count
        plan = self.job.plan
        return [{"path": f.relpath or plan.dest.name, "bytes": f.size, "tensors": len(f.tensor_names())} for f in plan.files]

    @functools.cached_property
    def placement(self) -> dict[str, str]:  # tensor name -> file
        return {name: f.relpath or self.job.plan.dest.name for f in self.job.plan.files for name in f.tensor_names()}

    @functools.cached_property
    def estimated_peak_rss(self) -> int:
        return convert_op.estimate_peak(self.job.plan)

    def to_json(self) -> dict[str, Any]:
        keys = ("format", "destination", "files", "total_bytes", "tensor_bytes", "largest_tensor_bytes", "estimated_peak_rss")
        return {key: getattr(self, key) for key in (*keys, "notes", "placement", "written")}


@dataclass
class PreparedWrite(WriteReport):
    """A planned write (the source opened and checked, the destination's files laid out), not yet run: read as a
    report, what it would write."""

    request: Request = field(kw_only=True)

    def dry_run(self, overwrite: bool = False) -> WriteReport:
        """The plan, with a note when the real run would refuse the destination."""
        try:
            convert_op.check_destination(self.job, overwrite)
        except UsageError as exc:
            self.job.notes.append(f"the real run will refuse: {exc}")
        return WriteReport(self.job, written=False)

    def check_destination(self, overwrite: bool = False, manifest: str | Path | None = None) -> None:
        """UsageError (before any work) when the destination, or the manifest file to write, exists and may not be
        replaced; under torchrun, rank 0 checks."""
        if is_main_process():
            convert_op.check_destination(self.job, overwrite)
            if manifest is not None:
                check_manifest_destination(location(manifest), overwrite)  # before any work, as verify does

    def write(
        self,
        overwrite: bool = False,
        progress: Progress | None = None,
        workers: int | None = None,
        manifest: str | Path | None = None,
    ) -> WriteReport:
        """Run the write (staged, then committed at once; on error or interrupt nothing is left at the destination),
        then record the output's digests in `manifest` (--write-manifest) when given."""
        self.check_destination(overwrite, manifest)
        try:
            convert_op.run(self.job, overwrite, progress, workers)
        except Mispredicted:  # a DCP chunk laid out unlike its twins (nothing was written): read again, every chunk parsed
            self.job = convert_op.prepare(self.request, predicted_chunks=False)
            convert_op.run(self.job, overwrite, progress, workers)
        if manifest is not None and is_main_process():
            checked = verify(self.request.dest, VerifyOptions(write_manifest=location(manifest), overwrite=overwrite))
            if not checked.ok:  # the output fails its own structural check: a bug, said as one
                raise DataError(f"{self.request.dest}: the output fails verify, no manifest written: {checked.problems[0]}")
        return WriteReport(self.job, written=True)


def prepare(request: Request) -> PreparedWrite:
    """Open the source, refuse what verify would reject, and plan the write (nothing is written)."""
    return PreparedWrite(convert_op.prepare(request), request=request)


def run(
    command: str, src: str | Path, dest: str | Path, to: str | None, values: Mapping[str, Any], progress: Progress | None = None
) -> WriteReport:
    """A writing command from keyword values named as its options (the API's call): plan, and write unless dry_run."""
    chosen = options.gather(command, values, options.API_SKIPS, " (the API returns reports; it prints nothing)")
    prepared = prepare(request(command, src, dest, to, chosen))
    if chosen.run.dry_run:
        return prepared.dry_run(chosen.run.overwrite)
    return prepared.write(chosen.run.overwrite, progress, chosen.run.workers, chosen.run.write_manifest)


def request_of(command: str, src: str | Path, dest: str | Path, to: str | None, values: Mapping[str, Any]) -> Request:
    """The Request of a writing command from keyword values named as its options."""
    run_only = frozenset(f.name for f in dataclasses.fields(options.RunOptions))
    return request(command, src, dest, to, options.gather(command, values, run_only, ": pass it to ckpt_cli.write(request, ...)"))
