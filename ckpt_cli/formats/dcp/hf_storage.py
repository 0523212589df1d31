"""DCP saved with safetensors serialization (read-only): byte ranges of the tensors, no torch.

`FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)` writes each `__R_I.distcp` as its
BYTE_IO items (torch.save archives, as usual) followed by one safetensors document holding the file's tensor
chunks by FQN, with `DCP_SHARDING_INFO` ({fqn: {"saved_offsets": [...]}}) in its `__metadata__`. `.metadata`
gives every tensor item of the file the same offset (where the document starts) and the chunk's byte count as
length: the document runs to the end of the file, and a chunk's bytes are found through its header.

`HuggingFaceStorageWriter(save_distributed=True)` writes no `.metadata` at all: every rank writes
`shard-{rank+1:05}-model-{i:05}-of-{n:05}.safetensors` with the same `DCP_SHARDING_INFO`; torch's
HuggingFaceStorageReader rebuilds each tensor from the chunks' offsets and shapes (its size: the furthest chunk
end per dim). That folder is the `dcp-hf` format here. safetensors has no checksums. Facts: docs/formats.md.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_cli.core import structured
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Box, Checkpoint, FileInfo, Piece, StoredArray, TensorEntry, contiguous_strides
from ckpt_cli.core.paths import file_size, present, shown
from ckpt_cli.errors import DataError
from ckpt_cli.formats import safetensors as st
from ckpt_cli.store import location

SHARDING_INFO = "DCP_SHARDING_INFO"
SHARD_FILE = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")


@dataclass
class Blob:
    """One safetensors document inside a file: its tensors and the offsets DCP saved them at."""

    path: str
    data_start: int  # absolute offset of its data buffer
    tensors: dict[str, tuple[DType, tuple[int, ...], int, int]]
    saved_offsets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def array(self, name: str) -> StoredArray:
        dtype, shape, begin, _ = self.tensors[name]
        return StoredArray(self.path, self.data_start + begin, dtype, shape, contiguous_strides(shape))


def parse_blob(f: BinaryIO, where: str, start: int) -> Blob:
    """The safetensors document at byte `start` of an open file, running to the end of the file."""
    size = file_size(f)
    f.seek(start)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise DataError(f"{where}: no safetensors header at byte {start} (the file has {size} bytes); truncated?")
    (n,) = struct.unpack("<Q", prefix)
    if n > st.MAX_HEADER or start + 8 + n > size:
        raise DataError(f"{where}: safetensors header at byte {start} ({n} bytes) does not fit in the file ({size} bytes); truncated?")
    doc = st._load_json(f.read(n), where)
    if not isinstance(doc, dict):
        raise DataError(f"{where}: safetensors header at byte {start} is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    blob = Blob(where, start + 8 + n, {name: st._parse_entry(where, name, info) for name, info in doc.items()})
    data_len = size - blob.data_start
    pos = 0
    for begin, end, name in sorted((b, e, name) for name, (_, _, b, e) in blob.tensors.items()):
        if end > data_len:
            raise DataError(f"{where}: '{name}' runs past the end of the file (bytes {begin}..{end} of {data_len}); truncated?")
        if begin < pos:
            raise DataError(f"{where}: '{name}' overlaps the previous tensor of its safetensors header")
        pos = end
    if pos != data_len:
        blob.problems.append(f"{where}: {data_len - pos} bytes after the last safetensors tensor are referenced by nothing")
    blob.saved_offsets = _sharding_info(metadata, blob, where)
    return blob


def _sharding_info(metadata: Any, blob: Blob, where: str) -> dict[str, tuple[int, ...]]:
    """DCP_SHARDING_INFO: each tensor's offsets in the global tensor (absent: a whole tensor at 0)."""
    raw = metadata.get(SHARDING_INFO) if isinstance(metadata, dict) else None
    if raw is None:
        return {name: (0,) * len(shape) for name, (_, shape, _, _) in blob.tensors.items()}
    info = structured.load_json(raw, where, DataError) if isinstance(raw, str) else None
    if not isinstance(info, dict):
        raise DataError(f"{where}: {SHARDING_INFO} is not a JSON object")
    out = {}
    for name, (_, shape, _, _) in blob.tensors.items():
        entry = info.get(name)
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(offsets, list) or len(offsets) != len(shape) or not all(type(o) is int and o >= 0 for o in offsets):
            raise DataError(
                f"{where}: {SHARDING_INFO} gives {shown(name)} offsets {shown(offsets)}; it needs {len(shape)} non-negative integers"
            )
        out[name] = tuple(offsets)
    return out


