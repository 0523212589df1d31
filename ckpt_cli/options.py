"""Every option of the writing commands (convert, reshard, merge, split), declared once.

An option is a field of one of five groups (frozen dataclasses): what to read (SourceOptions), which tensors under
which names and dtype (SelectOptions), how the output is laid out (LayoutOptions), carrying a run's training state
or an export's names across frameworks (CrossOptions), and how the command runs and reports (RunOptions). Each
field carries its flag, help, metavar and choices (`Flag`). From these alone come the CLI's signatures
(cli/options.py), the Python API's keyword arguments (the field names: one name per option, the CLI's with `_` for
`-`), the requests the commands build (ops/writes.py), and the completions and man page (cli/scripts.py).

A new option shared by the writing commands is one field here, and the code that acts on it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.errors import UsageError

Text = str | Callable[[], str]  # a help text, or a function making it when first shown (from the registry, the store)


@dataclass(frozen=True)
class Flag:
    """How an option is spelled and shown: its flag, help, metavar, value kind and choices."""

    flag: str  # "--world-size"
    help: Text
    kind: str = "str"  # "str", "path" (a local path or an object-store URL, kept a string), "int", "bool", "strs", "float"
    metavar: str = ""
    choices: Callable[[], Sequence[str]] | None = None  # the accepted words (completions; checked where they are used)
    short: str | None = None  # "-q"
    secondary: str | None = None  # the flag that sets a bool False ("--weights-only" for "--all")
    minimum: int | None = None
    maximum: int | None = None
    former: str | None = None  # a former spelling still taken (hidden), with a note

    def text(self) -> str:
        return self.help if isinstance(self.help, str) else self.help()


def option(flag: str, help: Text, default: Any = None, **how: Any) -> Any:
    """A dataclass field declaring one option."""
    return field(default=default, metadata={"flag": Flag(flag, help, **how)})


# The help texts that depend on tables elsewhere are made when shown: `ckpt --help` imports no format module.


def _names(module: str, table: str) -> Callable[[], list[str]]:
    """The names of a table in `ckpt_cli.<module>`, imported when first asked for."""
    return lambda: list(getattr(importlib.import_module(f"ckpt_cli.{module}"), table))


_formats = _names("formats.registry", "FORMATS")


def _world_size_formats() -> str:
    """The formats `--world-size` lays out, from the registry rows that reshard by world size: 'deepspeed, dcp, dtensor
    (a deepspeed-universal source becomes deepspeed)'."""
    from ckpt_cli.formats.registry import FORMATS

    rows = [f for f in FORMATS.values() if f.reshard_by == "world_size"]
    written = ", ".join(f.name for f in rows if f.writable)
    read_only = "; ".join(f"a {f.name} source becomes {f.reshards_into}" for f in rows if not f.writable and f.reshards_into)
    return f"{written} ({read_only})" if read_only else written


def _preset_names() -> list[str]:
    from ckpt_cli import presets  # file names only: no YAML parsed for --help

    return presets.names()


