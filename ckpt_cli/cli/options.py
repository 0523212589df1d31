"""Options shared by several commands, defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpt_cli.formats.registry import FORMATS


def _preset_names() -> list[str]:
    from ckpt_cli import presets  # file names only: no YAML parsed for --help

    return presets.names()


def _schemes() -> str:
    """The object stores' URL schemes, from the store's BACKENDS table: 's3://, s3a://, az://, abfs:// or abfss://'."""
    from ckpt_cli.store.clients import BACKENDS  # a table of names: no client imported

    names = [f"{protocol}://" for protocol in BACKENDS]
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


def _world_size_formats() -> str:
    """The formats `--world-size` lays out, from the registry rows that reshard by world size: 'deepspeed, dcp, dtensor
    (a deepspeed-universal source becomes deepspeed)'."""
    rows = [f for f in FORMATS.values() if f.reshard_by == "world_size"]
    written = ", ".join(f.name for f in rows if f.writable)
    read_only = "; ".join(f"a {f.name} source becomes {f.reshards_into}" for f in rows if not f.writable and f.reshards_into)
    return f"{written} ({read_only})" if read_only else written


Source = Annotated[
    Path,
    typer.Argument(
        metavar="SRC",
        help=f"Checkpoint file or folder (or a run folder holding several); in object storage too: {_schemes()}bucket/prefix.",
        show_default=False,
    ),
]
Dest = Annotated[
    Path,
    typer.Argument(
        metavar="DST",
        help=f"Destination, a path or {_schemes()}bucket/prefix (refused if it exists, unless --overwrite).",
        show_default=False,
    ),
]
Format = Annotated[
    Optional[str], typer.Option("--format", metavar="FORMAT", help=f"Source format (default: detected): {', '.join(FORMATS)}.")
]
Tag = Annotated[
    Optional[str], typer.Option("--tag", metavar="TAG", help="Which checkpoint of a run folder (default: latest, else highest step).")
]
TrustPickle = Annotated[
    bool, typer.Option("--trust-pickle", help="Allow pickled classes outside the allow list (runs code from the file).")
]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an existing checkpoint, empty folder or (one-file output) file; never a source or a folder holding one.",
    ),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan (files, sizes, placement, memory) and write nothing.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or notes on stderr.")]
