"""The one table of formats, used by detection, `--format`, `--to`, and the docs."""

from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.core.tags import pick as pick_tag
from ckpt_cli.errors import UsageError

if TYPE_CHECKING:
    from ckpt_cli.core.interface import Reader, Writer
    from ckpt_cli.core.training import TrainingFormat


@functools.cache
def _load(where: str) -> Any:
    """The object `module:NAME` names, its module imported on first use (`ckpt --help` imports no format)."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(f"ckpt_cli.formats.{module}"), name)


@dataclass(frozen=True)
class Commit:
    """How a write of the format commits: its marker, written after every other file. In object storage (no rename)
    a folder holding the format's data without the marker is a write that stopped early."""

    what: str  # the checkpoint, in words: "DCP checkpoint"
    marker: str  # regex of the marker's file name (whole name)
    shown: str  # the marker as an error names it: ".metadata"
    data: str  # regex of the names that show a write had started (whole name)
    has: str  # what those are, in words: "*.distcp objects"
    in_folders: bool = False  # `data` names files one level down (DeepSpeed: the rank files of its tag folders)

    def missing(self, entries: dict[str, Path]) -> bool:
        """A folder listed as `entries` (name -> path) holds the format's data and not its marker."""
        if any(re.fullmatch(self.marker, n) for n in entries):
            return False
        if not self.in_folders:
            return any(re.fullmatch(self.data, n) for n in entries)
        return any(p.is_dir() and any(re.fullmatch(self.data, q.name) for q in p.iterdir()) for p in entries.values())


@dataclass(frozen=True)
class Format:
    name: str
    reader_at: str  # "module:NAME" under ckpt_cli.formats, imported when first used
    writer_at: str | None
    summary: str
    has_checksums: bool  # records carry CRCs that check(deep=True) verifies
    own_tags: bool = False  # the reader resolves --tag itself (DeepSpeed's latest + global_stepN)
    reshard_by: str | None = None  # what `reshard` changes: "world_size" (ranks) or "shards" (files); None: one file
    training_at: str | None = None  # holds a whole training run that moves to and from other frameworks
    writes_any_state_dict: bool = True  # False: the writer needs a source of its own format (or a training state)
    members: str | None = None  # names of the files a folder of this format holds (a regex, whole name)
    not_resharded: str | None = None  # a read-only format of many files: why `reshard` refuses it, what to do instead
    commit: Commit | None = None  # the marker its writer writes last (core/plan.OutputFile.commit_marker)
    takes_tp: bool = False  # the writer lays out a dp x tp mesh (--tp)
    merge_suffixes: tuple[str, ...] = ()  # `merge` writes this one-file format to a destination with these suffixes
    tensors_only: bool = False  # holds tensors only: optimizer and training state cannot go there
    folders: bool = True  # detection can claim a folder
    files: str | None = None  # regex of the file names detection can claim (whole name); None: no single file
    reshards_into: str | None = None  # `reshard` writes this format (a read-only layout of a writable one's run)
    ranks: str | None = None  # what --world-size N counts for its writer, in words (a write needs it: ops/convert.layout_for)
    ranks_from_source: bool = False  # without --world-size, a weights write keeps the source's world size
    takes_ep: bool = False  # the writer regroups MoE experts (--ep-size)
    later_parts: str | None = None  # regex of the file names that are a later part of a set its first part names (ls lists the set once)
    # the writer picks each tensor's type from --dtype / --quantize as its reference converter does (GGUF: norms stay
    # F32), so a write hands it those options instead of casting the tensors first (ops/convert.plan_checkpoint)
    casts_itself: bool = False
    splits: bool = False  # a one-file format that --max-shard-size writes as a split set into a folder (gguf-split)

    @property
    def reader(self) -> Reader:
        return _load(self.reader_at)

    @property
    def writer(self) -> Writer | None:
        return _load(self.writer_at) if self.writer_at else None

    @property
    def writable(self) -> bool:
        return self.writer_at is not None

    @property
    def training(self) -> TrainingFormat | None:
        return _load(self.training_at) if self.training_at else None


