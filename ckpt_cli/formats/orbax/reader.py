"""Reader of Orbax saves (read only): a step folder of a CheckpointManager (its items), or one item folder.

Names: a leaf's pytree path joined with '.', as Orbax names its array (`params.decoder.layers_0.attn.wq`,
`opt_state.0.mu.decoder...`); a step of several items, or of one item not called `default` or `state`, puts the
item's name first. Roles: the `params` subtree (or a tree without params/opt_state: the weights themselves) is the
model; optax's Adam/AdamW state (`mu`, `nu`, `count` under `opt_state`) is optimizer state. Orbax stores no checksums.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli import store
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint, FileInfo, FlatRange, LazyPieces, Piece, StoredArray, TensorEntry
from ckpt_cli.errors import DataError
from ckpt_cli.formats.orbax import arrays, layout, ocdbt, stream
from ckpt_cli.formats.orbax import metadata as meta

UNPREFIXED_ITEMS = ("default", "state")  # a step's only item of this name gives its leaves their own names
OPTAX_ADAM = {"mu", "nu", "count"}  # optax ScaleByAdamState's fields


@dataclass(frozen=True)
class Item:
    folder: Path
    prefix: str  # "" or "<item>."
    tree: meta.TreeMetadata
    infos: dict[str, meta.ArrayInfo]  # leaf storage name -> its zarr metadata


@dataclass(frozen=True)
class Source:
    save: layout.Save
    items: tuple[Item, ...]


def _role(keys: tuple[str, ...], has_groups: bool) -> str:
    top = keys[0].lower() if keys else ""
    if top in ("opt_state", "optimizer", "opt") or (top != "params" and any(k in ("mu", "nu") for k in keys)):
        return "optimizer"
    if top == "params" or not has_groups:
        return "model"
    return "other"


def _metadata_key(name: str, zarr3: bool) -> str:
    return f"{name}/{'zarr.json' if zarr3 else '.zarray'}"


def _files(folder: Path) -> list[FileInfo]:
    """Every file under the item, by path."""
    return [FileInfo(str(path), size) for path, size in store.files_under(folder)]


class OrbaxReader:
    name = "orbax"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (layout.is_item(path) or layout.is_step(path))

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        save = layout.open_save(path)
        prefixed = save.is_step and not (len(save.items) == 1 and save.items[0].name in UNPREFIXED_ITEMS)
        tensors: dict[str, TensorEntry] = {}
        items: list[Item] = []
        sharding_of: dict[str, str] = {}
        devices: set[int] = set()
        processes = {}
        notes: list[str] = []
        for folder in save.items:
            tree = meta.tree_metadata(folder)
            prefix = f"{folder.name}." if prefixed else ""
            stored = [leaf for leaf in tree.leaves if leaf.value_type in meta.ARRAY_TYPES and not leaf.skipped]
            others = [leaf.name for leaf in tree.leaves if leaf not in stored and leaf.value_type != "None"]  # None: an empty node
            if others:
                notes.append(f"{folder}: {len(others)} leaves not stored as arrays, not read (e.g. '{others[0]}')")
            keys = [_metadata_key(leaf.name, tree.use_zarr3) for leaf in stored]
            found = arrays.read_keys(folder, keys, tree.use_ocdbt)
            infos: dict[str, meta.ArrayInfo] = {}
            groups = any(leaf.keys[0] in ("params", "opt_state") for leaf in stored)
            shardings = meta.shardings(folder)
            for leaf, key in zip(stored, keys):
                where = folder if tree.use_ocdbt else folder / leaf.name
                raw = found[key]
                if raw is None:
                    raise DataError(f"{folder / key}: missing: _METADATA lists array '{leaf.name}', its zarr metadata is absent")
                info = infos[leaf.name] = meta.array_info(raw, str(folder / key), tree.use_zarr3)
                name = prefix + leaf.name
                derived = arrays.OrbaxArray(
                    arrays.array_spec(folder, leaf.name, tree.use_ocdbt, tree.use_zarr3),
                    info.shape,
                    info.dtype,
                    info.chunks,
                    str(where),
                    name,
                    stream.for_array(folder, leaf.name, info.doc, info.shape, info.chunks, info.dtype.itemsize)
                    if tree.use_ocdbt and not tree.use_zarr3
                    else None,
                )
                numel = math.prod(info.shape)
                stored_at = StoredArray(str(where), 0, info.dtype, (numel,), (1,))
                pieces = LazyPieces(functools.partial(_whole, stored_at, numel), count=1, by_layout=True)
                tensors[name] = TensorEntry(name, info.dtype, info.shape, _role(leaf.keys, groups), pieces, derived=derived)
                spec = shardings.get(leaf.name)
                if spec is not None:
                    sharding_of[name] = meta.spec_text(spec)
                    devices.add(meta.mesh_devices(spec) or 0)
            processes[folder.name] = layout.processes(folder, tree.use_ocdbt)
            items.append(Item(folder, prefix, tree, infos))
        files = [f for item in items for f in _files(item.folder)]
        if save.is_step:
            files = [FileInfo(str(p), p.stat().st_size) for p in sorted(save.folder.iterdir()) if p.is_file()] + files
        first = items[0].tree
        details: dict[str, Any] = {
            "items": [i.folder.name for i in items],
            "processes": max(processes.values()),
            "storage": ("OCDBT" if first.use_ocdbt else "one folder per array") + (", zarr3" if first.use_zarr3 else ", zarr v2"),
            "checksums": "none (Orbax stores none; verify --write-manifest records some)",
            "sharding": sharding_of,
        }
        world = max(devices - {0}, default=None)
        ckpt = Checkpoint(
            "orbax",
            str(path),
            tensors,
            files=files,
            step=save.step,
            world_size=world,
            details=details,
            notes=notes,
            source=Source(save, tuple(items)),
        )
        ckpt.training_state = _training_state(ckpt)
        return ckpt

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        source: Source = ckpt.source
        problems: list[str] = []
        for item in source.items:
            problems += _array_metadata_problems(item)
            try:
                if item.tree.use_ocdbt:
                    problems += ocdbt.problems(item.folder)
                    problems += _chunk_problems(item, arrays.list_keys(item.folder, True))
                else:
                    problems += _chunk_problems(item, None)
            except DataError as exc:
                problems.append(str(exc))
        return problems


def _array_metadata_problems(item: Item) -> list[str]:
    """What each process recorded writing against the tree metadata: the same arrays, chunks of the same shape."""
    out = []
    shapes = {leaf.name: leaf.write_shape for leaf in item.tree.leaves}
    for process, written in meta.array_metadatas(item.folder).items():
        where = item.folder / layout.ARRAY_METADATAS / f"process_{process}"
        for name, shape in written.items():
            if name not in shapes:
                out.append(f"{where}: array '{name}' is not in {item.folder / layout.TREE_METADATA}")
            elif shape is not None and shapes[name] is not None and shape != shapes[name]:
                out.append(f"{where}: array '{name}' written in chunks of {list(shape)}, _METADATA says {list(shapes[name] or ())}")
    return out


def _chunk_problems(item: Item, keys: list[str] | None) -> list[str]:
    """Every chunk of every array present (Orbax writes all of them, fill values too, unless the save says not):
    among the OCDBT keys, or as files of the array's folder; a zarr3 chunk file's shard index inside the file."""
    out = []
    by_array: dict[str, int] = {}
    if keys is not None:
        for key in keys:
            name, _, rest = key.partition("/")
            if rest not in ("zarr.json", ".zarray"):
                by_array[name] = by_array.get(name, 0) + 1
    for name, info in item.infos.items():
        if keys is None:
            folder = item.folder / name
            chunk_files = [(p, size) for p, size in store.files_under(folder) if p.name not in ("zarr.json", ".zarray")]
            count = len(chunk_files)
            if item.tree.use_zarr3:
                out += [p for p in (_shard_index_problem(f, size, info) for f, size in chunk_files) if p]
        else:
            count = by_array.get(name, 0)
        if item.tree.fill_value_stored and count < info.chunk_count:
            where = item.folder if keys is not None else item.folder / name
            out.append(f"{where}: array '{name}' has {count} of its {info.chunk_count} chunks (missing chunk data)")
    return out


def _shard_index_problem(path: Path, size: int, info: meta.ArrayInfo) -> str | None:
    """A zarr3 `sharding_indexed` chunk file ends with an index of (offset, length) per inner chunk (little-endian
    uint64 pairs, then a CRC32C): every entry inside the file, else the file was cut short."""
    codecs = info.doc.get("codecs")
    codec = codecs[0] if isinstance(codecs, list) and codecs and isinstance(codecs[0], dict) else {}
    config = codec.get("configuration") if codec.get("name") == "sharding_indexed" else None
    if not isinstance(config, dict) or config.get("index_location", "end") != "end":
        return None
    inner = config.get("chunk_shape")
    if not isinstance(inner, list) or len(inner) != len(info.chunks) or not all(isinstance(n, int) and n > 0 for n in inner):
        return None
    entries = math.prod(-(-c // i) for c, i in zip(info.chunks, inner))
    index_bytes = entries * 16 + 4
    if size < index_bytes:
        return f"{path}: truncated: {size} bytes, less than its shard index ({index_bytes})"
    with path.open("rb") as f:  # (a local file, or an object read by range)
        f.seek(size - index_bytes)
        index = f.read(index_bytes - 4)
    for offset, length in struct.iter_unpack("<QQ", index):
        if offset == length == (1 << 64) - 1:
            continue  # an inner chunk not stored
        if offset + length > size - index_bytes:
            return (
                f"{path}: truncated or damaged: its shard index points at bytes up to {offset + length}, the data has {size - index_bytes}"
            )
    return None


def _training_state(ckpt: Checkpoint) -> dict[str, Any]:
    opt = [t for t in ckpt.tensors.values() if t.role == "optimizer"]
    state: dict[str, Any] = {"optimizer": None, "lr_scheduler": None, "rng": None, "dataloader": None, "client_state": None}
    if opt:
        kinds = sorted({part for t in opt for part in t.name.split(".") if part in OPTAX_ADAM})
        adam = {"mu", "nu"} <= set(kinds)
        state["optimizer"] = {"kind": "Adam/AdamW (optax)" if adam else "unknown (optax)", "states": kinds, "tensors": len(opt)}
    other = [t.name for t in ckpt.tensors.values() if t.role == "other" and t.name.split(".")[-1] != "step"]
    if other:
        state["client_state"] = {"keys": other[:20]}
    return state


READER = OrbaxReader()


def _whole(stored: StoredArray, numel: int) -> list[Piece]:
    """The one flat piece a computed array stands on (its bytes are read through tensorstore, not this range)."""
    return [Piece(FlatRange(0, numel), stored)]
