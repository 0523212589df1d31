"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3; fp32, bf16, fp16; BF16_Optimizer), read without DeepSpeed.

Layout: `<dir>/latest` names a tag; `<dir>/<tag>/` holds the model states (`mp_rank_00_model_states.pt`, or
one `zero_pp_rank_R_mp_rank_00_model_states.pt` per rank at stage 3) and one `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`
per data-parallel rank. Every file is a torch.save archive; DeepSpeed's pickled classes are read through
inert stubs. Each parameter's fp32 master weight and Adam moments become logical tensors whose pieces
are byte ranges of the ranks' flat partitions, so nothing is gathered in memory.
Partition math: docs/formats.md §2.6 (stage 1/2), §2.7 (stage 3), §2.8 (frozen and shared params), written
once in deepspeed/layout.py; deepspeed/partitions.py turns the saved partitions into logical tensors.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from ckpt_cli.core import roles
from ckpt_cli.core.dtypes import dtype_digest
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint, FileInfo, ObjectEntry, TensorEntry
from ckpt_cli.core.paths import plain_component, present, read_regular_text, step_number
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.tags import pick as pick_tag
from ckpt_cli.core.tree import flatten, path_name, share_equal
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.deepspeed import moe as deepspeed_moe
from ckpt_cli.formats.deepspeed import pipeline as deepspeed_pipeline
from ckpt_cli.formats.deepspeed import rank_files
from ckpt_cli.formats.deepspeed import stage0 as deepspeed_stage0
from ckpt_cli.formats.deepspeed.layout import ZeroLayout
from ckpt_cli.formats.deepspeed.model_states import frozen_and_buffers, training_dtype_weights
from ckpt_cli.formats.deepspeed.partitions import Stage3Partitions, Stage12Partitions, ZeroFile
from ckpt_cli.formats.deepspeed.rank_files import LazyRanks, RankFile
from ckpt_cli.formats.deepspeed.variants import refuse_universal, refuse_variants, world_problems
from ckpt_cli.formats.torch_save import Shared, crc_problems
from ckpt_cli.store import location

LATEST = "latest"
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
# Keys the engine itself saves (engine.py _common_checkpoint_state); anything else is client state.
ENGINE_KEYS = {
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "universal_checkpoint_info",
    *deepspeed_moe.ENGINE_KEYS,
}
# Model-states keys that describe the layout rather than training state.
LAYOUT_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
}


def is_deepspeed_dir(path: Path) -> bool:
    if not path.is_dir():
        return False
    if present(path / LATEST):
        return True
    return any(MODEL_STATES.match(p.name) for p in path.iterdir())


@dataclass(frozen=True)
class Tags:
    """How a save folder names its tags: the tag folders (`is_tag`), the file naming the newest (`latest`), and the
    words for them (a native save's, or ds_to_universal's: formats/deepspeed/universal.py)."""

    latest: str = LATEST
    is_tag: Callable[[Path], bool] = lambda p: p.is_dir() and any(MODEL_STATES.match(q.name) for q in p.iterdir())
    kind: str = "DeepSpeed tag"
    not_tag: str = "holds no model states"
    none_here: str = "no DeepSpeed checkpoint here (no 'latest', no tag folders)"

    def names(self, folder: Path) -> list[str]:
        return sorted((p.name for p in folder.iterdir() if self.is_tag(p)), key=lambda t: (_tag_step(t), t))

    def resolve(self, path: Path, tag: str | None) -> tuple[Path, str, list[str]]:
        """(tag folder, tag, notes). `path` is a save folder (with its `latest` file) or a tag folder itself."""
        if self.is_tag(path) and tag in (None, path.name):
            return path, path.name, []
        tags = self.names(path)
        if tag is not None:
            tag = pick_tag(tag, tags, str(path), self.kind)
            return path / tag, tag, []
        latest = path / self.latest
        if present(latest):  # a FIFO or device there is refused by name, not passed over
            named = plain_component(read_regular_text(latest, max_bytes=4096).strip(), str(latest))
            if named not in tags:
                raise DataError(f"{latest}: names tag '{named}', which is missing or {self.not_tag}")
            return path / named, named, [f"{path}: using tag '{named}' from '{self.latest}'"] if len(tags) > 1 else []
        if not tags:
            raise UsageError(f"{path}: {self.none_here}")
        return path / tags[-1], tags[-1], [f"{path}: no '{self.latest}' file; using the highest tag '{tags[-1]}'"]


