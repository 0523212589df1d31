"""`--to gguf`: a Hugging Face model (or a training checkpoint with --hf-config) as the GGUF file llama.cpp's
converter (convert_hf_to_gguf.py) writes, byte for byte. The plan is made from metadata alone: the header (key-values
and tensor infos with their aligned offsets) is its first Literal; each tensor follows as a view of the source that
streams: cast by the executor (F32, F16), or computed a band of rows at a time (BF16 and the block types:
quantize.py). Which type each tensor gets follows the converter's rules (`tensor_type`, docs/formats.md "GGUF").
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_cli.core.dtypes import BY_NAME
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.names.stack import Stack
from ckpt_cli.core.reading import byte_runs_in, read_elements, read_runs_into
from ckpt_cli.core.write.plan import Literal, OutputFile, Segment, TensorData, WritePlan
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.companions import companion_config
from ckpt_cli.formats.gguf import arch as archs
from ckpt_cli.formats.gguf import bpe, lora, quantize, vocab
from ckpt_cli.formats.gguf.constants import DEFAULT_ALIGNMENT, TensorType, ValueType
from ckpt_cli.formats.gguf.encode import KV, TensorInfo, header, pad

QUANT_VERSION = 2  # GGML_QUANT_VERSION
_FROM_DTYPE = {"float32": TensorType.F32, "float16": TensorType.F16, "bfloat16": TensorType.BF16}
_ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # MoE routers stay F32 (the converter's list, for these archs)


def file_type(ckpt: Checkpoint, options: WriteOptions) -> TensorType:
    """The type the converter's --outtype names: --quantize (q8_0, ...), else --dtype, else (keep) the 16- or 32-bit
    type of the source's weights (the converter's `auto`, where f32 weights stay f32)."""
    if options.quantize is not None:
        if options.quantize not in quantize.NAMES:
            raise UsageError(f"--quantize {options.quantize}: GGUF's block types are {', '.join(quantize.NAMES)}")
        return quantize.NAMES[options.quantize]
    if options.dtype is not None:
        return _FROM_DTYPE[options.dtype]
    floats = [t.dtype.name for t in ckpt.tensors.values() if len(t.shape) > 1 and t.dtype.is_float]
    return _FROM_DTYPE.get(floats[0] if floats else "float32", TensorType.F16)


def tensor_type(name: str, shape: tuple[int, ...], wanted: TensorType) -> TensorType:
    """conversion/base.py prepare_tensors: 1-D tensors, norms, routers and anything not a `.weight` (or a LoRA's
    `.lora_a`, `.lora_b`) stay F32; the rest take the file's type, and a row that is not whole blocks falls back to F16."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith((".weight", ".lora_a", ".lora_b")):
        return TensorType.F32
    if re.fullmatch(r"blk\.\d+\.(" + "|".join(_ROUTERS) + r")\.weight", name):
        return TensorType.F32
    if wanted in quantize.QUANTIZED and not quantize.fits(wanted, shape[-1]):
        return TensorType.F16
    return wanted


BAND_BYTES = 4 << 20  # float32 bytes of a thread's band of rows: the quantizer's few temporaries stay a few times this
THREADS = min(os.cpu_count() or 1, 8)  # numpy's loops let go of the GIL: a window's bands are quantized at once
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="gguf-quantize")
    return _POOL


