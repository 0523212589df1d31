"""A write plan: which bytes go where, built from metadata alone (no tensor data is read).

Writers turn a checkpoint and a target layout into a `WritePlan`: output files made of segments,
either literal bytes, the data of one logical tensor (cast to a dtype), or bytes that depend on
checksums of earlier segments (zip descriptors and directories). The executor streams it;
`--dry-run` prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import TensorEntry


@dataclass(frozen=True, slots=True)  # slots: a wide DCP write plans a few of these for each of 200,000 chunks
class Literal:
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class TensorData:
    """The elements of `tensor` in row-major order, as `dtype`; `crc_key` asks for their CRC32."""

    tensor: TensorEntry
    dtype: DType
    crc_key: str | None = None

    @property
    def size(self) -> int:
        return self.tensor.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Deferred:
    """`size` bytes computed after the data is written, from the CRCs gathered so far."""

    size: int
    build: Callable[[dict[str, int]], bytes]


Segment = Literal | TensorData | Deferred


@dataclass
class OutputFile:
    relpath: str  # relative to the destination ("" when the destination is itself the file)
    segments: list[Segment] = field(default_factory=list)
    commit_marker: bool = False  # written after every other file (DCP .metadata, an index)

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def tensor_names(self) -> list[str]:
        return [s.tensor.name for s in self.segments if isinstance(s, TensorData)]


@dataclass
class WritePlan:
    """Everything one writing command will do. `dest_is_dir`: the destination is a folder."""

    format: str
    dest: Path
    dest_is_dir: bool
    files: list[OutputFile]
    notes: list[str] = field(default_factory=list)  # what was dropped, tied, cast: told to the user

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def data_bytes(self) -> int:
        return sum(s.size for f in self.files for s in f.segments if isinstance(s, TensorData))

    def largest_tensor_bytes(self) -> int:
        sizes = [s.size for f in self.files for s in f.segments if isinstance(s, TensorData)]
        return max(sizes, default=0)
