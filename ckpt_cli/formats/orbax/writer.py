"""Writer of Orbax saves (`--to orbax`): one item folder as `StandardCheckpointer().save(DST, tree)` makes it, which
Orbax's PyTreeCheckpointer and StandardCheckpointer restore (with no target: numpy arrays; with an abstract target:
jax arrays on its shardings). The facts and their sources in orbax-checkpoint are in docs/formats.md §14.8.

    DST/_CHECKPOINT_METADATA   the checkpointer's record (item handler, timestamps)
    DST/manifest.ocdbt, d/     one OCDBT database holding every array as zarr v2 (Orbax's defaults) or zarr3
                               (`--orbax-storage ocdbt-zarr3`, MaxText's), written through tensorstore a window of
                               whole chunk rows at a time, committed in batches
    DST/<leaf>/zarr.json, c/   with OCDBT off (`--orbax-storage zarr3`): one zarr3 folder per array
    DST/_METADATA              the tree: each leaf's keys and value type (written after the arrays, as Orbax does)
    DST/commit_success.txt     the commit marker, last

The tree comes from the tensors' key paths: a training state laid out by formats/orbax/training.py (optax adamw's
`opt_state` tuple: int keys are sequence indices), else each name split at its dots (`model.layers.0.w` ->
{"model": {"layers": {"0": {"w": ...}}}}). Leaves are host arrays (`np.ndarray`): ckpt has no devices, and a numpy
leaf needs no `_sharding` (a restore onto a mesh gives its target's shardings).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli import store
from ckpt_cli.core import heap
from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Checkpoint, PathKey, TensorEntry
from ckpt_cli.core.reading import window_bytes
from ckpt_cli.core.write import distributed
from ckpt_cli.core.write.plan import Literal, OutputFile, TensorData, WritePlan
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.orbax import arrays, layout
from ckpt_cli.formats.orbax.reader import Source

CHUNK_BYTES = 16 << 20  # the most bytes of one zarr chunk (rows of the array): one read window, one compressed chunk
BATCH_BYTES = 16 << 20  # writes held by one tensorstore transaction before it commits (one OCDBT version each)
OCDBT_CONFIG = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000, "compression": {"id": "zstd"}}
HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
SEQUENCE, DICT = 1, 2  # tree_metadata key_type (orbax metadata/tree.py KeyType)
TS_DTYPES = (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip


@dataclass(frozen=True)
class Leaf:
    keys: tuple[str | int, ...]  # an int: a sequence index
    tensor: TensorEntry | None  # None: an empty node (optax's EmptyState), recorded as a None leaf

    @property
    def name(self) -> str:
        return ".".join(map(str, self.keys))


def keys_of(path: PathKey) -> tuple[str | int, ...]:
    """A key path as Orbax's tree keys: an int stays a sequence index, a string splits at its dots."""
    out: list[str | int] = []
    for part in path:
        out += [part] if isinstance(part, int) else [k for k in str(part).split(".")]
    if not out or any(k == "" for k in out):
        raise UsageError(f"'{'.'.join(map(str, path))}': an empty key, which an Orbax tree cannot hold")
    return tuple(out)


def source_keys(ckpt: Checkpoint) -> tuple[dict[str, tuple[str | int, ...]], set[str]]:
    """An Orbax source's leaves by name, with their sequence indices as ints (a tuple stays a tuple on the way), and
    the names of its empty nodes (optax's EmptyState)."""
    if ckpt.format != "orbax" or not isinstance(ckpt.source, Source):
        return {}, set()
    out: dict[str, tuple[str | int, ...]] = {}
    empty = set()
    for item in ckpt.source.items:
        top: tuple[str | int, ...] = tuple(item.prefix.rstrip(".").split(".")) if item.prefix else ()
        for leaf in item.tree.leaves:
            keys = tuple(int(k) if seq else k for k, seq in zip(leaf.keys, leaf.indices or [False] * len(leaf.keys)))
            out[item.prefix + leaf.name] = top + keys
            if leaf.value_type == "None":
                empty.add(item.prefix + leaf.name)
    return out, empty


