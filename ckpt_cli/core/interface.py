"""The Reader and Writer protocols every format module implements, and their options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckpt_cli.core.model import Checkpoint
from ckpt_cli.core.write.plan import WritePlan


@dataclass(frozen=True)
class ReadOptions:
    tag: str | None = None
    trust_pickle: bool = False
    layout_only: bool = False  # what inspect reports: names, shapes, dtypes, files; where each chunk's bytes lie may stay unread
    # A tensor's pieces located when its data is first read, and forgettable (LazyPieces.release): `diff` of two wide
    # checkpoints holds one tensor's pieces at a time, not both checkpoints' (formats without it read as usual)
    pieces_when_read: bool = False
    # In object storage, DCP chunks laid out from a parsed twin of the same dtype, shape and length, each checked when
    # its data is fetched (formats/dcp/twins.py): for a write, which fetches every byte it uses; never for verify
    predicted_chunks: bool = False


@dataclass(frozen=True)
class WriteOptions:
    max_shard_size: int | None = None  # hf: bytes per shard
    num_shards: int | None = None  # hf: exact number of shards
    world_size: int | None = None  # dcp, deepspeed: number of ranks to write for
    tp: int | None = None  # dcp: tensor-parallel size of a (world_size / tp) x tp mesh (formats/dcp/mesh.py)
    per_rank_rule: str = "wrap"  # per-rank values under a new world size (core/training.py)
    # deepspeed MoE: new expert-parallel sizes, (module, size) pairs, module "" for every other MoE layer (deepspeed/regroup.py)
    ep_size: tuple[tuple[str, int], ...] | None = None
    # a writer that picks each tensor's type itself (registry `casts_itself`): --dtype's target and --quantize's method
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: keep
    quantize: str | None = None  # gguf: "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"
    orbax_storage: str | None = None  # orbax: "ocdbt" (the default), "ocdbt-zarr3", "zarr3"


class Reader(Protocol):
    name: str

    def detect(self, path: Path) -> bool:
        """Cheap test from names and magic bytes; no full parse."""
        ...

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        """Parse metadata into a Checkpoint (tensor data stays on disk); DataError on bad input."""
        ...

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        """Format-specific integrity problems beyond what `read` already refuses (one line each)."""
        ...


class Writer(Protocol):
    name: str
    dest_is_dir: bool

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        """Lay out the destination from metadata alone."""
        ...
