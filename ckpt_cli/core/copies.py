"""A flat tensor made of copies from source byte ranges, planned with numpy over all its parts at once.

A resharded ZeRO-3 rank's flat partition holds ceil(n/W) elements of each of thousands of parameters; at 1,024 ranks
most are one element. Made part by part (a piece, its runs, a byte run, a read, a CRC: some 20 Python calls each),
a 2 -> 1,024 reshard of 2,000 parameters spent 97 s in that arithmetic. Here a flat's parts are arrays (where each
starts in the flat, which tensor, where in it, how many elements), resolved against one table of where every source
tensor's runs lie (SourceTable: built once per list of tensors, shared by every rank's flat), coalesced where
adjacent in both the flat and the source, and copied as one numpy gather per source file (`gather`). Windows whose
copies are large (a 70B model's parameters at 64 ranks) are copied run by run as before (`byte_runs`).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import ZEROS, FlatLayout, FlatPart, StoredArray, TensorEntry
from ckpt_cli.errors import DataError

GATHER_BYTES = 4096  # mean copy size under which a window is gathered by numpy, not copied run by run
TABLE_ROWS = 1 << 22  # source runs above which a list of tensors is not tabled (a 1,024-rank source of 20,000 params)
Parts = tuple[Any, Any, Any, Any]  # numpy arrays: start in the flat, tensor index, start in the tensor, element count


class SourceTable:
    """Where the elements of `entries` lie, as sorted arrays of runs: each run's start in the entries laid end to end
    (`bases[i]`: where entry i starts), its length, its file (an index into `paths`) and the byte of its first element."""

    __slots__ = ("bases", "starts", "lengths", "files", "bytes", "paths", "arrays", "itemsize")

    def __init__(self, bases: Any, rows: Any, paths: list[str], arrays: list[StoredArray], itemsize: int) -> None:
        import numpy as np

        self.bases, self.paths, self.arrays, self.itemsize = bases, paths, arrays, itemsize
        order = np.argsort(rows[:, 0], kind="stable")
        self.starts, self.lengths, self.files, self.bytes = (rows[order, k] for k in range(4))

    @classmethod
    def of(cls, entries: Sequence[TensorEntry], dtype: DType) -> SourceTable | None:
        """The table of `entries`' runs; None when one is not plain stored bytes of `dtype` (a cast, a strided or
        computed tensor: its flat is made piece by piece) or they hold more than TABLE_ROWS runs."""
        import numpy as np

        rows: list[tuple[int, int, int, int]] = []
        bases, base = [], 0
        files: dict[str, int] = {}
        arrays: dict[int, StoredArray] = {}
        for entry in entries:
            if entry.derived is not None:
                return None
            bases.append(base)
            for start, length, piece, local in entry.runs():
                array = piece.data
                if array.dtype != dtype or not array.is_contiguous:
                    return None
                if array.path != ZEROS:  # zeros are no copy: the gather's buffer starts zeroed
                    arrays.setdefault(id(array), array)
                    at = array.offset + (array.storage_offset + local) * dtype.itemsize
                    rows.append((base + start, length, files.setdefault(array.path, len(files)), at))
                if len(rows) > TABLE_ROWS:
                    return None
            base += entry.numel
        table = np.array(rows, dtype=np.int64).reshape(-1, 4)
        return cls(np.array(bases, dtype=np.int64), table, list(files), list(arrays.values()), dtype.itemsize)


@dataclass
class Copies:
    """A window of `size` bytes: `nbytes[i]` bytes from byte `src[i]` of `paths[files[i]]` to byte `dst[i]`, zeros
    elsewhere; `arrays`: the stored arrays read (their zip records are checked)."""

    size: int
    paths: list[str]
    files: Any
    src: Any
    dst: Any
    nbytes: Any
    arrays: list[StoredArray]

    def byte_runs(self) -> list[tuple[str, int, int]]:
        """The window as ByteRuns in order, zeros in the gaps (for core/write/sinks.copy_runs)."""
        out, pos = [], 0
        for f, src, dst, n in zip(self.files.tolist(), self.src.tolist(), self.dst.tolist(), self.nbytes.tolist()):
            if dst > pos:
                out.append((ZEROS, 0, dst - pos))
            out.append((self.paths[f], src, n))
            pos = dst + n
        if pos < self.size:
            out.append((ZEROS, 0, self.size - pos))
        return out

    def gathered(self) -> bool:
        """Whether the copies are small enough that one numpy gather beats copying them one by one."""
        return len(self.nbytes) > 1 and int(self.nbytes.sum()) < GATHER_BYTES * len(self.nbytes)


def resolve(table: SourceTable, parts: Parts) -> tuple[Any, Any, Any, Any] | None:
    """The byte copies of `parts` (sorted by their start in the flat, disjoint): (file, source byte, flat byte, bytes),
    adjacent copies joined; None when the table does not cover a part (the piece by piece path says why)."""
    import numpy as np

    at, which, start, count = parts
    lo = table.bases[which] + start
    hi = lo + count
    first = np.searchsorted(table.starts, lo, side="right") - 1
    last = np.searchsorted(table.starts, hi - 1, side="right") - 1
    if len(first) and first.min() < 0:
        return None
    spans = last - first + 1
    part = np.repeat(np.arange(len(at)), spans)
    run = first[part] + np.arange(len(part)) - np.repeat(np.cumsum(spans) - spans, spans)
    run_lo, run_hi = table.starts[run], table.starts[run] + table.lengths[run]
    c_lo, c_hi = np.maximum(run_lo, lo[part]), np.minimum(run_hi, hi[part])
    if len(part) and ((c_hi <= c_lo).any() or int((c_hi - c_lo).sum()) != int(count.sum())):
        return None  # a gap or an overlap in the source's runs
    size = table.itemsize
    files = table.files[run]
    src = table.bytes[run] + (c_lo - run_lo) * size
    dst = (at[part] + c_lo - lo[part]) * size
    nbytes = (c_hi - c_lo) * size
    if len(dst) > 1:  # join a copy to the one before when both its ends continue it
        joined = (dst[1:] == dst[:-1] + nbytes[:-1]) & (src[1:] == src[:-1] + nbytes[:-1]) & (files[1:] == files[:-1])
        heads = np.flatnonzero(np.concatenate(([True], ~joined)))
        files, src, dst, nbytes = files[heads], src[heads], dst[heads], np.add.reduceat(nbytes, heads)
    return files, src, dst, nbytes


class PlannedFlat(FlatLayout):
    """A FlatLayout that also tells its window's bytes as Copies, planned from `table()` and `plan()` (the parts as
    arrays). The parts as FlatParts (`parts`) stay the way the window is made where the table cannot serve."""

    __slots__ = ("table", "plan", "_resolved")

    def __init__(
        self,
        dtype: DType,
        length: int,
        parts: Sequence[FlatPart],
        starts: Sequence[int],
        table: Callable[[], SourceTable | None],
        plan: Callable[[], Parts],
    ) -> None:
        super().__init__(dtype, length, parts, starts)
        self.table, self.plan = table, plan
        self._resolved: tuple[Any, ...] | None = None

    def copies(self, start: int, count: int) -> Copies | None:
        """Elements [start, start + count) as byte copies; None where the piece by piece path must make them."""
        import numpy as np

        table = self.table()
        if table is None:
            return None
        if self._resolved is None:  # the whole flat once (a ZeRO-3 rank's flat is a few windows at most)
            found = resolve(table, self.plan())
            if found is None:
                return None
            self._resolved = found
        files, src, dst, nbytes = self._resolved
        size = table.itemsize
        lo, hi = start * size, (start + count) * size
        i, j = np.searchsorted(dst + nbytes, lo, side="right"), np.searchsorted(dst, hi, side="left")
        files, src, dst, nbytes = files[i:j], src[i:j].copy(), dst[i:j] - lo, nbytes[i:j].copy()
        if len(dst):
            cut = max(0, -int(dst[0]))  # the first copy begins before the window
            src[0] += cut
            nbytes[0] -= cut
            dst[0] += cut
            nbytes[-1] = min(int(nbytes[-1]), hi - lo - int(dst[-1]))
        if hi - lo >= self.length * size:
            self._resolved = None  # the whole flat in one window: nothing to keep for the next
        return Copies(hi - lo, table.paths, files, src, dst, nbytes, table.arrays)

    def arrays(self) -> list[StoredArray]:
        table = self.table()
        return [self.zero, *table.arrays] if table is not None else super().arrays()


def gather(copies: Copies, mapped: Callable[[str], Any]) -> Any:
    """The window's bytes (a numpy uint8 array): each source file's copies gathered at once from `mapped(path)` (its
    bytes as a numpy uint8 array over a memory map)."""
    import numpy as np

    out = np.zeros(copies.size, dtype=np.uint8)
    several = len(copies.paths) > 1
    for f, path in enumerate(copies.paths):
        pick = copies.files == f if several else slice(None)
        src, dst, nbytes = copies.src[pick], copies.dst[pick], copies.nbytes[pick]
        if not len(src):
            continue
        data = mapped(path)
        if int((src + nbytes).max()) > len(data):
            raise DataError(f"{path}: truncated: data needs bytes up to {int((src + nbytes).max())}, file has {len(data)}")
        within = np.arange(int(nbytes.sum())) - np.repeat(np.cumsum(nbytes) - nbytes, nbytes)
        out[np.repeat(dst, nbytes) + within] = data[np.repeat(src, nbytes) + within]
    return out


def map_file(fd: int) -> tuple[mmap.mmap | None, Any]:
    """A read-only memory map of the file and its bytes as a numpy uint8 array (empty, no map, for an empty file)."""
    import numpy as np

    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file
        return None, np.zeros(0, dtype=np.uint8)
    return mm, np.frombuffer(mm, dtype=np.uint8)