DTYPES = ("keep", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class SourceOptions:
    """What to read."""

    format: str | None = option(
        "--format", lambda: f"Source format (default: detected): {', '.join(_formats())}.", metavar="FORMAT", choices=_formats
    )
    tag: str | None = option("--tag", "Which checkpoint of a run folder (default: latest, else highest step).", metavar="TAG")
    trust_pickle: bool = option(
        "--trust-pickle", "Allow pickled classes outside the allow list (runs code from the file).", False, kind="bool"
    )
    adapter: str | None = option(
        "--adapter",
        "A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors): merged into the weights it targets "
        "as they stream (LoRA, rsLoRA, DoRA, as peft's merge_and_unload).",
        kind="path",
        metavar="DIR",
    )


QUANTIZE_METHODS = ("fp8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # fp8 for weight exports; the rest for GGUF
ORBAX_STORAGES = ("ocdbt", "ocdbt-zarr3", "zarr3")  # Orbax's use_ocdbt / use_zarr3 pairs (formats/orbax/writer.py)


@dataclass(frozen=True)
class SelectOptions:
    """Which tensors, under which names, in which dtype."""

    dtype: str = option(
        "--dtype",
        "keep, fp32, bf16 or fp16: cast floating-point model weights (optimizer state keeps its precision); "
        "a quantized source (FP8 block-scaled, MXFP4) is dequantized.",
        "keep",
        metavar="DTYPE",
        choices=lambda: DTYPES,
    )
    quantize: str | None = option(
        "--quantize",
        "fp8: write model weights FP8 block-scaled (128 x 128 blocks, amax / 448), as DeepSeek-V3 ships; "
        "q8_0, q4_0, q4_1, q5_0, q5_1: GGUF block types (--to gguf), as llama.cpp's gguf-py quantizes.",
        metavar="METHOD",
        choices=lambda: QUANTIZE_METHODS,
    )
    weights_only: bool = option("--weights-only", "Model weights only (no optimizer or training state).", False, kind="bool")
    all: bool = option(
        "--all",
        "Keep optimizer and training state (torch .pt only); default: model weights.",
        False,
        kind="bool",
        secondary="--weights-only",
    )
    filter: Sequence[str] | None = option(
        "--filter", "Keep tensors whose names match this glob (repeatable).", kind="strs", metavar="GLOB", former="--select"
    )
    exclude: Sequence[str] | None = option(
        "--exclude", "Leave out tensors whose names match this glob (repeatable; after --filter).", kind="strs", metavar="GLOB"
    )
    strip_prefix: str | None = option("--strip-prefix", "Remove this prefix from tensor names.", metavar="PREFIX")
    add_prefix: str | None = option("--add-prefix", "Add this prefix to tensor names.", metavar="PREFIX")


@dataclass(frozen=True)
class LayoutOptions:
    """How the output is laid out: ranks, mesh, expert parallelism, shards."""

    world_size: int | None = option(
        "--world-size", lambda: f"{_world_size_formats()}: number of ranks to write for.", kind="int", metavar="N", minimum=1
    )
    tp: int | None = option(
        "--tp",
        "dcp: tensor-parallel size T: lay out FSDP2 + tensor parallel on a (N/T) x T (dp x tp) mesh of the --world-size N "
        "ranks, each tensor split along the dim its source chunks show.",
        kind="int",
        metavar="T",
        minimum=1,
    )
    ep_size: Any = option(  # API: 4, "moe=4", ["2", "layers.3.moe=4"] or {"": 2, "moe": 4}
        "--ep-size",
        "deepspeed MoE: the new expert-parallel size of every MoE layer (E) or of one (MODULE=E; repeatable). Default: "
        "each kept where it divides --world-size, else the largest that divides it and the layer's experts.",
        kind="strs",
        metavar="E",
    )
    num_shards: int | None = option("--num-shards", "hf: exact number of shards.", kind="int", metavar="N", minimum=1)
    max_shard_size: int | str | None = option("--max-shard-size", "hf: largest shard, e.g. 5GB, 500MB, 2GiB.", metavar="SIZE")
    orbax_storage: str | None = option(
        "--orbax-storage",
        "orbax target: ocdbt (one OCDBT database of zarr v2 arrays, Orbax's defaults), ocdbt-zarr3 (zarr3 arrays in "
        "OCDBT, MaxText's) or zarr3 (OCDBT off: a zarr3 folder per array).",
        metavar="KIND",
        choices=lambda: ORBAX_STORAGES,
    )


@dataclass(frozen=True)
class CrossOptions:
    """A run's training state between frameworks, and an export's names and companions."""

    layout: str | None = option(
        "--layout",
        "dcp target: key layout of the training state, get_state_dict (model/optim) or torchtitan "
        "(model keys at the top, optimizer flattened); default: get_state_dict from DeepSpeed, else as the source.",
        metavar="LAYOUT",
        choices=_names("formats.dcp.training", "LAYOUTS"),
    )
    zero_stage: int | None = option(
        "--zero-stage", "deepspeed target from another framework: ZeRO stage 1, 2 or 3.", kind="int", metavar="STAGE", minimum=1, maximum=3
    )
    ds_config: str | None = option(
        "--ds-config",
        "deepspeed target: the run's DeepSpeed config (JSON): stage, precision, clipping, batch size.",
        kind="path",
        metavar="FILE",
    )
    rename: Sequence[str] | None = option(
        "--rename",
        "Rename parameters, REGEX=REPLACEMENT (repeatable, in order): training-state conversions and exports.",
        kind="strs",
        metavar="REGEX=REPL",
    )
    name_map: str | None = option(
        "--name-map",
        "YAML name map: strip_segments, rename [{from, to}], tied {alias: owner}; weight exports (hf, safetensors, torch) "
        "also split [{from, to, groups, layers}] (fused QKV, gate/up, layer-stacked tensors by rows), permute [{from, rope, "
        "heads}] (q/k rotary layout) and stack [{from, to, parts}] (per-expert tensors into one).",
        kind="path",
        metavar="FILE",
    )
    per_rank_state: str = option(
        "--per-rank-state",
        "Per-rank values (keys rank_R / dp_rank_R; a run folder's rng_state_R / random_states_R files) under a new "
        "world size: wrap (new rank r takes old rank r mod W), first (all take rank 0's) or drop.",
        "wrap",
        metavar="RULE",
        choices=_names("core.training", "PER_RANK_RULES"),
    )
    preset: str | None = option(
        "--preset",
        lambda: f"A built-in name map for an export (ckpt_cli/presets): {', '.join(_preset_names())}.",
        metavar="NAME",
        choices=_preset_names,
    )
    hf_config: str | None = option(
        "--hf-config",
        "hf target: the folder whose config.json, generation_config.json and tokenizer files the release carries "
        "(its dtype set to the weights written); a preset's head counts come from it. adapter target: the folder holding "
        "the run's adapter_config.json.",
        kind="path",
        metavar="DIR",
    )


@dataclass(frozen=True)
class RunOptions:
    """How a writing command runs and reports: flags that do not change what is written."""

    overwrite: bool = option(
        "--overwrite",
        "Replace an existing checkpoint, empty folder or (one-file output) file; never a source or a folder holding one.",
        False,
        kind="bool",
    )
    dry_run: bool = option("--dry-run", "Print the plan (files, sizes, placement, memory) and write nothing.", False, kind="bool")
    quiet: bool = option("--quiet", "No progress bar or notes on stderr.", False, kind="bool", short="-q")
    json: bool = option("--json", "Machine-readable JSON on stdout.", False, kind="bool")
    workers: int | None = option(
        "--workers",
        "Files written at once (default: CPU count, at most 4; 1 for ZeRO-3 params or DCP chunks that are small).",
        kind="int",
        metavar="K",
        minimum=1,
    )
    write_manifest: str | None = option(
        "--write-manifest",
        "After the write, record per-file and per-tensor BLAKE3 digests of the output in FILE (as verify --write-manifest).",
        kind="path",
        metavar="FILE",
    )


def _shared(group: type, name: str) -> Any:
    """Another group's declaration of an option, for a command that takes it too (verify's --format: SourceOptions')."""
    declared = next(f for f in dataclasses.fields(group) if f.name == name)
    return field(default=declared.default, metadata=declared.metadata)


# The read-only commands' options: each field the one declaration of a flag (its CLI, cli/options.declared_command),
# of the API's keyword (ckpt_cli.verify, ckpt_cli.diff) and of the value ops/verify.py and ops/diff.py read.


@dataclass(frozen=True)
class VerifyOptions:
    """What `verify` checks, against what, and what it records."""

    deep: bool = option("--deep", "Read every byte: zip CRCs, per-tensor checksums, unreadable records.", False, kind="bool")
    finite: bool = option("--finite", "Count NaN/Inf in floating-point tensors; any is a problem.", False, kind="bool")
    write_manifest: str | Path | None = option(
        "--write-manifest", "Record per-file and per-tensor BLAKE3 digests in FILE.", kind="path", metavar="FILE"
    )
    manifest: str | Path | None = option("--manifest", "Check against a manifest from --write-manifest.", kind="path", metavar="FILE")
    against: str | Path | None = option(
        "--against", "Compare tensor by tensor with another checkpoint (any format).", kind="path", metavar="CKPT"
    )
    atol: float = option("--atol", "Absolute tolerance for --against (default: bit-exact).", 0.0, kind="float", metavar="TOL")
    rtol: float = option("--rtol", "Relative tolerance for --against (default: bit-exact).", 0.0, kind="float", metavar="TOL")
    policy: str | Path | None = option(
        "--policy", "YAML: expected tensors, dtypes, shapes, tolerances, training state.", kind="path", metavar="FILE"
    )
    format: str | None = _shared(SourceOptions, "format")
    tag: str | None = _shared(SourceOptions, "tag")
    trust_pickle: bool = _shared(SourceOptions, "trust_pickle")
    overwrite: bool = option("--overwrite", "Let --write-manifest replace a previous manifest (never any other file).", False, kind="bool")


@dataclass
class DiffOptions:
    """What `diff` compares, how closely, and each side's format and tag."""

    atol: float = option("--atol", "Absolute tolerance: |a-b| <= atol + rtol*|b| (default: bit-exact).", 0.0, kind="float", metavar="TOL")
    rtol: float = option("--rtol", "Relative tolerance, as torch.allclose (default: bit-exact).", 0.0, kind="float", metavar="TOL")
    filter: Sequence[str] = option(  # one glob (a string) or several, a tuple once made; empty: all
        "--filter", "Only tensors whose names match this glob (repeatable).", (), kind="strs", metavar="GLOB"
    )
    depth: int | None = option(
        "--depth", "Group by the first N name components (default: up to the layer index).", kind="int", metavar="N", minimum=1
    )
    format_a: str | None = option(
        "--format-a", lambda: f"Format of A (default: detected): {', '.join(_formats())}.", metavar="FORMAT", choices=_formats
    )
    format_b: str | None = option("--format-b", "Format of B (default: detected).", metavar="FORMAT", choices=_formats)
    tag_a: str | None = option("--tag-a", "Which checkpoint of run folder A (default: the newest).", metavar="TAG")
    tag_b: str | None = option("--tag-b", "Which checkpoint of run folder B (default: the newest).", metavar="TAG")
    trust_pickle: bool = _shared(SourceOptions, "trust_pickle")

    def __post_init__(self) -> None:
        self.filter = (self.filter,) if isinstance(self.filter, str) else tuple(self.filter or ())


RENAMED = {"keep_all": "all", "select": "filter"}  # the API's former keyword names, said when used
API_SKIPS = frozenset({"quiet", "json"})  # how the CLI prints: the API returns reports instead
GROUPS: tuple[type, ...] = (LayoutOptions, SelectOptions, SourceOptions, CrossOptions, RunOptions)


@dataclass(frozen=True)
class Command:
    """A writing command: its target (None: the source's own format; "hf" for split), whether it takes --to, and the
    options it does not take (every other field of GROUPS is its)."""

    name: str
    summary: str
    without: frozenset[str]
    takes_to: bool = False


_EXPORT_ONLY = {"zero_stage", "ds_config", "quantize", "preset", "hf_config", "orbax_storage"}
_LAYOUT = {"world_size", "tp", "ep_size", "layout", "per_rank_state", "rename", "name_map"}
COMMANDS = {
    c.name: c
    for c in (
        Command(
            "convert",
            "Convert any readable checkpoint to another format, streamed. Between DeepSpeed and dcp the whole training "
            "state moves (weights, Adam moments, param groups, step, scheduler, dataloader), so a run resumes in the "
            "other framework.",
            frozenset({"ep_size", "all"}),
            takes_to=True,
        ),
        Command(
            "reshard",
            "Same format, new layout: --world-size N (dcp, deepspeed, dtensor; dcp on an N/T x T mesh with --tp T) or "
            "--num-shards/--max-shard-size (hf). With --tp, FSDP2 + tensor parallel: each tensor split along the dims its "
            "source chunks show. DeepSpeed MoE: each expert-parallel size kept where it divides N, else the largest that "
            "does, or --ep-size E; experts regrouped.",
            frozenset(_EXPORT_ONLY | {"all"}),
        ),
        Command(
            "merge",
            "All shards into one file: DST.safetensors or DST.pt (model weights unless --all).",
            frozenset(_EXPORT_ONLY | _LAYOUT | {"num_shards", "max_shard_size", "weights_only"}),
        ),
        Command(
            "split",
            "One file (or any checkpoint) into a Hugging Face sharded folder with an index (default shards: 5GB).",
            frozenset(_EXPORT_ONLY | _LAYOUT | {"weights_only", "all"}),
        ),
    )
}


def fields(command: str) -> Iterator[tuple[type, dataclasses.Field]]:
    """The (group, field) pairs of the options `command` takes, in the order its help lists them."""
    skip = COMMANDS[command].without
    for group in GROUPS:
        for f in dataclasses.fields(group):
            if f.name not in skip:
                yield group, f


def flag_of(f: dataclasses.Field) -> Flag:
    return f.metadata["flag"]


def every_flag() -> Iterator[tuple[str, Flag]]:
    """Every declared option once, by field name."""
    for group in GROUPS:
        for f in dataclasses.fields(group):
            yield f.name, flag_of(f)


@dataclass(frozen=True)
class Options:
    """One writing command's options, as its groups."""

    layout: LayoutOptions = LayoutOptions()
    select: SelectOptions = SelectOptions()
    source: SourceOptions = SourceOptions()
    cross: CrossOptions = CrossOptions()
    run: RunOptions = RunOptions()


_GROUP_FIELD = {LayoutOptions: "layout", SelectOptions: "select", SourceOptions: "source", CrossOptions: "cross", RunOptions: "run"}


def gather(command: str, values: Mapping[str, Any], refused: frozenset[str] = frozenset(), where: str = "") -> Options:
    """The groups from keyword values named as the fields (the API's call, the CLI's parsed flags). UsageError naming
    an option the command does not take (and the close names it does), or one of `refused` (`where` says where it
    goes instead). A bare string given for a repeatable option is one value, not its characters."""
    taken = {f.name: group for group, f in fields(command) if f.name not in refused}
    misplaced = [name for name in values if name in refused]
    if misplaced:
        raise UsageError(f"{command} takes no option {misplaced[0]!r} here{where}")
    repeatable = {f.name for _, f in fields(command) if flag_of(f).kind == "strs" and f.name != "ep_size"}
    values = {k: (v,) if k in repeatable and isinstance(v, str) else v for k, v in values.items()}
    unknown = [name for name in values if name not in taken]
    renamed = [name for name in unknown if RENAMED.get(name) in taken]
    if renamed:
        raise UsageError(f"{command}: {renamed[0]!r} is now {RENAMED[renamed[0]]!r}, as the CLI's flag")
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(taken), n=2)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise UsageError(f"{command} takes no option {unknown[0]!r}{hint}")
    by_group: dict[type, dict[str, Any]] = {}
    for name, value in values.items():
        by_group.setdefault(taken[name], {})[name] = value
    return Options(**{_GROUP_FIELD[g]: g(**v) for g, v in by_group.items()})