DType = Annotated[
    str,
    typer.Option(
        "--dtype",
        metavar="DTYPE",
        help="keep, fp32, bf16 or fp16: cast floating-point model weights (optimizer state keeps its precision); "
        "a quantized source (FP8 block-scaled, MXFP4) is dequantized.",
    ),
]
Quantize = Annotated[
    Optional[str],
    typer.Option(
        "--quantize",
        metavar="METHOD",
        help="fp8: write model weights FP8 block-scaled (128 x 128 blocks, amax / 448), as DeepSeek-V3 ships.",
    ),
]
MaxShardSize = Annotated[Optional[str], typer.Option("--max-shard-size", metavar="SIZE", help="hf: largest shard, e.g. 5GB, 500MB, 2GiB.")]
NumShards = Annotated[Optional[int], typer.Option("--num-shards", metavar="N", help="hf: exact number of shards.", min=1)]
WorldSize = Annotated[
    Optional[int], typer.Option("--world-size", metavar="N", help=f"{_world_size_formats()}: number of ranks to write for.", min=1)
]
TensorParallel = Annotated[
    Optional[int],
    typer.Option(
        "--tp",
        metavar="T",
        help="dcp: tensor-parallel size T: lay out FSDP2 + tensor parallel on a (N/T) x T (dp x tp) mesh of the --world-size N "
        "ranks, each tensor split along the dim its source chunks show.",
        min=1,
    ),
]
ExpertParallel = Annotated[
    Optional[list[str]],
    typer.Option(
        "--ep-size",
        metavar="E",
        help="deepspeed MoE: the new expert-parallel size of every MoE layer (E) or of one (MODULE=E; repeatable). Default: "
        "each kept where it divides --world-size, else the largest that divides it and the layer's experts.",
    ),
]
WeightsOnly = Annotated[bool, typer.Option("--weights-only", help="Model weights only (no optimizer or training state).")]
Select = Annotated[
    Optional[list[str]], typer.Option("--filter", metavar="GLOB", help="Keep tensors whose names match this glob (repeatable).")
]
SelectOld = Annotated[  # the writing commands' former spelling: one vocabulary now, as inspect and diff
    Optional[list[str]], typer.Option("--select", metavar="GLOB", hidden=True, help="The former name of --filter.")
]
StripPrefix = Annotated[Optional[str], typer.Option("--strip-prefix", metavar="PREFIX", help="Remove this prefix from tensor names.")]
AddPrefix = Annotated[Optional[str], typer.Option("--add-prefix", metavar="PREFIX", help="Add this prefix to tensor names.")]
WriteManifest = Annotated[
    Optional[Path],
    typer.Option(
        "--write-manifest",
        help="After the write, record per-file and per-tensor BLAKE3 digests of the output in FILE (as verify --write-manifest).",
        metavar="FILE",
    ),
]
Workers = Annotated[
    Optional[int],
    typer.Option(
        "--workers",
        metavar="K",
        help="Files written at once (default: CPU count, at most 4; 1 for ZeRO-3 params or DCP chunks that are small).",
        min=1,
    ),
]
Layout = Annotated[
    Optional[str],
    typer.Option(
        "--layout",
        metavar="LAYOUT",
        help="dcp target: key layout of the training state, get_state_dict (model/optim) or torchtitan "
        "(model keys at the top, optimizer flattened); default: get_state_dict from DeepSpeed, else as the source.",
    ),
]
ZeroStage = Annotated[
    Optional[int],
    typer.Option("--zero-stage", metavar="STAGE", help="deepspeed target from another framework: ZeRO stage 1, 2 or 3.", min=1, max=3),
]
DSConfig = Annotated[
    Optional[Path],
    typer.Option(
        "--ds-config", metavar="FILE", help="deepspeed target: the run's DeepSpeed config (JSON): stage, precision, clipping, batch size."
    ),
]
Rename = Annotated[
    Optional[list[str]],
    typer.Option(
        "--rename",
        metavar="REGEX=REPL",
        help="Rename parameters, REGEX=REPLACEMENT (repeatable, in order): training-state conversions and exports.",
    ),
]
Preset = Annotated[
    Optional[str],
    typer.Option(
        "--preset",
        metavar="NAME",
        help=f"A built-in name map for an export (ckpt_cli/presets): {', '.join(_preset_names())}.",
        show_default=False,
    ),
]
HFConfig = Annotated[
    Optional[Path],
    typer.Option(
        "--hf-config",
        metavar="DIR",
        help="hf target: the folder whose config.json, generation_config.json and tokenizer files the release carries "
        "(its dtype set to the weights written); a preset's head counts come from it.",
        show_default=False,
    ),
]
NameMapFile = Annotated[
    Optional[Path],
    typer.Option(
        "--name-map",
        metavar="FILE",
        help="YAML name map: strip_segments, rename [{from, to}], tied {alias: owner}; weight exports (hf, safetensors, torch) "
        "also split [{from, to, groups, layers}] (fused QKV, gate/up, layer-stacked tensors by rows), permute [{from, rope, "
        "heads}] (q/k rotary layout) and stack [{from, to, parts}] (per-expert tensors into one).",
    ),
]
PerRankState = Annotated[
    str,
    typer.Option(
        "--per-rank-state",
        metavar="RULE",
        help="Per-rank values (keys rank_R / dp_rank_R; a run folder's rng_state_R / random_states_R files) under a new "
        "world size: wrap (new rank r takes old rank r mod W), first (all take rank 0's) or drop.",
    ),
]