def leaves_of(ckpt: Checkpoint) -> tuple[list[Leaf], list[str]]:
    """The tree's leaves in name order, and the values left out (an Orbax tree of arrays has no place for them)."""
    known, empty = source_keys(ckpt)
    leaves = [Leaf(known.get(t.name) or keys_of(t.path if len(t.path) > 1 else (t.name,)), t) for t in ckpt.tensors.values()]
    dropped = []
    for obj in ckpt.objects.values():
        if obj.value is None:
            leaves.append(Leaf(keys_of(obj.path or (obj.name,)), None))
        else:
            dropped.append(obj.name)
    parents = {tuple(map(str, leaf.keys[:n])) for leaf in leaves for n in range(len(leaf.keys))}
    for name in sorted(empty):  # the source's empty nodes, kept beside the leaves written (opt_state.1 beside opt_state.0)
        if tuple(map(str, known[name][:-1])) in parents:
            leaves.append(Leaf(known[name], None))
    leaves.sort(key=lambda leaf: leaf.name)
    seen: dict[tuple[str, ...], str] = {}
    kinds: dict[tuple[str, ...], set[bool]] = {}  # a node's keys: sequence indices (True) or dict keys (False)
    for leaf in leaves:
        keys = tuple(map(str, leaf.keys))
        for n in range(1, len(keys) + 1):
            other = seen.get(keys[:n])
            if other is not None:
                raise UsageError(f"'{other}' and '{leaf.name}' cannot both be leaves of an Orbax tree (one is, or is inside, the other)")
            kinds.setdefault(keys[: n - 1], set()).add(isinstance(leaf.keys[n - 1], int))
        seen[keys] = leaf.name
    mixed = next((node for node, found in kinds.items() if len(found) > 1), None)
    if mixed is not None:
        raise UsageError(f"'{'.'.join(mixed)}' holds sequence indices and dict keys both: not one node of an Orbax tree")
    return leaves, dropped


def chunk_rows(tensor: TensorEntry) -> int:
    """Rows of a chunk: whole rows up to CHUNK_BYTES (at least one)."""
    if not tensor.shape:
        return 1
    row = math.prod(tensor.shape[1:]) * tensor.dtype.itemsize
    return max(1, min(tensor.shape[0], CHUNK_BYTES // max(row, 1)))


def zarr_metadata(tensor: TensorEntry, chunks: list[int], zarr3: bool) -> dict[str, Any]:
    """An array's zarr metadata as Orbax builds it (serialization/tensorstore_utils.py `_build_zarr2_metadata`,
    `_build_zarr3_metadata`): zstd level 1 for zarr v2; for zarr3, one `sharding_indexed` chunk per shard with
    little-endian bytes, zstd level 3, and a CRC32C of the shard index, at its end."""
    if not zarr3:
        return {"shape": list(tensor.shape), "chunks": chunks, "compressor": {"id": "zstd", "level": 1}}
    sharding = {
        "chunk_shape": chunks,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 3}}],
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "index_location": "end",
    }
    return {
        "shape": list(tensor.shape),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "codecs": [{"name": "sharding_indexed", "configuration": sharding}],
    }


def tree_metadata(leaves: list[Leaf], use_ocdbt: bool = True, use_zarr3: bool = False) -> bytes:
    """`_METADATA` as Orbax's PyTree handlers write it (orbax metadata/tree.py InternalTreeMetadata.to_json)."""
    tree = {}
    for leaf in leaves:
        key = str(tuple(str(k) for k in leaf.keys))
        keys = [{"key": str(k), "key_type": SEQUENCE if isinstance(k, int) else DICT} for k in leaf.keys]
        value = (
            {"value_type": "np.ndarray", "skip_deserialize": False}
            if leaf.tensor is not None
            else {"value_type": "None", "skip_deserialize": True}
        )
        tree[key] = {"key_metadata": keys, "value_metadata": value}
    doc = {
        "tree_metadata": tree,
        "use_ocdbt": use_ocdbt,
        "use_zarr3": use_zarr3,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    return json.dumps(doc).encode()


def checkpoint_metadata() -> bytes:
    now = time.time_ns()
    doc = {
        "item_handlers": HANDLER,
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": now,
        "commit_timestamp_nsecs": now,
        "custom_metadata": {},
    }
    return json.dumps(doc).encode()


def fill(leaves: list[Leaf], use_ocdbt: bool, zarr3: bool) -> Callable[[Path, Callable[[int], None], Any], None]:
    """Writes the arrays, chunk row by chunk row, through tensorstore: into the OCDBT database at the target's folder
    (in transactions of BATCH_BYTES), or with OCDBT off each array into its own folder (`leaves` is then that one)."""

    def write(target: Path, progress: Callable[[int], None], sources: Any) -> None:
        ts = arrays.tensorstore()
        heap.map_large_blocks()  # windows and chunks freed by tensorstore's threads go back to the system
        folder = str(target.parent.resolve()) + "/"
        if use_ocdbt:
            base: dict[str, Any] = {"driver": "ocdbt", "base": {"driver": "file", "path": folder}, "config": OCDBT_CONFIG}
        txn, pending = (ts.Transaction() if use_ocdbt else None), 0  # files without OCDBT: written in place, in a staged folder
        context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})  # chunks written once: nothing worth keeping
        try:
            for leaf in leaves:
                tensor = leaf.tensor
                if tensor is None:
                    continue
                rows, dtype = chunk_rows(tensor), ts.dtype(tensor.dtype.name)
                chunks = [rows, *(max(n, 1) for n in tensor.shape[1:])] if tensor.shape else []
                kvstore = {**base, "path": leaf.name + "/"} if use_ocdbt else {"driver": "file", "path": folder}
                spec = {
                    "driver": "zarr3" if zarr3 else "zarr",
                    "kvstore": kvstore,
                    "dtype": tensor.dtype.name,
                    "metadata": zarr_metadata(tensor, chunks, zarr3),
                    "create": True,
                }
                array = ts.open(spec, context=context, transaction=txn).result()
                inner = math.prod(tensor.shape[1:]) if tensor.shape else 1
                for start in range(0, tensor.shape[0], rows) if tensor.shape else [0]:
                    stop = min(start + rows, tensor.shape[0]) if tensor.shape else 1
                    count = (stop - start) * inner
                    if count == 0:
                        continue
                    raw = window_bytes(tensor, tensor.dtype, start * inner, count, sources).view(dtype.numpy_dtype)
                    shape = (stop - start, *tensor.shape[1:]) if tensor.shape else ()
                    (array[start:stop] if tensor.shape else array).write(raw.reshape(shape)).result()
                    pending += raw.nbytes
                    progress(raw.nbytes)
                    if txn is not None and pending >= BATCH_BYTES:  # committed: the next writes go into a new transaction
                        txn.commit_async().result()
                        txn, pending = ts.Transaction(), 0
                        array = array.with_transaction(txn)
                        heap.give_back_when_grown()  # what tensorstore's threads freed in their own malloc arenas
            if txn is not None:
                txn.commit_async().result()
        except (ValueError, RuntimeError, OSError) as exc:
            raise DataError(f"{target.parent}: tensorstore could not write the Orbax arrays: {arrays.what_failed(exc)}") from exc

    return write


