"""An Orbax save's arrays, read through tensorstore (imported when first needed; never jax): the zarr (v2) or zarr3
driver over the item's OCDBT database (`ocdbt` kvstore, the item folder its base) or over one folder per array
(`file` kvstore). An array streams in windows of whole chunk rows (`OrbaxArray`, a TensorEntry's `derived`): a read
decodes the chunks its window covers, never the whole array unless one chunk row is the whole array."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from ckpt_cli import store
from ckpt_cli.core import heap
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.reading import BLOCK_BYTES
from ckpt_cli.errors import DataError, UsageError


class Stream(Protocol):
    """An array's chunks decoded as streams (formats/orbax/stream.ChunkStream): bytes [start, start + nbytes), or None
    when a chunk they lie in is not one (read through tensorstore then)."""

    def read(self, start: int, nbytes: int) -> Any: ...


INSTALL_HINT = "the orbax extra: pip install 'ckpt-tools[orbax]'"
CACHE_BYTES = 64 << 20  # tensorstore's cache of decoded chunks and OCDBT B-tree nodes, one per process
DECODE_BUDGET = 64 << 20  # bytes of chunks decoded at once, all threads together (a larger chunk goes alone)


def tensorstore() -> Any:
    try:
        import tensorstore as ts
    except ImportError:
        raise UsageError(f"reading an Orbax save needs tensorstore: {INSTALL_HINT}") from None
    return ts


@functools.cache
def context() -> Any:
    ts = tensorstore()
    heap.map_large_blocks()  # decoded chunks freed by tensorstore's threads go back to the system, not to its arenas
    # Decoded chunks (`cache_pool#chunks`) apart from B-tree nodes (`cache_pool`): a read of part of a chunk decodes all
    # of it, and a DCP write reads each rank's box of a chunk BLOCK_BYTES at a time; without the cache it decoded the
    # chunk once per window (1 GB to DCP at 2 ranks: 45-65 s against 10-15 s). A read of whole chunks keeps none
    # (`cache_pool#none`): the chunk is the window, and kept it would only add to the resident size.
    return ts.Context(
        {
            "cache_pool": {"total_bytes_limit": CACHE_BYTES},
            "cache_pool#chunks": {"total_bytes_limit": CACHE_BYTES},
            "cache_pool#none": {"total_bytes_limit": 0},
            "file_io_concurrency": {"limit": 32},
        }
    )


def kvstore_spec(item: Path, name: str | None, use_ocdbt: bool) -> dict[str, Any]:
    """The key-value store holding an array (`name`) or, with no name, the whole item."""
    if use_ocdbt:
        spec: dict[str, Any] = {"driver": "ocdbt", "base": folder_spec(item, "")}
        if name is not None:
            spec["path"] = name + "/"
        return spec
    return folder_spec(item, name + "/" if name is not None else "")


def folder_spec(item: Path, below: str) -> dict[str, Any]:
    """tensorstore's kvstore for a folder (the store's answer: `file` locally, `s3` pointed where ckpt's own S3 reads
    go), `below` added to its path."""
    spec = store.tensorstore_kvstore(item)
    if spec is None:
        raise UsageError(f"{item}: ckpt reads Orbax saves from local folders and s3:// (tensorstore's own drivers)")
    return {**spec, "path": spec["path"] + below}


def array_spec(item: Path, name: str, use_ocdbt: bool, zarr3: bool) -> dict[str, Any]:
    return {
        "driver": "zarr3" if zarr3 else "zarr",
        "kvstore": kvstore_spec(item, name, use_ocdbt),
        "open": True,
        "cache_pool": "cache_pool#chunks",
    }


def what_failed(exc: Exception) -> str:
    """tensorstore's message, on one line and short (it names the key or file it could not read)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def read_keys(item: Path, keys: list[str], use_ocdbt: bool) -> dict[str, bytes | None]:
    """The values of `keys` in the item's store (None: absent), read concurrently."""
    ts = tensorstore()
    try:
        kv = ts.KvStore.open(kvstore_spec(item, None, use_ocdbt), context=context()).result()
        futures = [(key, kv.read(key)) for key in keys]
        out: dict[str, bytes | None] = {}
        for key, future in futures:
            result = future.result()
            out[key] = bytes(result.value) if result.state == "value" else None
        return out
    except (ValueError, RuntimeError, OSError) as exc:
        raise DataError(f"{item}: cannot read its {'OCDBT database' if use_ocdbt else 'arrays'}: {what_failed(exc)}") from exc


def list_keys(item: Path, use_ocdbt: bool) -> list[str]:
    ts = tensorstore()
    kv = ts.KvStore.open(kvstore_spec(item, None, use_ocdbt), context=context()).result()
    return [k.decode("utf-8", "replace") for k in kv.list().result()]