@dataclass(eq=False)
class Encoded:
    """A tensor's bytes as `kind`, computed from a band of whole rows of `source` at a time in numpy (no torch: the
    write of a release holds the CLI and a few bands). Stored bf16, f16 and f32 are read as bytes and widened to
    float32 as the converter widens them; anything else goes through torch."""

    source: TensorEntry
    kind: TensorType

    @property
    def cols(self) -> int:
        return self.source.shape[-1] if self.source.shape else 1

    @property
    def row_bytes(self) -> int:
        return TensorInfo("", (self.cols,), self.kind).nbytes

    @property
    def without_torch(self) -> bool:
        """Whether its bands are made in numpy alone (what the plan's memory estimate asks)."""
        return self.source.dtype.name in _WIDEN

    @property
    def band_rows(self) -> int:
        return max(1, BAND_BYTES // max(self.cols * 4, 1))

    def windows(self) -> Iterator[tuple[int, int]]:
        rows = self.source.numel // max(self.cols, 1)
        step = self.band_rows * THREADS
        for r0 in range(0, rows, step):
            yield r0 * self.row_bytes, min(step, rows - r0) * self.row_bytes

    def read(self, start: int, count: int, sources: Any) -> Any:
        cols, size = self.cols, self.row_bytes
        r0, r1 = start // size, -(-(start + count) // size)
        stored, widen = self._stored(r0 * cols, (r1 - r0) * cols, sources)
        stored = stored.reshape(r1 - r0, -1)

        def encode(band: Any) -> Any:
            return quantize.quantize(widen(band).reshape(len(band), cols), self.kind)

        bands = [stored[b : b + self.band_rows] for b in range(0, r1 - r0, self.band_rows)]
        # rows are independent: each thread widens and quantizes a band, joined in order
        data = encode(bands[0]) if len(bands) == 1 else np.concatenate(list(_pool().map(encode, bands)))
        skip = start - r0 * size
        return data[skip : skip + count]

    def _stored(self, start: int, count: int, sources: Any) -> tuple[Any, Any]:
        """Elements [start, start + count) as stored bytes and the function that widens them to float32 (read into
        one buffer, no copy between), or as float32 read through torch for other stored dtypes."""
        dtype = self.source.dtype
        runs = byte_runs_in(self.source, dtype, start, count) if dtype.name in _WIDEN else None
        if runs is None:
            import torch

            return read_elements(self.source, start, count, sources).to(torch.float32).numpy(), lambda x: x
        raw: Any = quantize.scratch("stored", (count * dtype.itemsize,), np.uint8)  # used up before the next window
        read_runs_into(runs, memoryview(raw), sources)
        return raw, _WIDEN[dtype.name]


def _bf16_to_f32(raw: Any) -> Any:
    out = quantize.scratch("widened", (raw.size // 2,), np.uint32)
    np.left_shift(raw.reshape(-1).view(np.uint16), np.uint32(16), out=out, dtype=np.uint32)  # bf16 is f32's high half
    return out.view(np.float32)


_WIDEN = {  # stored bytes to float32, as the converter widens them (exactly)
    "float32": lambda raw: raw.reshape(-1).view(np.float32),
    "float16": lambda raw: raw.reshape(-1).view(np.float16).astype(np.float32),
    "bfloat16": _bf16_to_f32,
}


def _stacked(members: dict[str, TensorEntry], layer: str, which: str, out: str) -> TensorEntry:
    pattern = re.escape(f"model.layers.{layer}.") + r"(block_sparse_moe|mlp)\.experts\.(?P<index>\d+)\." + re.escape(which) + r"\.weight"
    stacked, _ = Stack(pattern, out).gather(members, lambda n: n)
    return stacked[out]


def _converter_order(ckpt: Checkpoint) -> list[TensorEntry]:
    """The order the converter reads tensors in: shard file by file (sorted names), each file's tensors by name; a
    source that is not a Hugging Face release, by name."""

    def key(entry: TensorEntry) -> tuple[str, str]:
        arrays = entry.stored_arrays() if ckpt.format in ("hf", "safetensors") else ()
        return (Path(arrays[0].path).name if arrays else "", entry.name)

    return sorted((t for t in ckpt.tensors.values() if t.role == "model"), key=key)


def gguf_tensors(ckpt: Checkpoint, config: dict[str, Any], arch: archs.Arch) -> list[tuple[str, TensorEntry]]:
    """(GGUF name, the source tensor laid out as GGUF holds it) in the converter's order; experts stacked at the point
    the converter has all of a layer's (its last expert read)."""
    out: list[tuple[str, TensorEntry]] = []
    pending: dict[str, dict[str, TensorEntry]] = {}
    experts_re = archs.EXPERT_RE.get(arch.experts or "")
    n_experts = archs.find(config, ("num_local_experts", "num_experts")) or 0
    for entry in _converter_order(ckpt):
        name = entry.name
        if archs.skipped(name):
            continue
        match = experts_re.fullmatch(name) if experts_re else None
        if match is not None and arch.experts is not None:
            layer = pending.setdefault(match[1], {})
            layer[name] = entry
            if len(layer) >= n_experts * 3:
                for which in archs.EXPERT_ORDER[arch.experts]:
                    gname = f"blk.{match[1]}.{archs.EXPERT_NAMES[which]}.weight"
                    out.append((gname, _stacked(layer, match[1], which, gname)))
                del pending[match[1]]
            continue
        if arch.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            entry = archs.permuted_qk(entry, name, config)
        out.append((archs.gguf_name(name), entry))
    if pending:
        raise UsageError(f"layer {next(iter(pending))}: {len(next(iter(pending.values())))} expert weights, not {n_experts} x 3")
    return out


def size_label(infos: list[TensorInfo]) -> str:
    """gguf-py's size_label from get_total_parameter_count: experts counted once each, shown as EXPERTSxSIZE."""
    total = shared = expert = expert_sum = n_expert = 0
    for info in infos:
        size = math.prod(info.shape)
        if "_exps." in info.name and len(info.shape) >= 3:
            count = info.shape[-2 if ".bias" in info.name else -3]
            expert += size // count
            expert_sum += count
            n_expert += 1
        else:
            shared += size
        total += size
    count = expert_sum // n_expert if n_expert else 0
    return f"{count}x{_rounded(shared + expert)}" if count else _rounded(total)


def _rounded(n: int) -> str:
    for limit, scale, suffix in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M"), (0, 1e-3, "K")):
        if n > limit or suffix == "K":
            value = n * scale
            fix = max(2 - len(str(round(value)).lstrip("0")), 0)
            return f"{value:.{fix}f}{suffix}"
    raise AssertionError


_SAMPLING = (  # generation_config.json key -> general.sampling.* key (gguf/metadata.py), in the order they are added
    ("sequence", "sequence", ValueType.STRING),
    ("top_k", "top_k", ValueType.INT32),
    ("top_p", "top_p", ValueType.FLOAT32),
    ("min_p", "min_p", ValueType.FLOAT32),
    ("xtc_probability", "xtc_probability", ValueType.FLOAT32),
    ("xtc_threshold", "xtc_threshold", ValueType.FLOAT32),
    ("temperature", "temp", ValueType.FLOAT32),
    ("penalty_last_n", "penalty_last_n", ValueType.INT32),
    ("penalty_repeat", "penalty_repeat", ValueType.FLOAT32),
    ("mirostat", "mirostat", ValueType.INT32),
    ("mirostat_tau", "mirostat_tau", ValueType.FLOAT32),
    ("mirostat_eta", "mirostat_eta", ValueType.FLOAT32),
)


def general_kvs(ckpt: Checkpoint, name: str, infos: list[TensorInfo]) -> list[KV]:
    generation = vocab.file_json(ckpt.companions, "generation_config.json") if "generation_config.json" in ckpt.companions else None
    out = [KV("general.type", ValueType.STRING, "model")]
    for key, gkey, kind in _SAMPLING:
        value = (generation or {}).get(key)
        if key == "penalty_repeat" and value is None:
            value = (generation or {}).get("repetition_penalty")
        if value is not None:
            out.append(KV(f"general.sampling.{gkey}", kind, float(value) if kind == ValueType.FLOAT32 else value))
    out.append(KV("general.name", ValueType.STRING, name))
    out.append(KV("general.size_label", ValueType.STRING, size_label(infos)))
    return out


def release_name(ckpt: Checkpoint) -> str:
    """general.name: the name of the folder config.json comes from (the release's own, or --hf-config's), as the
    converter names a model after its folder when --model-name is not given (its heuristics aside: docs/formats.md)."""
    source = ckpt.companions.get("config.json")
    return Path(source).parent.name if isinstance(source, str) else Path(ckpt.path).name


def tokenizer_kvs(files: vocab.Files, config: dict[str, Any], arch: archs.Arch) -> list[KV]:
    """The tokenizer's keys as the architecture's set_vocab adds them: Llama first sets add_space_prefix from
    tokenizer_config.json; a SentencePiece tokenizer.model is read where the architecture tries it first, else a BPE
    tokenizer.json (formats/gguf/bpe.py)."""
    out = []
    if arch.name == "llama":
        prefix = (vocab.file_json(files, "tokenizer_config.json") or {}).get("add_prefix_space")
        if prefix is not None:
            out.append(KV("tokenizer.ggml.add_space_prefix", ValueType.BOOL, bool(prefix)))
    if arch.vocab == "spm-first" and "tokenizer.model" in files:
        return out + vocab.spm_kvs(files, config)
    if "tokenizer.json" in files:
        return out + bpe.bpe_kvs(files, config)
    raise UsageError(
        "GGUF needs the model's tokenizer: tokenizer.model (SentencePiece) or tokenizer.json (BPE) beside config.json "
        "(pass --hf-config DIR with the release's tokenizer files)"
    )


@dataclass(frozen=True)
class Layout:
    """What a GGUF write lays out: the key-values, and each tensor's info and the view whose bytes it writes."""

    kvs: list[KV]
    tensors: list[tuple[TensorInfo, TensorEntry]]


def layout(ckpt: Checkpoint, options: WriteOptions) -> Layout:
    config = companion_config(ckpt)
    if config is None:
        raise UsageError(f"{ckpt.path}: GGUF needs the model's config.json (and tokenizer): pass --hf-config DIR with the release's files")
    hf, arch = archs.arch_of(config)
    wanted = file_type(ckpt, options)
    if ckpt.format == "adapter":  # a PEFT LoRA, as convert_lora_to_gguf.py writes it
        pairs = lora.lora_tensors(ckpt, config, arch)
        kvs = [*lora.lora_kvs(ckpt, arch), KV("general.quantization_version", ValueType.UINT32, QUANT_VERSION)]
        return Layout(kvs, [(TensorInfo(g, e.shape, tensor_type(g, e.shape, wanted)), e) for g, e in pairs])
    tensors = []
    for gname, entry in gguf_tensors(ckpt, config, arch):
        kind = tensor_type(gname, entry.shape, wanted)
        tensors.append((TensorInfo(gname, entry.shape, kind), entry))
    infos = [info for info, _ in tensors]
    kvs = [KV("general.architecture", ValueType.STRING, arch.name), *general_kvs(ckpt, release_name(ckpt), infos)]
    kvs += archs.parameter_kvs(hf, arch, config, wanted.name)
    kvs.append(KV("general.quantization_version", ValueType.UINT32, QUANT_VERSION))
    kvs += tokenizer_kvs(ckpt.companions, config, arch)
    return Layout(kvs, tensors)


def data_segment(info: TensorInfo, entry: TensorEntry) -> Segment:
    """The stored bytes where they are already the type's (copied by the kernel), else computed (Encoded)."""
    if (info.type, entry.dtype.name) in ((TensorType.F32, "float32"), (TensorType.F16, "float16")):
        return TensorData(entry, entry.dtype)
    encoded = TensorEntry(
        info.name, BY_NAME["uint8"], (info.nbytes,), "model", entry.pieces, (info.name,), derived=Encoded(entry, info.type)
    )
    return TensorData(encoded, BY_NAME["uint8"])


def file_segments(kvs: list[KV], tensors: list[tuple[TensorInfo, TensorEntry]]) -> list[Segment]:
    segments: list[Segment] = [Literal(header(kvs, [info for info, _ in tensors], DEFAULT_ALIGNMENT))]
    for info, entry in tensors:
        segments.append(data_segment(info, entry))
        if pad(info.nbytes) != info.nbytes:
            segments.append(Literal(bytes(pad(info.nbytes) - info.nbytes)))
    return segments


SHARD_NAME = "{}-{:05d}-of-{:05d}.gguf"  # gguf-py's SHARD_NAME_FORMAT, as gguf-split names a set


def split_by_size(tensors: list[tuple[TensorInfo, TensorEntry]], limit: int) -> list[list[tuple[TensorInfo, TensorEntry]]]:
    """GGUFWriter.add_tensor_info: a new file when the tensors so far (unpadded) and this one pass the limit, never an
    empty one."""
    groups: list[list[tuple[TensorInfo, TensorEntry]]] = [[]]
    for item in tensors:
        if groups[-1] and sum(info.nbytes for info, _ in groups[-1]) + item[0].nbytes > limit:
            groups.append([])
        groups[-1].append(item)
    return groups


def split_files(found: Layout, stem: str, limit: int) -> list[OutputFile]:
    """A split set: the first file holds every key-value and then the split keys, the others the split keys alone
    (split.no, split.count as u16, split.tensors.count as i32: GGUFWriter.add_shard_kv_data); one group is one plain
    file, without split keys, as the converter writes it."""
    groups = split_by_size(found.tensors, limit)
    if len(groups) == 1:
        return [OutputFile(f"{stem}.gguf", file_segments(found.kvs, found.tensors))]
    files = []
    for i, group in enumerate(groups):
        keys = [
            KV("split.no", ValueType.UINT16, i),
            KV("split.count", ValueType.UINT16, len(groups)),
            KV("split.tensors.count", ValueType.INT32, len(found.tensors)),
        ]
        files.append(OutputFile(SHARD_NAME.format(stem, i + 1, len(groups)), file_segments([*found.kvs, *keys] if i == 0 else keys, group)))
    return files


class GgufWriter:
    name = "gguf"
    dest_is_dir = False  # a file; a folder holding the split set with --max-shard-size

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        found = layout(ckpt, options)
        if options.max_shard_size:
            stem = dest.name.removesuffix(".gguf")
            return WritePlan(self.name, dest, True, split_files(found, stem, options.max_shard_size))
        return WritePlan(self.name, dest, False, [OutputFile("", file_segments(found.kvs, found.tensors))])


WRITER = GgufWriter()
