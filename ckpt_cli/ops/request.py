"""What a writing command asks for (Request) and what planning it gives (Job): shared by ops/convert.py and
ops/runs.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.training import NameMap
from ckpt_cli.core.write.plan import WritePlan
from ckpt_cli.ops import transform
from ckpt_cli.options import SourceOptions


@dataclass(frozen=True)
class CrossSettings:
    """Carrying a run's training state between frameworks (convert --to dcp|deepspeed), and an export's names: the
    --layout ... --hf-config options (options.CrossOptions) checked and loaded."""

    layout: str | None = None  # DCP key layout to write: get_state_dict or torchtitan
    zero_stage: int | None = None  # DeepSpeed target
    ds_config: Path | None = None  # DeepSpeed target: the run's config (precision, clipping, batch size)
    names: NameMap = NameMap()
    per_rank: str = "wrap"  # rule for per-rank values under a new world size
    names_given: bool = False  # --rename, --name-map or --preset was passed
    hf_config: Path | None = None  # --hf-config: companions (config.json, tokenizer) for a Hugging Face export


@dataclass(frozen=True)
class Request:
    """One writing command: source, destination, target format (None: the source's own, as reshard keeps it)."""

    src: Path
    dest: Path
    to: str | None = None
    source: SourceOptions = SourceOptions()
    transform: transform.Transform = transform.Transform()
    write: WriteOptions = WriteOptions()
    cross: CrossSettings = CrossSettings()


@dataclass
class Job:
    """A prepared write: the plan for the target and what to tell the user about it."""

    plan: WritePlan
    notes: list[str] = field(default_factory=list)
    sources: tuple[str, ...] = ()  # the source path and every file read: what --overwrite must never replace
    source_format: str = ""  # what was read, for the progress label "SRC-format -> DST-format"