TAGS = Tags()
list_tags, resolve_tag = TAGS.names, TAGS.resolve


class ZeroSource(Protocol):
    """What the DeepSpeed writer cuts for a new world size: the parsed files of a read checkpoint (Source)
    or the trees built from another framework's training state (deepspeed_template.BuiltSource)."""

    @property
    def folder(self) -> Path: ...
    @property
    def stage(self) -> int | None: ...  # None: BF16_Optimizer
    @property
    def world(self) -> int: ...
    @property
    def model(self) -> ZeroFile: ...  # the (rank-0) model-states file
    @property
    def models(self) -> Mapping[int, ZeroFile]: ...  # stage 3: every rank's model states
    @property
    def optims(self) -> Mapping[int, ZeroFile]: ...
    @property
    def layout(self) -> ZeroLayout: ...
    @property
    def optim_prefix(self) -> str: ...  # "bf16_" or ""
    @property
    def dtypes(self) -> bytes: ...  # dtypes.dtype_digest of the tensors read: a writer refuses a view that selected, renamed or cast
    @property
    def copies(self) -> Mapping[str, ZeroFile]: ...  # files written again as they are, by name (MoE expert files)


@dataclass
class Source:
    """The parsed files of one tag (a ZeroSource), kept for the DeepSpeed writer and for check()."""

    folder: Path
    stage: int | None
    world: int
    model: RankFile
    models: Mapping[int, RankFile]
    optims: Mapping[int, RankFile]
    layout: Stage12Partitions | Stage3Partitions
    optim_prefix: str
    dtypes: bytes  # dtypes.dtype_digest of the tensors read
    copies: dict[str, ZeroFile] = field(default_factory=dict)
    pipeline_stage: int | None = None  # the stage's mp_rank in a pipeline-parallel checkpoint (deepspeed/pipeline.py)


def _ranked(folder: Path, pattern: re.Pattern[str], rank_group: int, stage: int | None = None) -> dict[int, Path]:
    """Files by data-parallel rank; `stage`: a pipeline stage's only (its mp_rank, the group after the rank's)."""
    out: dict[int, Path] = {}
    for p in folder.iterdir():
        m = pattern.match(p.name)
        if m and m.group(rank_group) is not None and (stage is None or int(m.group(rank_group + 1)) == stage):
            out[int(m.group(rank_group))] = p
    return out


