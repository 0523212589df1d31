"""Run folders: the checkpoint folders that the Hugging Face Trainer, accelerate, Lightning and torchtitan write
around the core formats, read as one composite checkpoint.

A run checkpoint is a folder (or Lightning's single `.ckpt` file) made of *parts*, tensor checkpoints in a core
format (the DeepSpeed save folder, FSDP's `pytorch_model_fsdp_0/` and `optimizer_0/` DCP folders, a
`model.safetensors`), and *companions*, the framework's own files beside them (`trainer_state.json`,
`scheduler.pt`, `rng_state_R.pth`, `random_states_R.pkl`, Lightning's `meta.pt`, ...). Detection looks at names
only; reading opens each part with its format's reader and each companion with the allow-list unpickler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_cli import store
from ckpt_cli.core.paths import open_regular
from ckpt_cli.errors import DataError
from ckpt_cli.formats import registry

TRAINER, ACCELERATE, LIGHTNING, TORCHTITAN = "trainer", "accelerate", "lightning", "torchtitan"

RANKED_RNG = re.compile(r"(?:rng_state|random_states)(?:_(\d+))?\.(?:pth|pkl)")  # Trainer, accelerate
SCHEDULER = re.compile(r"scheduler(?:_\d+)?\.(?:pt|bin)")
CUSTOM = re.compile(r"custom_checkpoint_\d+\.pkl")  # accelerate register_for_checkpointing
FSDP_MODEL = re.compile(r"pytorch_model_fsdp_(\d+)")  # Trainer / accelerate FSDP sharded state dict (DCP)
FSDP_OPTIM = re.compile(r"optimizer_(\d+)")
TORCHTITAN_STEP = re.compile(r"step-(\d+)")
# accelerate FSDP1 per-rank files: LOCAL_STATE_DICT (pytorch_model_fsdp_rankR.bin) or use_dcp=False (..._I_rankR.bin)
FSDP_RANK_FILES = re.compile(r"(pytorch_model_fsdp(_\d+)?|optimizer(_\d+)?)_rank\d+\.bin")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin")  # the last: accelerate FSDP FULL_STATE_DICT
TOKENIZER_FILES = {"special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model"}
NESTING_KEYS = ("model", "state_dict", "module")  # keys a framework nests the model weights under
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
LEGACY_TORCH = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # torch.save < 1.6: pickle of its magic number


@dataclass(frozen=True)
class Part:
    """A tensor checkpoint inside a run checkpoint. `role` forces a role on every tensor it holds (a separate
    optimizer file); None keeps the reader's roles. `model_prefix` is the key under which the framework nests the
    model weights: stripped from their names on export, so they carry the model's own parameter names."""

    relpath: str  # "" for the run checkpoint itself
    format: str
    role: str | None = None
    model_prefix: str = ""


@dataclass(frozen=True)
class Companion:
    """A framework file beside the parts. kind: trainer_state, scheduler, rng, framework_state, custom, args,
    config, tokenizer, script, weights_copy or other. `rank`: the process whose state a per-rank file holds."""

    relpath: str
    kind: str
    rank: int | None = None


@dataclass(frozen=True)
class RunCheckpoint:
    framework: str
    path: Path
    parts: tuple[Part, ...]
    companions: tuple[Companion, ...]
    unknown: tuple[str, ...] = field(default=())  # folders that are neither a part nor a companion: not carried
    unsupported: str | None = None  # a layout ckpt recognises and refuses: why, and what to save instead

    def part_path(self, part: Part) -> Path:
        return self.path / part.relpath if part.relpath else self.path


def _entries(path: Path) -> dict[str, Path]:
    try:
        return {p.name: p for p in path.iterdir() if not p.name.startswith(".")}
    except OSError:
        return {}


def _is(fmt: str, path: Path) -> bool:
    return registry.get(fmt).reader.detect(path)