MODEL_STATES = r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt"
HF_SHARDS = r"(?!shard-\d+-model-\d+-of-\d+\.safetensors$).+-\d+-of-\d+\.(safetensors|bin)"
# Detection order: the most specific layouts first.
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "deepspeed-universal",
            "deepspeed.universal:READER",
            None,
            "DeepSpeed universal checkpoint (ds_to_universal): latest_universal + <tag>/zero/<param>/fp32.pt",
            True,
            own_tags=True,
            reshard_by="world_size",
            training_at="deepspeed.training:TRAINING",
            reshards_into="deepspeed",
        ),
        Format(
            "deepspeed",
            "deepspeed.reader:READER",
            "deepspeed.writer:WRITER",
            "DeepSpeed ZeRO stage 1/2/3: latest + global_stepN/*_states.pt",
            True,
            own_tags=True,
            reshard_by="world_size",
            training_at="deepspeed.training:TRAINING",
            writes_any_state_dict=False,
            ranks="the new data-parallel size",
            takes_ep=True,
            members=r"latest|.+_(model|optim)_states\.pt",
            commit=Commit(
                "DeepSpeed checkpoint", "latest", "'latest'", r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt", "tag folders", True
            ),
        ),
        Format(
            "megatron",
            "dcp.megatron:READER",
            None,
            "Megatron-Core torch_dist: metadata.json + common.pt + DCP .metadata/__R_I.distcp",
            True,
            members=r"__\d+_\d+\.distcp|common\.pt|metadata\.json|\.metadata",
            not_resharded="Megatron-Core reshards a torch_dist checkpoint itself when it loads it at another parallel size "
            "(dist_checkpointing): load it as it is, or export the weights (ckpt convert SRC DST --to hf)",
        ),
        Format(
            "dcp",
            "dcp.reader:READER",
            "dcp.writer:WRITER",
            "PyTorch Distributed Checkpoint: .metadata + __R_I.distcp",
            True,
            reshard_by="world_size",
            training_at="dcp.training:TRAINING",
            takes_tp=True,
            ranks="the number of FSDP2 ranks to lay it out for",
            ranks_from_source=True,
            members=r"__\d+_\d+\.distcp|(__\d+)?\.metadata",
            commit=Commit("DCP checkpoint", r"\.metadata", ".metadata", r".+\.distcp", "*.distcp objects"),
        ),
        Format(
            "dtensor",
            "dtensor.reader:READER",
            "dtensor.writer:WRITER",
            "per-rank torch.save of DTensor shards (verl, SkyRL): model_world_size_W_rank_R.pt",
            True,
            members=r"(model|optim|extra_state)_world_size_\d+_rank_\d+\.pt",
            files=r"model_world_size_\d+_rank_\d+\.pt",  # one rank's file: named, then refused with the folder to read
            reshard_by="world_size",
            writes_any_state_dict=False,
            ranks="the number of processes that will load it",
        ),
        Format(
            "dcp-hf",
            "dcp.hf_storage:HF_READER",
            None,
            "DCP by HuggingFaceStorageWriter: shard-R-model-I-of-N.safetensors",
            False,
            members=r"shard-\d+-model-\d+-of-\d+\.safetensors",
            not_resharded="ckpt reads DCP's Hugging Face storage layout but does not write it; convert it instead "
            "(ckpt convert SRC DST --to hf, or --to dcp --world-size N)",
        ),
        Format(
            "adapter",
            "hf.adapter:READER",
            "hf.adapter_writer:WRITER",
            "PEFT LoRA / rsLoRA / DoRA adapter: adapter_config.json + adapter_model.safetensors (applied with --adapter)",
            False,
            members=r"adapter_config\.json|adapter_model\.(safetensors|bin)",
            tensors_only=True,
            commit=Commit(
                "PEFT adapter", r"adapter_config\.json", "adapter_config.json", r"adapter_model\.(safetensors|bin)", "adapter weights"
            ),
            not_resharded="an adapter is applied to its base as the base is written: ckpt convert BASE DST --to hf --adapter DIR",
        ),
        Format(
            "orbax",
            "orbax.reader:READER",
            "orbax.writer:WRITER",
            "Orbax (JAX): CheckpointManager step folders or one item; OCDBT or zarr3 arrays, through tensorstore",
            False,
            training_at="orbax.training:TRAINING",
            members=r"_METADATA|_CHECKPOINT_METADATA|_sharding|manifest\.ocdbt|commit_success\.txt",
            not_resharded="Orbax reshards a save itself when it restores it onto another mesh (its target's shardings); "
            "or convert it (ckpt convert SRC DST --to dcp --world-size N)",
            commit=Commit("Orbax save", r"commit_success\.txt", "commit_success.txt", r"_METADATA|manifest\.ocdbt", "its metadata"),
        ),
        Format(
            "hf",
            "hf.folder:READER",
            "hf.folder:WRITER",
            "Hugging Face sharded safetensors + model.safetensors.index.json",
            False,
            reshard_by="shards",
            tensors_only=True,
            members=r".+-\d+-of-\d+\.(safetensors|bin)|.+\.index\.json",
            # DCP's per-rank Hugging Face shards (shard-R-model-I-of-N) have no index
            commit=Commit("Hugging Face checkpoint", r".+\.index\.json", "*.index.json", HF_SHARDS, "shards"),
        ),
        Format(
            "safetensors",
            "safetensors:READER",
            "safetensors:WRITER",
            "one .safetensors file",
            False,
            merge_suffixes=(".safetensors",),
            tensors_only=True,
            folders=False,
            files=".*",  # by its header, whatever the suffix
        ),
        Format(
            "torch",
            "torch_save:READER",
            "torch_save:WRITER",
            "one torch.save file (.pt/.pth/.bin)",
            True,
            merge_suffixes=(".pt", ".pth", ".bin"),
            folders=False,
            files=".*",  # by its zip or pickle magic
        ),
        Format(
            "gguf",
            "gguf.reader:READER",
            "gguf.writer:WRITER",
            "llama.cpp GGUF: one .gguf file or a gguf-split set (NAME-0000i-of-0000N.gguf), read dequantized, written as "
            "llama.cpp's converter writes it",
            False,
            tensors_only=True,
            folders=False,
            files=".*",  # by its GGUF magic, whatever the suffix (last: a file the others claim is never opened again for it)
            later_parts=r".+-(?!00001-)\d{5}-of-\d{5}\.gguf",  # gguf-split's parts after the first
            casts_itself=True,
            splits=True,
        ),
    )
}