class _DecodeBudget:
    """Bytes of chunks being decoded at once, across the writing threads. tensorstore decodes a whole chunk for any read
    of it and holds its compressed bytes and the decoded chunk together. A read waits while others decode more than
    the budget; one read alone always goes (a chunk above the budget is decoded alone)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.used, self.cond = budget, 0, threading.Condition()

    @contextlib.contextmanager
    def take(self, nbytes: int) -> Iterator[None]:
        if not nbytes:
            yield
            return
        nbytes = min(nbytes, self.budget)
        with self.cond:
            self.cond.wait_for(lambda: self.used + nbytes <= self.budget or self.used == 0)
            self.used += nbytes
        try:
            yield
        finally:
            with self.cond:
                self.used -= nbytes
                self.cond.notify_all()


DECODING = _DecodeBudget(DECODE_BUDGET)


@functools.lru_cache(maxsize=16)  # a write reads an array window by window: opened once, a few kept
def _open(spec_json: str) -> Any:
    ts = tensorstore()
    return ts.open(json.loads(spec_json), read=True, context=context()).result()


class OrbaxArray:
    """How a tensor of an Orbax save is read (core/model.Derived): element windows of whole chunk rows, each read as
    the few boxes of the array that hold it, decoded by tensorstore."""

    __slots__ = ("spec", "uncached", "shape", "dtype", "chunks", "where", "name", "stream")

    def __init__(
        self,
        spec: dict[str, Any],
        shape: tuple[int, ...],
        dtype: DType,
        chunks: tuple[int, ...],
        where: str,
        name: str,
        stream: Stream | None = None,
    ) -> None:
        self.spec = json.dumps(spec, sort_keys=True)
        self.uncached = json.dumps({**spec, "cache_pool": "cache_pool#none"}, sort_keys=True)  # reads of whole chunks
        self.shape, self.dtype, self.chunks, self.where, self.name = shape, dtype, chunks, where, name
        self.stream = stream  # chunks decoded as zstd streams, a window at a time (formats/orbax/stream.py)

    def windows(self) -> Iterator[tuple[int, int]]:
        numel = math.prod(self.shape)
        if not self.shape:
            yield 0, numel
            return
        inner = math.prod(self.shape[1:])
        if self.stream is not None:  # bands of BLOCK_BYTES of rows, never across two chunks
            band = max(BLOCK_BYTES // max(inner * self.dtype.itemsize, 1), 1)
            for first in range(0, self.shape[0], self.chunks[0]):
                last = min(first + self.chunks[0], self.shape[0])
                for row in range(first, last, band):
                    yield row * inner, (min(row + band, last) - row) * inner
            return
        band = max(self.chunks[0], 1) * inner  # one row of chunks
        per = max(band * max(BLOCK_BYTES // max(band * self.dtype.itemsize, 1), 1), 1)
        if band == 0:
            return
        for start in range(0, numel, per):
            yield start, min(per, numel - start)

    def whole_chunks(self, start: int, count: int) -> bool:
        """Whether elements [start, start + count) are whole rows of chunks (nothing of a chunk left for a next read)."""
        band = max(self.chunks[0], 1) * math.prod(self.shape[1:]) if self.shape and self.chunks else 1
        return start % band == 0 and (count % band == 0 or start + count == math.prod(self.shape))

    def decoded_bytes(self, count: int) -> int:
        """About what a read of `count` elements decodes: the chunks it covers, at least one."""
        return max(count, math.prod(self.chunks) if self.chunks else 1) * self.dtype.itemsize

    def read_raw(self, start: int, count: int, sources: Any = None) -> Any:
        """Elements [start, start + count) as their bytes (a flat numpy uint8 array): no torch, so a write that copies
        them (to safetensors, to DCP) never imports it."""
        import numpy as np

        if count == 0:
            return np.empty(0, np.uint8)
        if self.stream is not None:
            size = self.dtype.itemsize
            raw = self.stream.read(start * size, count * size)
            if raw is not None:
                return raw
        try:
            whole = self.whole_chunks(start, count)
            store = _open(self.uncached if whole else self.spec)
            # Only reads of whole chunks wait their turn: they decode for certain, where a part of a chunk is mostly
            # the cache's (a DCP rank's box read BLOCK_BYTES at a time: queued, 1 GB at 2 ranks took 31 s, not 15)
            with DECODING.take(self.decoded_bytes(count) if whole else 0):
                parts = [np.ascontiguousarray(p).reshape(-1) for p in _flat_range(store, self.shape, start, count)]
        except (ValueError, RuntimeError, OSError) as exc:
            raise DataError(f"{self.where}: array '{self.name}' cannot be read: {what_failed(exc)}") from exc
        flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
        heap.give_back_when_grown()  # tensorstore's threads free decoded chunks into malloc arenas of their own
        if flat.size != count:
            raise DataError(f"{self.where}: array '{self.name}' gave {flat.size} elements for a read of {count}")
        return flat.view(np.uint8)  # tensorstore's own buffer (or the concatenation's), not copied again

    def read(self, start: int, count: int, sources: Any = None) -> Any:
        import torch

        raw = self.read_raw(start, count, sources)
        return torch.from_numpy(raw if raw.flags.writeable else raw.copy()).view(self.dtype.torch())

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The box [offsets, offsets + sizes) of the array, flat (row-major), as a tensor (a transpose's columns)."""
        import numpy as np
        import torch

        try:
            store = _open(self.spec)
            box = store[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].read().result()
        except (ValueError, RuntimeError, OSError) as exc:
            raise DataError(f"{self.where}: array '{self.name}' cannot be read: {what_failed(exc)}") from exc
        raw = np.ascontiguousarray(box).reshape(-1).view(np.uint8)
        return torch.from_numpy(raw if raw.flags.writeable else raw.copy()).view(self.dtype.torch())


def _flat_range(store: Any, shape: tuple[int, ...], start: int, count: int) -> list[Any]:
    """Elements [start, start + count) of `store` (row-major) as a few boxes read whole: partial rows at either end
    (read dimension by dimension), the whole rows between them at once."""
    if len(shape) <= 1:
        return [store[start : start + count].read().result()] if shape else [store.read().result()]
    inner = math.prod(shape[1:])
    first = start // inner
    out: list[Any] = []
    pos, stop = start, start + count
    if pos % inner:  # a partial first row
        row_end = min((first + 1) * inner, stop)
        out += _flat_range(store[first], shape[1:], pos - first * inner, row_end - pos)
        pos = row_end
    whole = (stop - pos) // inner
    if whole:
        row = pos // inner
        out.append(store[row : row + whole].read().result())
        pos += whole * inner
    if pos < stop:
        row = pos // inner
        out += _flat_range(store[row], shape[1:], 0, stop - pos)
    return out
