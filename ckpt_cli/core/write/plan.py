"""A write plan: which bytes go where, built from metadata alone (no tensor data is read).

Writers turn a checkpoint and a target layout into a `WritePlan`: output files made of segments,
either literal bytes, the data of one logical tensor (cast to a dtype), or bytes that depend on
checksums of earlier segments (zip descriptors and directories). The executor streams it;
`--dry-run` prints it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import TensorEntry


@dataclass(frozen=True, slots=True)  # slots: a wide DCP write plans a few of these for each of 200,000 chunks
class Literal:
    data: bytes | memoryview  # a memoryview: a part of a large pickle, not copied (core/pickles/pickler.py dump_parts)

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


@dataclass(frozen=True, slots=True)
class FileSizes:
    total: int  # every byte of the file
    data: int  # tensor data alone
    largest: int  # the largest tensor's data


def sizes_of(segments: list[Segment]) -> FileSizes:
    data = [s.size for s in segments if isinstance(s, TensorData)]
    return FileSizes(sum(s.size for s in segments), sum(data), max(data, default=0))


class SharedBuild(functools.partial):
    """An OutputFile.build that gives several files the very same segments (ZeRO-3 model-states files of 2,000
    placeholders, one list per old rank): the executor walks such a list once for its records, names and sizes."""


@dataclass
class OutputFile:
    """One output file: its `segments`, or a `build` that makes them each time they are needed, so that a wide write
    holds one file's segments at a time, not every file's (`sizes` then says what the file holds, `reads` which
    files its data is read from: what --overwrite must never replace)."""

    relpath: str  # relative to the destination ("" when the destination is itself the file)
    segments: list[Segment] = field(default_factory=list)
    commit_marker: bool = False  # written after every other file (DCP .metadata, an index)
    build: Callable[[], list[Segment]] | None = None
    sizes: FileSizes | None = None  # given with `build` when known without building (else measured once)
    reads: Sequence[str] = ()  # with `build`: the files its tensor data is read from
    names: Sequence[str] | None = None  # with `build`: its tensors' names, once known
    # Literal bytes made as they are written, in order, and let go (a wide DCP `.metadata`: 100 MB held whole else);
    # its size is known once written (or measured by making them, then dropping them)
    stream: Callable[[], Iterable[bytes | memoryview]] | None = None
    # A file a library writes itself, with its data files beside it (Orbax's OCDBT manifest and d/ through tensorstore):
    # `fill(target, progress, sources)` writes the tensors of its `segments` (TensorData alone, which size it and name
    # what it reads); local destinations only
    fill: Callable[[Path, Callable[[int], None], Any], None] | None = None

    def parts(self) -> list[Segment]:
        """The file's segments (made now for a built file: hold them only while writing it)."""
        if self.stream is not None:
            raise TypeError(f"{self.relpath}: a streamed file has no segments; its bytes come from `stream`")
        return self.segments if self.build is None else self.build()

    def measured(self) -> FileSizes:
        if self.stream is not None and self.sizes is None:
            self.sizes = FileSizes(sum(len(part) for part in self.stream()), 0, 0)
        if self.build is None and self.stream is None:
            return sizes_of(self.segments)
        if self.sizes is None:
            self.sizes = sizes_of(self.parts())
        return self.sizes

    @property
    def size(self) -> int:
        return self.measured().total

    def tensors(self) -> Iterable[TensorEntry]:
        """The tensors the file's segments hold (none listed for a built file: see `reads`)."""
        return (s.tensor for s in self.segments if isinstance(s, TensorData))

    def tensor_names(self) -> Sequence[str]:
        if self.stream is not None:
            return []
        if self.build is None:
            return [s.tensor.name for s in self.segments if isinstance(s, TensorData)]
        if self.names is None:
            told = getattr(self.build, "tensor_names", None)  # a builder that knows them without making the segments
            self.names = told() if told is not None else [s.tensor.name for s in self.build() if isinstance(s, TensorData)]
        return self.names


@dataclass
class WritePlan:
    """Everything one writing command will do. `dest_is_dir`: the destination is a folder."""

    format: str
    dest: Path
    dest_is_dir: bool
    files: list[OutputFile]
    notes: list[str] = field(default_factory=list)  # what was dropped, tied, cast: told to the user
    # The most files worth writing at once by default (None: as many as the workers): 1 where making a file is Python
    # arithmetic under the GIL (a ZeRO-3 flat of thousands of slivers), which a second thread slows and grows.
    threads: int | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def data_bytes(self) -> int:
        return sum(f.measured().data for f in self.files)

    def largest_tensor_bytes(self) -> int:
        return max((f.measured().largest for f in self.files), default=0)