def get(name: str) -> Format:
    if name in FORMATS:
        return FORMATS[name]
    raise UsageError(f"unknown format '{name}' (known: {', '.join(FORMATS)})")


def writer(name: str) -> Writer:
    fmt = get(name)
    if fmt.writer is None:
        raise UsageError(f"format '{name}' can be read but not written")
    return fmt.writer


def detect(path: Path) -> Format | None:
    """The format of the checkpoint at `path`. Only the rows that can claim a folder, or a file of this name, have their
    reader imported and asked (`ckpt inspect x.safetensors` imports no folder format)."""
    folder = path.is_dir()
    able = (f for f in FORMATS.values() if (f.folders if folder else f.files is not None and re.fullmatch(f.files, path.name)))
    return next((f for f in able if f.reader.detect(path)), None)


def later_part(path: Path) -> bool:
    """A file that is a later part of a set its first part names (a gguf-split part 2 of N): listed as the set, once."""
    return any(f.later_parts and re.fullmatch(f.later_parts, path.name) for f in FORMATS.values())


def member_of(path: Path) -> tuple[Path, Format] | None:
    """The checkpoint folder that holds `path` as one of its files (a DCP `__0_0.distcp`, one hf shard, a DeepSpeed
    rank file), with its format; None when `path` is a folder or a file on its own. Read alone, such a file would
    pass for a whole checkpoint: verify would say OK about a part, merge would write a part."""
    name, parent = path.name, path.parent
    candidates = [f for f in FORMATS.values() if f.members and re.fullmatch(f.members, name)]
    if not candidates or path.is_dir():
        return None
    return next(((parent, f) for f in candidates if f.reader.detect(parent)), None)


def _step_of(name: str) -> int:
    digits = re.findall(r"\d+", name)
    return int(digits[-1]) if digits else -1


def list_tags(folder: Path) -> dict[str, Format]:
    """Sub-checkpoints of a run folder (`step_1000/`, `checkpoint-500/`, ...) and their formats, lowest step first."""
    if not folder.is_dir():
        return {}
    found = {p.name: fmt for p in folder.iterdir() if not p.name.startswith(".") and (fmt := detect(p)) is not None}
    return {t: found[t] for t in sorted(found, key=lambda t: (_step_of(t), t))}


def tagged(path: Path, fmt: Format, tag: str | None, forced: bool) -> tuple[Path, Format, str | None]:
    """The checkpoint of format `fmt` at `path` and the tag its reader takes; or, where --tag names no tag of the
    format's own (a folder of a format without tags, not forced by --format), the checkpoint below `path` it names."""
    if tag is None or forced or fmt.own_tags:
        return path, fmt, tag
    tags = list_tags(path)
    tag = pick_tag(tag, list(tags), str(path), "checkpoint tag")
    return path / tag, tags[tag], tag
