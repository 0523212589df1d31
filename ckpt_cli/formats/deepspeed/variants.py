"""DeepSpeed checkpoints ckpt recognises and refuses by name: pipeline and tensor parallelism, NVMe offload,
hpZ/MiCS partitioning. Each refusal says why, and what would make the checkpoint readable."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ckpt_cli.errors import UsageError

PIPELINE_LAYER = re.compile(r"^layer_\d+(-model_\d+)?-model_states\.pt$")  # PipelineModule.ckpt_layer_path


def refuse_variants(folder: Path, model: dict[str, Any], model_states: re.Pattern[str], pipeline_stage: bool = False) -> None:
    """`pipeline_stage`: the files of one stage of a pipeline-parallel checkpoint are read (deepspeed/pipeline.py)."""
    names = [p.name for p in folder.iterdir()]
    dims = model.get("checkpoint_parallel_dimensions") or {}
    layer = next((n for n in names if PIPELINE_LAYER.match(n)), None)
    if pipeline_stage and dims.get("tp_degree", 1) > 1:
        raise UsageError(f"{folder}: pipeline- and tensor-parallel checkpoint (tp_degree {dims['tp_degree']}) is not supported by ckpt")
    if (layer or dims.get("pp_degree", 1) > 1) and not pipeline_stage:  # the native reader reads these before: universal only
        stages = dims.get("pp_degree", "several")
        raise UsageError(
            f"{folder / (layer or '')}: DeepSpeed pipeline-parallel files ({stages} stages: PipelineModule layer files and a "
            "model-states and ZeRO file set per stage) are read from a native tag folder only (--format deepspeed), not here"
        )
    if (folder / "offloaded_tensors").exists():
        raise UsageError(f"{folder}: NVMe-offloaded optimizer state (offloaded_tensors/) is not supported by ckpt")
    mp = {int(m.group(2)) for n in names if (m := model_states.match(n))}
    if (len(mp) > 1 or model.get("mp_world_size", 1) > 1) and not pipeline_stage:
        raise UsageError(_tensor_parallel_refusal(folder, max(len(mp), model.get("mp_world_size", 1)), model))
    zero = (model.get("ds_config") or {}).get("zero_optimization") or {}
    if (zero.get("zero_hpz_partition_size") or 1) > 1 or (zero.get("mics_shard_size") or 0) > 0:
        raise UsageError(f"{folder}: hpZ/MiCS partitioning (partition group != data-parallel group) is not supported by ckpt")


def _tensor_parallel_refusal(folder: Path, tp: int, model: dict[str, Any]) -> str:
    """Why a tensor-parallel save cannot be joined, and what would make it readable. Each mp_rank_MM file holds
    that rank's slices under the full names; only DeepSpeed's universal-checkpoint info (which Megatron-DeepSpeed
    saves: universal_checkpoint_info with the row-parallel, replicated, averaged and vocabulary patterns) records
    along which dimension each tensor was split."""
    info = model.get("universal_checkpoint_info")
    if not isinstance(info, dict) or not any(k.endswith("_patterns") for k in info):
        return (
            f"{folder}: tensor-parallel checkpoint ({tp} mp_rank files): the files do not record how each tensor is split "
            "across the tensor-parallel ranks (no 'universal_checkpoint_info' patterns), so ckpt cannot join the slices; "
            "save it from a client that records them (Megatron-DeepSpeed does), or join them with the training code"
        )
    return (
        f"{folder}: tensor-parallel checkpoint ({tp} mp_rank files) with universal-checkpoint patterns: ckpt does not join "
        "tensor-parallel slices yet; DeepSpeed's ds_to_universal reads these patterns"
    )


def refuse_universal(folder: Path) -> None:
    """A universal checkpoint's tag folder (zero/ + model states, no ZeRO optimizer files) met by the native reader."""
    if (folder / "zero").is_dir():
        raise UsageError(
            f"{folder}: a DeepSpeed universal checkpoint (zero/ + model states, no ZeRO optimizer files); "
            "read it with --format deepspeed-universal"
        )


def world_problems(folder: Path, world: int, models: Iterable[Any], optim_states: re.Pattern[str], stage: int | None = None) -> list[str]:
    """Where the files disagree on the world size, as DeepSpeed's loaders see it (docs/formats.md §2.10, §3):
    load_checkpoint opens the optimizer files of ranks 0..dp_world_size-1 (each model-states file in `models` says it)
    and partitions by the live size; zero_to_fp32 globs every '*_optim_states.pt' (`optim_states`, rank in group 2)
    and refuses a count other than partition_count. `stage`: a pipeline stage's files only (mp_rank in group 3)."""
    problems = []
    for model in models:
        dp = model.tree.get("dp_world_size")
        if dp != world:
            problems.append(
                f"{model.path}: dp_world_size is {dp!r} but the optimizer files are partitioned for {world} ranks (partition_count); "
                "DeepSpeed would load it at the wrong world size"
            )
    ranks: dict[int, list[str]] = {}
    for p in sorted(folder.iterdir()):
        m = optim_states.match(p.name)
        if m and (stage is None or int(m.group(3)) == stage):
            ranks.setdefault(int(m.group(2)), []).append(p.name)
    for rank, names in sorted(ranks.items()):
        if rank >= world:
            problems.append(
                f"{folder / names[0]}: optimizer file of rank {rank} in a checkpoint of {world} ranks (partition_count): "
                "a leftover of a larger run? zero_to_fp32 refuses the folder"
            )
        elif len(names) > 1:
            problems.append(f"{folder}: {len(names)} optimizer files for rank {rank} ({', '.join(names)}); DeepSpeed reads one")
    return problems