class Blobs:
    """The safetensors documents of a DCP checkpoint, parsed once each (every tensor item of a file names the same one)."""

    def __init__(self) -> None:
        self.parsed: dict[tuple[str, int], Blob] = {}

    def chunk(
        self, f: BinaryIO, where: str, start: int, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: DType
    ) -> StoredArray:
        """The stored array of a DCP chunk written as a safetensors entry; DataError when it is not the chunk .metadata describes."""
        blob = self.parsed.get((where, start))
        if blob is None:
            blob = self.parsed[(where, start)] = parse_blob(f, where, start)
        if fqn not in blob.tensors:
            raise DataError(f"{where}: '{fqn}' is not in the safetensors document at byte {start}")
        got_dtype, shape, _, _ = blob.tensors[fqn]
        if got_dtype != dtype or shape != sizes or blob.saved_offsets[fqn] != offsets:
            raise DataError(
                f"{where}: '{fqn}' is stored as {got_dtype}{list(shape)} at {list(blob.saved_offsets[fqn])}; "
                f".metadata says {dtype}{list(sizes)} at {list(offsets)}"
            )
        return blob.array(fqn)

    def problems(self) -> list[str]:
        return [p for blob in self.parsed.values() for p in blob.problems]


class DCPHFReader:
    """A folder HuggingFaceStorageWriter(save_distributed=True) wrote: one set of safetensors files per rank."""

    name = "dcp-hf"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and not present(path / ".metadata") and any(SHARD_FILE.match(p.name) for p in path.iterdir())

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        files = sorted((int(m.group(1)), int(m.group(2)), int(m.group(3)), p) for p in path.iterdir() if (m := SHARD_FILE.match(p.name)))
        _check_names(path, files)
        chunks: dict[str, list[tuple[tuple[int, ...], StoredArray]]] = {}
        infos = []
        for _, _, _, p in files:
            header = st.parse_header(p)
            blob = Blob(str(p), header.data_start, header.tensors)
            blob.saved_offsets = _sharding_info(header.metadata, blob, str(p))
            for name in header.tensors:
                chunks.setdefault(name, []).append((blob.saved_offsets[name], blob.array(name)))
            infos.append(FileInfo(str(p), header.file_size))
        tensors = {name: _assemble(path, name, parts) for name, parts in chunks.items()}
        return Checkpoint(
            format=self.name,
            path=str(path),
            tensors=tensors,
            files=infos,
            world_size=max(f[0] for f in files),
            details={"ranks": max(f[0] for f in files), "files_per_rank": files[0][2], "chunks": sum(len(c) for c in chunks.values())},
        )

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        return [p for info in ckpt.files for p in st.parse_header(location(info.path)).problems]


def _check_names(folder: Path, files: list[tuple[int, int, int, Path]]) -> None:
    """shard-R-model-I-of-N: ranks 1..max, each with files 1..N, one N for all."""
    counts = {n for _, _, n, _ in files}
    if len(counts) != 1:
        raise DataError(f"{folder}: shard files of {' and '.join(map(str, sorted(counts)))} files per rank; one save writes one count")
    (per_rank,) = counts
    have = {(r, i) for r, i, _, _ in files}
    for rank in range(1, max(r for r, _, _, _ in files) + 1):
        for index in range(1, per_rank + 1):
            if (rank, index) not in have:
                raise DataError(f"{folder / f'shard-{rank:05d}-model-{index:05d}-of-{per_rank:05d}.safetensors'}: missing")


def _assemble(folder: Path, name: str, parts: list[tuple[tuple[int, ...], StoredArray]]) -> TensorEntry:
    """A tensor from its chunks; its shape is the furthest chunk end per dim, as HuggingFaceStorageReader takes it."""
    ndims = {len(a.shape) for _, a in parts}
    dtypes = {a.dtype for _, a in parts}
    if len(ndims) != 1 or len(dtypes) != 1:
        raise DataError(f"{folder}: the chunks of '{name}' disagree on dtype or number of dimensions")
    shape = tuple(max(o[d] + a.shape[d] for o, a in parts) for d in range(ndims.pop()))
    entry = TensorEntry(name, dtypes.pop(), shape, "model", [Piece(Box(o, a.shape), a) for o, a in parts])
    problem = entry.tiling_problem()
    if problem:
        raise DataError(f"{folder}: the chunks of '{name}' do not tile {list(shape)}: {problem}")
    return entry


HF_READER = DCPHFReader()