def detect(path: Path) -> RunCheckpoint | None:
    """The run checkpoint at `path` (names and magic bytes only), or None."""
    if path.is_file():
        if path.suffix == ".ckpt" and _is("torch", path) and foreign(path) is None:  # Lightning's single-file checkpoint
            return RunCheckpoint(LIGHTNING, path, (Part("", "torch", None, "state_dict."),), ())
        return None
    entries = _entries(path)
    if not entries:
        return None
    if "trainer_state.json" in entries:
        return _assemble(TRAINER, path, entries)
    if path.suffix == ".ckpt" or ("meta.pt" in entries and (path / ".metadata").is_file()):
        if _is("deepspeed", path):
            return _assemble(LIGHTNING, path, entries)
        if _is("dcp", path):
            return _assemble(LIGHTNING, path, entries, dcp_prefix="model.")
        return None
    accelerate = any(RANKED_RNG.fullmatch(n) or SCHEDULER.fullmatch(n) or CUSTOM.fullmatch(n) for n in entries)
    if accelerate or any(FSDP_MODEL.fullmatch(n) and p.is_dir() for n, p in entries.items()):
        return _assemble(ACCELERATE, path, entries)
    if TORCHTITAN_STEP.fullmatch(path.name) and _is("dcp", path):
        return RunCheckpoint(TORCHTITAN, path, (Part("", "dcp"),), ())
    return None


def _assemble(framework: str, path: Path, entries: dict[str, Path], dcp_prefix: str = "") -> RunCheckpoint | None:
    ranked = sorted((n for n in entries if FSDP_RANK_FILES.fullmatch(n)), key=lambda n: (n.startswith("optimizer"), n))
    if ranked:
        return RunCheckpoint(framework, path, (), (), unsupported=_fsdp1_rank_files(path, ranked[0]))
    parts, claimed = _parts(path, entries, dcp_prefix)
    if not parts:
        return None
    companions, unknown = [], []
    deepspeed = parts[0].format == "deepspeed" and parts[0].relpath == ""
    for name, p in sorted(entries.items()):
        if name in claimed:
            continue
        if p.is_dir():
            if not (deepspeed and _is("deepspeed", p)):  # DeepSpeed's tag folders belong to the part at ""
                unknown.append(name)
            continue
        if deepspeed and name in ("latest", "latest_universal"):
            continue
        companions.append(_companion(name, deepspeed))
    return RunCheckpoint(framework, path, tuple(parts), tuple(companions), tuple(unknown))


def _fsdp1_rank_files(path: Path, name: str) -> str:
    """Why accelerate's per-rank FSDP1 files are refused (docs/formats.md §7.3), and what to save instead."""
    if re.fullmatch(r"(pytorch_model_fsdp|optimizer)_rank\d+\.bin", name):
        why = (
            "FSDP1's LOCAL_STATE_DICT: each rank's shard of every FSDP unit's flat parameter, and torch saves neither the "
            "shapes nor the padding of the parameters flattened into it, so no tool can take them apart exactly"
        )
    else:
        why = "FSDP1's SHARDED_STATE_DICT saved with use_dcp=False: per-rank ShardedTensor pickles, which ckpt does not read"
    return (
        f"{path / name}: {why}; save with FSDP state_dict_type SHARDED_STATE_DICT (through DCP, accelerate's default) or "
        "FULL_STATE_DICT, which ckpt reads"
    )


