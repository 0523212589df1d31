"""Hugging Face sharded checkpoints: `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`.

Reads the legacy `pytorch_model.bin.index.json` with `.bin` shards too (read-only). Sharding
follows huggingface_hub's `split_torch_state_dict_into_shards` (state-dict order, a new shard
when the next tensor would pass the limit), so `--max-shard-size` gives the files the hub gives.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import closing
from pathlib import Path
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.interface import ReadOptions, WriteOptions
from ckpt_cli.core.model import Checkpoint, FileInfo, TensorEntry
from ckpt_cli.core.paths import plain_component, present, read_regular_text
from ckpt_cli.core.write.plan import Literal, OutputFile, WritePlan
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import safetensors as st
from ckpt_cli.formats import torch_save
from ckpt_cli.formats.companions import companion_config, companion_files, companions_in
from ckpt_cli.store import location, prefetch_heads

INDEX = "model.safetensors.index.json"
LEGACY_INDEX = "pytorch_model.bin.index.json"
SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD = 5 * 10**9


def find_index(folder: Path) -> Path | None:
    for name in (INDEX, LEGACY_INDEX):
        if present(folder / name):  # a FIFO or device there is refused by name when read, not passed over
            return folder / name
    others = sorted(folder.glob("*.safetensors.index.json")) + sorted(folder.glob("*.bin.index.json"))
    return others[0] if others else None


def load_index(index: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """weight_map and metadata of an index file; DataError with the reason when malformed."""
    try:
        text = read_regular_text(index, max_bytes=256 << 20)
    except OSError as exc:
        raise DataError(f"{index}: not a readable JSON index ({exc})") from exc
    doc = structured.load_json(text, str(index), DataError)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise DataError(f"{index}: no 'weight_map' object mapping tensor names to files")
    for file in dict.fromkeys(weight_map.values()):
        plain_component(file, f"{index}: weight_map")  # shard files sit beside the index, as the hub writes them
    metadata = doc.get("metadata") or {}
    return weight_map, metadata if isinstance(metadata, dict) else {}


class HFReader:
    name = "hf"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (find_index(path) is not None or present(path / SINGLE))

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        index = find_index(path)
        if index is None:  # a single-file folder as save_pretrained writes for small models
            weight_map: dict[str, str] = {}
            metadata: dict[str, Any] = {}
            shard_files = [SINGLE]
        else:
            weight_map, metadata = load_index(index)
            shard_files = list(dict.fromkeys(weight_map.values()))
        tensors: dict[str, TensorEntry] = {}
        files = [FileInfo(str(index), index.stat().st_size)] if index else []
        objects = {}
        prefetch_heads([path / file for file in shard_files])  # in object storage: every shard's header in one round
        for file in shard_files:
            shard_path = path / file
            if not present(shard_path):
                raise DataError(f"{index}: names shard {file}, which is missing")
            shard = self._read_shard(shard_path, options)
            files.append(FileInfo(str(shard_path), shard_path.stat().st_size))
            for name, entry in shard.tensors.items():
                if index is not None and weight_map.get(name) != file:
                    continue  # not in the index: reported by check(), ignored by loaders
                tensors[name] = entry
            objects.update(shard.objects)
        for name, file in weight_map.items():
            if name not in tensors:
                raise DataError(f"{path / file}: tensor '{name}' is listed in {index.name if index else ''} but absent from the shard")
        if index is not None:  # keep the index order, as loaders see it
            tensors = {name: tensors[name] for name in weight_map}
        companions, notes = companions_in(path)
        return Checkpoint(
            format=self.name,
            path=str(path),
            tensors=tensors,
            objects=objects,
            files=files,
            details={"index": index.name if index else None, "index_metadata": metadata, "shards": len(shard_files)},
            companions=companions,
            notes=notes,
        )

    def _read_shard(self, shard_path: Path, options: ReadOptions) -> Checkpoint:
        if shard_path.suffix == ".safetensors":
            return st.READER.read(shard_path, options)
        return torch_save.READER.read(shard_path, options)

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        problems: list[str] = []
        folder = location(ckpt.path)
        index = find_index(folder)
        weight_map, metadata = load_index(index) if index else ({}, {})
        for info in ckpt.files:
            shard = location(info.path)
            if shard == index:
                continue
            if shard.suffix == ".safetensors":
                header = st.parse_header(shard)
                problems += header.problems
                extra = [n for n in header.tensors if index and weight_map.get(n) != shard.name]
                if extra:
                    problems.append(f"{shard}: {len(extra)} tensors not in the index (e.g. '{extra[0]}'); loaders will ignore them")
            elif deep:  # legacy .bin shards are torch.save archives with CRCs
                problems += torch_save.READER.check(Checkpoint("torch", str(shard), {}), deep)
        total = metadata.get("total_size")
        actual = sum(t.nbytes for t in ckpt.tensors.values())
        if isinstance(total, int) and index and index.name != LEGACY_INDEX and total != actual:
            problems.append(f"{index}: metadata.total_size is {total} but the tensors hold {actual} bytes")
        return problems


def shard_groups(tensors: list[TensorEntry], max_shard_size: int | None, num_shards: int | None) -> list[list[TensorEntry]]:
    """Split tensors (kept in order) into shards: by a byte limit as the hub does, or into N balanced parts."""
    if num_shards is not None:
        if num_shards < 1:
            raise UsageError("--num-shards must be at least 1")
        if num_shards > max(len(tensors), 1):
            raise UsageError(f"--num-shards {num_shards} is more than the {len(tensors)} tensors to place")
        total = sum(t.nbytes for t in tensors)
        groups: list[list[TensorEntry]] = [[] for _ in range(num_shards)]
        done, k = 0, 0
        for i, t in enumerate(tensors):
            # Shard k takes the tensors that start in its 1/N of the bytes, never skips a shard,
            # and leaves at least one tensor for each shard after it.
            want = done * num_shards // total if total else i * num_shards // len(tensors)
            k = min(max(k, want, num_shards - (len(tensors) - i)), k + 1 if i else 0, num_shards - 1)
            groups[k].append(t)
            done += t.nbytes
        return groups
    limit = max_shard_size or DEFAULT_MAX_SHARD
    shards: list[list[TensorEntry]] = []
    current: list[TensorEntry] = []
    size = 0
    for t in tensors:
        if t.nbytes > limit:
            shards.append([t])
            continue
        if size + t.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not shards:
        shards.append(current)
    return shards


class HFWriter:
    name = "hf"
    dest_is_dir = True

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        notes: list[str] = []
        others = [t.name for t in ckpt.tensors.values() if t.role != "model"]
        if others:  # a Hugging Face folder is a model release: weights only, as from_pretrained expects
            notes.append(
                f"hf holds model weights: left out {len(others)} optimizer/other tensors (e.g. {others[0]}); "
                "convert --to torch or dcp keeps them"
            )
            ckpt = dataclasses.replace(ckpt, tensors={n: t for n, t in ckpt.tensors.items() if t.role == "model"})
        tensors = st.model_tensors(ckpt, notes)
        groups = shard_groups(tensors, options.max_shard_size, options.num_shards)
        n = len(groups)
        files, weight_map = [], {}
        for k, group in enumerate(groups, start=1):
            name = f"model-{k:05d}-of-{n:05d}.safetensors"
            files.append(OutputFile(name, list(st.file_segments(group, {"format": "pt"}))))
            weight_map.update({t.name: name for t in group})
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
        files += companion_files(_release_config(ckpt, tensors, notes))
        files.append(OutputFile(INDEX, [Literal(json.dumps(index, indent=2).encode())], commit_marker=True))
        return WritePlan(self.name, dest, True, files, notes)


def _release_config(ckpt: Checkpoint, tensors: list[TensorEntry], notes: list[str]) -> Checkpoint:
    """The checkpoint with its config.json agreeing with the weights written: `torch_dtype`/`dtype` the dtype of the
    floating-point weights (from_pretrained loads in it by default), and `tie_word_embeddings` true where no
    lm_head.weight is written (else from_pretrained leaves the head randomly initialised) and false where an
    lm_head.weight is written that differs from the embeddings (else from_pretrained replaces it by them); the rotary
    settings also at the top level where transformers v5 keeps them only under `rope_parameters`."""
    config = companion_config(ckpt)
    if config is None:
        return ckpt
    changed = _set_dtype(config, tensors) | _set_tie(config, {t.name: t for t in tensors}, notes) | _set_v4_keys(config, notes)
    if not changed:
        return ckpt
    edited = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return dataclasses.replace(ckpt, companions={**ckpt.companions, "config.json": edited})


def _set_dtype(config: dict[str, Any], tensors: list[TensorEntry]) -> bool:
    floats = {t.dtype.name for t in tensors if t.dtype.is_float and not t.dtype.name.startswith("float8")}
    keys = [k for k in ("torch_dtype", "dtype") if k in config]
    if len(floats) != 1 or not keys:
        return False
    want = floats.pop()
    if all(config[k] == want for k in keys):
        return False
    for key in keys:
        config[key] = want
    return True


# Config keys transformers v5 renamed that v4 reads under their old name, by model_type: v4 takes its default without
# them (Qwen3-MoE: 128 experts). Compared for 15 MoE model types, transformers 4.57 against 5.25; v5 reads both names.
V4_NAMES = {"qwen3_moe": {"num_experts": "num_local_experts"}}


def _set_v4_keys(config: dict[str, Any], notes: list[str]) -> bool:
    """Keys a v5 config.json lacks for transformers v4 (and vLLM on it), added with the values v5 keeps elsewhere: the
    v4 names of renamed keys, and `rope_theta` / `rope_scaling` at the top level where v5 writes the rotary settings only
    under `rope_parameters` (v4 then takes the model's default theta: Mixtral's is 1e6). v5 reads `rope_parameters`
    first; per-layer-type settings (a nested dict) are left alone."""
    added = []
    for old, new in V4_NAMES.get(str(config.get("model_type")), {}).items():
        if old not in config and new in config:
            config[old] = config[new]
            added.append(old)
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        params = {}
    if params and "rope_theta" not in config:
        config["rope_theta"] = params["rope_theta"]
        added.append("rope_theta")
    if params and params.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        config["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        added.append("rope_scaling")
    if added:
        notes.append(f"config.json: {', '.join(added)} added for transformers v4 and vLLM (v5 keeps the same values under other keys)")
    return bool(added)


def _set_tie(config: dict[str, Any], written: dict[str, TensorEntry], notes: list[str]) -> bool:
    tie = config.get("tie_word_embeddings")
    embed = next((n for n in written if n.endswith("embed_tokens.weight")), None)
    if not isinstance(tie, bool) or embed is None:
        return False  # the model class's own default applies; nothing to check against
    head = written.get("lm_head.weight")
    if head is None and not tie:
        notes.append("config.json: tie_word_embeddings set to true: no lm_head.weight is written (it is tied to the embeddings)")
    elif head is not None and tie and not _same_values(head, written[embed]):
        notes.append(f"config.json: tie_word_embeddings set to false: lm_head.weight differs from {embed}")
    else:
        return False
    config["tie_word_embeddings"] = not tie
    return True


def _same_values(a: TensorEntry, b: TensorEntry) -> bool:
    from ckpt_cli.core.reading import SourceFiles, equal_values

    with closing(SourceFiles()) as sources:
        return equal_values(a, b, sources)


READER = HFReader()
WRITER = HFWriter()