class OrbaxWriter:
    name = "orbax"
    dest_is_dir = True

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        if not store.renames(dest):
            raise UsageError(f"{dest}: ckpt writes Orbax saves to a local folder (tensorstore writes its files there)")
        if distributed.rank_and_world() is not None:
            raise UsageError("ckpt writes an Orbax save from one process (one OCDBT database): run it without torchrun")
        leaves, dropped = leaves_of(ckpt)
        for leaf in leaves:
            if leaf.tensor is not None and leaf.tensor.dtype.name not in TS_DTYPES:
                raise UsageError(f"'{leaf.name}' is {leaf.tensor.dtype.name}, which an Orbax (zarr) array does not hold")
        if not leaves:
            raise UsageError("nothing to write: an Orbax save holds arrays, and the source has none")
        arrays_out = [leaf for leaf in leaves if leaf.tensor is not None]
        storage = options.orbax_storage or "ocdbt"
        use_ocdbt, zarr3 = storage.startswith("ocdbt"), storage.endswith("zarr3")
        if use_ocdbt:  # one database: one file the library fills with every array
            data = [
                OutputFile(
                    "manifest.ocdbt",
                    [TensorData(leaf.tensor, leaf.tensor.dtype) for leaf in arrays_out if leaf.tensor],
                    fill=fill(leaves, True, zarr3),
                )
            ]
        else:  # a folder per array, its zarr.json written by the library with its chunks
            data = [
                OutputFile(f"{leaf.name}/zarr.json", [TensorData(leaf.tensor, leaf.tensor.dtype)], fill=fill([leaf], False, True))
                for leaf in arrays_out
                if leaf.tensor is not None
            ]
        files = [
            OutputFile(layout.STEP_METADATA, [Literal(checkpoint_metadata())]),
            *data,
            OutputFile(layout.TREE_METADATA, [Literal(tree_metadata(leaves, use_ocdbt, zarr3))], commit_marker=True),
            OutputFile(layout.COMMIT, [Literal(f"Checkpoint commit was successful to {dest}".encode())], commit_marker=True),
        ]
        kind = {"ocdbt": "OCDBT + zarr v2 (Orbax's defaults)", "ocdbt-zarr3": "OCDBT + zarr3", "zarr3": "zarr3, a folder per array"}[
            storage
        ]
        notes = [f"Orbax: one item, {kind}, {len(arrays_out)} arrays as numpy leaves"]
        if dropped:
            more = ", ..." if len(dropped) > 8 else ""
            notes.append(f"not written (an Orbax tree of arrays has no place for them): {', '.join(dropped[:8])}{more}")
        return WritePlan("orbax", dest, True, files, notes, threads=1)


WRITER = OrbaxWriter()