def _parts(path: Path, entries: dict[str, Path], dcp_prefix: str) -> tuple[list[Part], set[str]]:
    """The tensor parts of a run folder, the primary (model or whole training state) first, and the names they own."""
    if _is("deepspeed", path):
        return [Part("", "deepspeed")], set()
    if (path / ".metadata").is_file() and _is("dcp", path):
        return [Part("", "dcp", None, dcp_prefix)], {".metadata", *(n for n in entries if n.endswith(".distcp"))}
    folders = [(name, p) for name, p in sorted(entries.items()) if p.is_dir()]
    parts = [Part(name, "dcp", "model", "model.") for name, p in folders if FSDP_MODEL.fullmatch(name) and _is("dcp", p)]
    parts += [Part(name, "dcp", "optimizer") for name, p in folders if FSDP_OPTIM.fullmatch(name) and _is("dcp", p)]
    if not parts:
        if "model.safetensors.index.json" in entries:
            parts.append(Part("", "hf", "model"))
        else:
            weights = next((n for n in WEIGHT_FILES if n in entries), None)  # the first: a second is a copy (Trainer FSDP full)
            parts += [Part(weights, "safetensors" if weights.endswith(".safetensors") else "torch", "model")] if weights else []
        if parts:
            parts += [Part(n, "torch", "optimizer") for n in OPTIMIZER_FILES if n in entries]
    claimed = {p.relpath for p in parts}
    if parts and parts[0].format == "hf":
        claimed |= {n for n in entries if n.endswith(".safetensors") or n == "model.safetensors.index.json"}
    return parts, claimed


def _companion(name: str, beside_deepspeed: bool) -> Companion:
    if name == "trainer_state.json":
        return Companion(name, "trainer_state")
    if m := RANKED_RNG.fullmatch(name):
        return Companion(name, "rng", int(m.group(1)) if m.group(1) is not None else None)
    if SCHEDULER.fullmatch(name):
        return Companion(name, "scheduler")
    if CUSTOM.fullmatch(name):
        return Companion(name, "custom")
    if name == "meta.pt":
        return Companion(name, "framework_state")
    if name == "training_args.bin":
        return Companion(name, "args")
    if name.startswith(("tokenizer", "chat_template")) or name in TOKENIZER_FILES:
        return Companion(name, "tokenizer")
    if name in WEIGHT_FILES and beside_deepspeed:  # the Trainer's 16-bit copy beside the ZeRO files
        return Companion(name, "weights_copy")
    if name.endswith(".json"):
        return Companion(name, "config")
    if name.endswith(".py"):
        return Companion(name, "script")
    return Companion(name, "other")


def foreign(path: Path) -> str | None:
    """What a file of another tool is, in words (a NumPy array or archive, a zip or pickle that torch.save did not
    write, a file named .safetensors without a safetensors header), from its first bytes; None for a file that may be
    a checkpoint, a damaged one included: a truncated torch.save zip still names `data.pkl` first, a truncated legacy
    one still starts with torch's magic number, and a file too short to tell is left to its reader."""
    try:
        with open_regular(path) as f:
            head = f.read(512)
    except (OSError, DataError):
        return None
    if len(head) >= 9 and head[8:9] == b"{":  # a safetensors header (its length may start with any byte, 0x80 too)
        return None
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy array (np.save), not a checkpoint"
    if head.startswith(b"PK\x03\x04") and len(head) >= 30:
        size = int.from_bytes(head[26:28], "little")
        first = head[30 : 30 + size]
        if len(first) < size or first.endswith(b"data.pkl"):  # torch.save writes data.pkl first
            return None
        if first.endswith(b".npy"):
            return "a NumPy archive (np.savez), not a torch.save file"
        return f"a zip archive (first entry {first.decode(errors='replace')!r}), not a torch.save file"
    if head[:1] == b"\x80" and len(head) >= len(LEGACY_TORCH) and not head.startswith(LEGACY_TORCH):
        return "a pickle of another tool, not a torch.save file"
    if path.suffix == ".safetensors" and len(head) >= 9 and head[8:9] != b"{":
        return "named .safetensors, but without a safetensors header"
    return None


def is_part_of(path: Path) -> tuple[RunCheckpoint, Path] | None:
    """The run checkpoint that `path` is one part of (a DCP folder, a DeepSpeed tag folder, a rank file), looking
    up to three levels up: (run, its path)."""
    for up in list(path.resolve().parents)[:3]:
        if store.is_bucket(up):  # a bucket: its listing may be of any size, and a run lives under a prefix
            break
        run = detect(up)
        if run is not None and run.path != path:
            return run, up
    return None