class DeepSpeedReader:
    name = "deepspeed"

    def detect(self, path: Path) -> bool:
        return is_deepspeed_dir(path)

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        folder, tag, notes = resolve_tag(path, options.tag)
        return self.read_tag(path, folder, tag, notes, options)

    def read_tag(
        self, path: Path, folder: Path, tag: str, notes: list[str], options: ReadOptions, stage_of: int | None = None
    ) -> Checkpoint:
        """One tag folder, or with `stage_of` the files of one pipeline stage (formats/deepspeed/pipeline.py)."""
        model_paths = _ranked(folder, MODEL_STATES, 1, stage_of)
        shared_model = [
            p for p in folder.iterdir() if (m := MODEL_STATES.match(p.name)) and m.group(1) is None and stage_of in (None, int(m.group(2)))
        ]
        optim_paths = _ranked(folder, OPTIM_STATES, 2, stage_of)
        if not model_paths and not shared_model:
            raise DataError(f"{folder}: no model-states file")
        parsed = Shared()  # rank files repeat their pickles (stage 3: all of them) and whole files; each is parsed once

        def load(p: Path) -> RankFile:
            return rank_files.load(p, options, parsed)

        first_model = load(shared_model[0] if shared_model else model_paths[min(model_paths)])
        if stage_of is None and deepspeed_pipeline.is_pipeline(folder, first_model.tree):
            return deepspeed_pipeline.read(self, path, folder, tag, notes, options, load, first_model.tree)
        moe_here = deepspeed_moe.is_moe(folder, first_model.tree)  # expert parallel: docs/formats.md §2.12
        if moe_here:
            deepspeed_moe.refuse_unsupported(folder, first_model.tree)
        refuse_variants(folder, first_model.tree, MODEL_STATES, pipeline_stage=stage_of is not None)
        if not optim_paths:
            refuse_universal(folder)  # ds_to_universal's output beside a native run's `latest`, picked by --tag
            if stage_of is not None and any(OPTIM_STATES.match(p.name) for p in folder.iterdir()):  # other stages have theirs
                expected = f"zero_pp_rank_0_mp_rank_{stage_of:02d}_optim_states.pt"
                raise DataError(f"{folder}: pipeline stage {stage_of} has no ZeRO optimizer file ({expected})")
            if moe_here:  # MoE without ZeRO: the torch optimizer's state per expert-parallel rank
                return self._stage0(path, tag, notes, deepspeed_stage0.read_files(folder, first_model, load), options)
            raise UsageError(
                f"{folder}: no ZeRO optimizer files (stage 0 or a plain engine); read the model-states file as a torch file instead"
            )
        first_optim = load(optim_paths[min(optim_paths)])
        osd0 = first_optim.tree.get("optimizer_state_dict")
        if not isinstance(osd0, dict):
            raise DataError(f"{first_optim.path}: no optimizer_state_dict")

        def load_optim(p: Path) -> RankFile:
            optim = load(p)
            share_equal(optim.tree.get("optimizer_state_dict"), osd0)
            return optim

        optims = LazyRanks(optim_paths, load_optim, {min(optim_paths): first_optim})
        for r, p in sorted(optim_paths.items()):  # a hostile pickle in any rank's file is refused, inspect's too
            if r not in optims.loaded and not rank_files.check(p, options):
                optims.loaded[r] = load_optim(p)
        stage = osd0.get("zero_stage")
        world = osd0.get("partition_count")
        world = max(world) if isinstance(world, list) else world
        if not isinstance(world, int) or world < 1:
            raise DataError(f"{first_optim.path}: no partition_count")
        missing = [r for r in range(world) if r not in optims]
        if missing:
            raise DataError(
                f"{folder}: partition_count is {world} but the optimizer file of rank {missing[0]} is missing "
                f"(expected {world} '*_optim_states.pt', found {len(optims)})"
            )
        if isinstance(osd0.get("base_optimizer_state"), list):
            raise UsageError(f"{folder}: elastic_checkpoint format (per-group optimizer state lists) is not supported by ckpt")
        loaded = {r: first_model for r, p in model_paths.items() if p == first_model.path}
        models = LazyRanks(model_paths if stage == 3 else {}, load, loaded)
        if stage == 3 and sorted(models) != list(range(world)):
            raise DataError(
                f"{folder}: stage 3 needs the model-states files of ranks 0..{world - 1} (partition_count {world}), "
                f"found ranks {sorted(models)}"
            )
        model = first_model.tree
        moe = deepspeed_moe.read_experts(folder, first_model, optims, world, stage, load) if moe_here else None
        if stage == 3:
            layout: Stage12Partitions | Stage3Partitions = Stage3Partitions(models, optims, world)
        else:
            layout = Stage12Partitions(first_model, optims, world, stage, moe.layout if moe else None, moe.order if moe else None)
        tensors = layout.model_tensors()
        tensors.update(frozen_and_buffers(first_model, models, world, stage))
        for alias, owner in (model.get("shared_params") or {}).items():
            if owner in tensors and alias not in tensors:
                tensors[alias] = TensorEntry(alias, tensors[owner].dtype, tensors[owner].shape, "model", tensors[owner].pieces)
        tensors.update(layout.optimizer_tensors())
        tensors.update(training_dtype_weights(first_model, stage))
        tensors.update(moe.tensors(tensors) if moe else {})
        client_tensors, objects = self._client_state(first_model, layout.param_groups())
        tensors.update(client_tensors)
        files = [first_model.path] + [p for _, p in sorted(models.paths.items()) if p != first_model.path]
        files += [p for _, p in sorted(optim_paths.items())] + (moe.paths if moe else [])
        wrapper = "BF16_Optimizer" if stage is None else f"DeepSpeedZeroOptimizer{'_Stage3' if stage == 3 else ''}"
        precision = self._precision(model, optim_paths)
        details = {
            "zero_stage": stage if stage is not None else 1,
            "optimizer_wrapper": wrapper,
            "precision": precision,
            "partition_count": world,
            "param_groups": len(layout.param_groups()),
            "ds_version": model.get("ds_version"),
            "tags": ", ".join(list_tags(path)) if folder != path else tag,
            "tag_from": "latest" if options.tag is None and (path / LATEST).is_file() else "request",
            **layout.details(),
            **(moe.details(world) if moe else {}),
        }
        ckpt = Checkpoint(
            format=self.name,
            path=str(path),
            tensors=tensors,
            objects=objects,
            files=[FileInfo(str(p), p.stat().st_size) for p in files],
            tag=tag,
            step=step_number(model.get("global_steps"), f"{first_model.path}: global_steps"),
            world_size=world,
            details=details,
            notes=notes,
        )
        ckpt.training_state = self._training_state(ckpt, wrapper)
        prefix = "bf16_" if any((m := OPTIM_STATES.match(p.name)) and m.group(1) for p in optim_paths.values()) else ""
        dtypes_read = dtype_digest(tensors)
        ckpt.source = Source(
            folder, stage, world, first_model, models, optims, layout, prefix, dtypes_read, moe.copies if moe else {}, stage_of
        )
        return ckpt

    def _stage0(self, path: Path, tag: str, notes: list[str], files: deepspeed_stage0.Stage0Files, options: ReadOptions) -> Checkpoint:
        """DeepSpeed MoE at stage 0 (formats/deepspeed/stage0.py): weights, and the optimizer state when its names are told."""
        model, folder = files.model.tree, files.paths[0].parent
        tensors = deepspeed_stage0.tensors(files)
        client_tensors, objects = self._client_state(files.model, deepspeed_stage0.param_groups(files))
        tensors.update(client_tensors)
        if files.shapes is None:
            notes.append(
                f"{folder}: the optimizer state (by index) is not read: the model's parameters deal into its groups in more than one way"
            )
        world = model.get("dp_world_size")
        paths = [files.model.path, *files.paths]
        step = step_number(model.get("global_steps"), f"{paths[0]}: global_steps")
        ckpt = Checkpoint(self.name, str(path), tensors, objects, [FileInfo(str(p), p.stat().st_size) for p in paths], tag, step, world)
        ckpt.notes, wrapper = notes, "torch optimizer (no ZeRO)"
        ckpt.details = {"zero_stage": 0, "optimizer_wrapper": wrapper, "precision": "fp32", "param_groups": len(files.groups)}
        ckpt.details |= {"ds_version": model.get("ds_version"), "tags": ", ".join(list_tags(path)) if folder != path else tag}
        ckpt.details["tag_from"] = "latest" if options.tag is None and (path / LATEST).is_file() else "request"
        ckpt.details |= deepspeed_moe.expert_details(files.layout, model["num_experts"], world)
        ckpt.training_state = self._training_state(ckpt, wrapper)
        ckpt.source = deepspeed_stage0.Stage0Source(folder, world, files, dtype_digest(tensors))
        return ckpt

    def _client_state(self, first: RankFile, param_groups: list[dict[str, Any]]) -> tuple[dict[str, TensorEntry], dict[str, ObjectEntry]]:
        """Everything beside the layout keys (engine counters, LR scheduler, client state) as saved by rank 0: its
        tensors (a per-rank RNG state, say) and its other values, plus the param groups by parameter name."""
        rest = {k: v for k, v in first.tree.items() if k not in LAYOUT_KEYS}
        refs, leaves, _ = flatten(rest, lambda v: isinstance(v, TensorRef), "model states") if rest else ([], [], {})
        tensors = {path_name(p): TensorEntry(path_name(p), ref.dtype, ref.shape, "other", first.whole(ref), p) for p, ref in refs}
        objects = {path_name(p): ObjectEntry(path_name(p), v, "other", p) for p, v in leaves}
        objects["optimizer.param_groups"] = ObjectEntry("optimizer.param_groups", param_groups, "optimizer", ("optimizer", "param_groups"))
        return tensors, objects

    def _precision(self, model: dict[str, Any], optim_paths: dict[int, Path]) -> str:
        config = model.get("ds_config") or {}
        if any((m := OPTIM_STATES.match(p.name)) and m.group(1) for p in optim_paths.values()):
            return "bf16"
        if (config.get("fp16") or {}).get("enabled"):
            return "fp16"
        return "fp32"

    def _training_state(self, ckpt: Checkpoint, wrapper: str) -> dict[str, Any]:
        state = roles.infer_training_state(ckpt)
        if state["optimizer"]:
            state["optimizer"]["wrapper"] = wrapper
        client = [k for k in (state["client_state"] or {}).get("keys", []) if k.split(".")[0] not in ENGINE_KEYS]
        state["client_state"] = {"keys": client} if client else None
        state["global_steps"] = ckpt.step
        return state

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        if isinstance(ckpt.source, deepspeed_pipeline.PipelineSource):  # each stage's files, then every file's CRCs
            found = [p for stage in ckpt.source.stages for p in self.check(stage, False)]
            found += deepspeed_pipeline.missing_layers(ckpt.source)
            return list(dict.fromkeys(found)) + (self.check(replace(ckpt, source=None), True) if deep else [])
        problems = []
        root = location(ckpt.path)
        if ckpt.details.get("tag_from") == "latest" and ckpt.tag:
            newer = [t for t in list_tags(root) if _tag_step(t) > _tag_step(ckpt.tag)]
            if newer:
                problems.append(
                    f"{root / newer[-1]}: newer than the tag 'latest' names ({ckpt.tag}); a save that did not "
                    "finish (DeepSpeed writes 'latest' last)"
                )
        stages, counts = set(), set()
        held = ckpt.source.optims if isinstance(ckpt.source, Source) else {}
        optims = held.passing() if isinstance(held, LazyRanks) else held.values()  # each parsed in turn, none kept
        for optim in optims:
            osd = optim.tree.get("optimizer_state_dict") or {}
            stages.add(osd.get("zero_stage"))
            pc = osd.get("partition_count")
            counts.add(tuple(sorted(pc)) if isinstance(pc, list) else pc)  # MoE: ranks may order their groups differently
        if len(stages) > 1 or len(counts) > 1:
            problems.append(
                f"{ckpt.path}: rank files disagree: zero_stage {sorted(map(str, stages))}, partition_count {sorted(map(str, counts))}"
            )
        if isinstance(ckpt.source, deepspeed_stage0.Stage0Source):
            problems += deepspeed_stage0.problems(ckpt.source.files)
        if isinstance(ckpt.source, Source):
            src = ckpt.source
            others = src.models.passing() if isinstance(src.models, LazyRanks) else iter(src.models.values())
            models = itertools.chain([src.model], (m for m in others if m.path != src.model.path))
            problems += world_problems(src.folder, src.world, models, OPTIM_STATES, src.pipeline_stage)
            if isinstance(ckpt.source.layout, Stage3Partitions):
                problems += ckpt.source.layout.flat_problems()
            if ckpt.source.layout.experts is not None:
                problems += deepspeed_moe.partition_problems(ckpt.source.layout)
        return problems + (crc_problems(f.path for f in ckpt.files) if deep else [])


def _tag_step(tag: str) -> int:
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else -1


READER = DeepSpeedReader()
