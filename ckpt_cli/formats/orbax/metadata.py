"""An Orbax item's metadata files: `_METADATA` (the tree: each leaf's key path and value type), `_sharding` (each
array's jax.sharding, by its name in base64), `array_metadatas/process_N` (the shapes each process wrote), and each
array's zarr metadata (`.zarray` for zarr v2, `zarr.json` for zarr3): the global shape and dtype."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core import dtypes, structured
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.paths import read_regular_text
from ckpt_cli.errors import DataError
from ckpt_cli.formats.orbax.layout import ARRAY_METADATAS, SHARDING, TREE_METADATA

MAX_METADATA = 1 << 30
ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")  # value_metadata.value_type of leaves stored as arrays


@dataclass(frozen=True)
class Leaf:
    """A leaf of the saved tree: its key path, its name in storage (the keys joined with '.', as Orbax names the
    array's folder or OCDBT key prefix), its value type and the shape of the chunk each device wrote."""

    keys: tuple[str, ...]
    value_type: str
    write_shape: tuple[int, ...] | None
    skipped: bool  # skip_deserialize: Orbax saved no value for it
    indices: tuple[bool, ...] = ()  # per key: a sequence index (key_type 1: a list or tuple), not a dict key

    @property
    def name(self) -> str:
        return ".".join(self.keys)


@dataclass(frozen=True)
class TreeMetadata:
    leaves: tuple[Leaf, ...]
    use_ocdbt: bool
    use_zarr3: bool
    fill_value_stored: bool  # store_array_data_equal_to_fill_value: every chunk is written, even all-zero ones


def _load(path: Path) -> Any:
    try:
        text = read_regular_text(path, max_bytes=MAX_METADATA)
    except FileNotFoundError:
        raise DataError(f"{path}: missing") from None
    except OSError as exc:
        raise DataError(f"{path}: unreadable ({exc})") from exc
    return structured.load_json(text, str(path), DataError)


def tree_metadata(item: Path) -> TreeMetadata:
    path = item / TREE_METADATA
    doc = _load(path)
    tree = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(tree, dict):
        raise DataError(f"{path}: no 'tree_metadata' object (not an Orbax PyTree save's metadata)")
    leaves = []
    for key, entry in tree.items():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not keys or not isinstance(value, dict):
            raise DataError(f"{path}: leaf {str(key)[:80]} has no key_metadata or value_metadata")
        names, indices = [], []
        for k in keys:
            if not isinstance(k, dict) or not isinstance(k.get("key"), (str, int)):
                raise DataError(f"{path}: leaf {str(key)[:80]}: a key without a name")
            names.append(str(k["key"]))
            indices.append(k.get("key_type") == 1 and str(k["key"]).isdigit())
        shape = value.get("write_shape")
        write_shape = tuple(shape) if isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape) else None
        leaves.append(Leaf(tuple(names), str(value.get("value_type")), write_shape, bool(value.get("skip_deserialize")), tuple(indices)))
    names = [leaf.name for leaf in leaves]
    if len(set(names)) != len(names):
        raise DataError(f"{path}: two leaves have the same name")
    return TreeMetadata(
        tuple(leaves),
        doc.get("use_ocdbt") is not False,
        doc.get("use_zarr3") is True,
        doc.get("store_array_data_equal_to_fill_value") is not False,
    )


def shardings(item: Path) -> dict[str, dict[str, Any]]:
    """Each array's sharding as Orbax recorded it (NamedSharding: mesh shape, axis names, partition spec)."""
    path = item / SHARDING
    if not path.is_file():
        return {}
    doc = _load(path)
    out = {}
    for key, value in doc.items() if isinstance(doc, dict) else ():
        try:
            name = base64.urlsafe_b64decode(key.encode()).decode()
            spec = json.loads(value) if isinstance(value, str) else value
        except (ValueError, UnicodeDecodeError):
            raise DataError(f"{path}: an entry {key[:60]!r} that is not base64 of an array name with its sharding") from None
        if isinstance(spec, dict):
            out[name] = spec
    return out


def spec_text(spec: dict[str, Any]) -> str:
    """A sharding in words: `P('data', 'model') over data=4 x model=2` (NamedSharding), else its type."""
    kind = spec.get("sharding_type")
    axes, shape, parts = spec.get("axis_names"), spec.get("shape"), spec.get("partition_spec")
    if kind != "NamedSharding" or not isinstance(axes, list) or not isinstance(shape, list) or not isinstance(parts, list):
        return str(kind)
    dims = ", ".join("None" if p is None else repr(p) if isinstance(p, str) else f"({', '.join(map(repr, p))})" for p in parts)
    mesh = " x ".join(f"{a}={n}" for a, n in zip(axes, shape))
    return f"P({dims}) over {mesh}"


def mesh_devices(spec: dict[str, Any]) -> int | None:
    shape = spec.get("shape")
    if isinstance(shape, list) and all(isinstance(n, int) and n > 0 for n in shape):
        count = 1
        for n in shape:
            count *= n
        return count
    return None


def array_metadatas(item: Path) -> dict[int, dict[str, tuple[int, ...] | None]]:
    """process index -> {array name: write shape} from array_metadatas/process_N."""
    folder = item / ARRAY_METADATAS
    out: dict[int, dict[str, tuple[int, ...] | None]] = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.iterdir()):
        if not path.name.startswith("process_") or not path.name[8:].isdigit():
            continue
        doc = _load(path)
        entries = doc.get("array_metadatas") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise DataError(f"{path}: no 'array_metadatas' list")
        shapes = {}
        for e in entries:
            meta = e.get("array_metadata") if isinstance(e, dict) else None
            if isinstance(meta, dict) and isinstance(meta.get("param_name"), str):
                shape = meta.get("write_shape")
                shapes[meta["param_name"]] = tuple(shape) if isinstance(shape, list) else None
        out[int(path.name[8:])] = shapes
    return out


@dataclass(frozen=True)
class ArrayInfo:
    """An array's zarr metadata: global shape, dtype, the chunk grid, the codecs, the fill value."""

    shape: tuple[int, ...]
    dtype: DType
    chunks: tuple[int, ...]
    doc: dict[str, Any]  # the whole document, for the checks of the chunk files

    @property
    def chunk_count(self) -> int:
        count = 1
        for n, c in zip(self.shape, self.chunks):
            count *= -(-n // c) if c else 0
        return count


ZARR2_DTYPES = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "|b1": "bool"}


def _dtype(code: Any, where: str) -> DType:
    """A zarr data type: zarr3 names (float32, bfloat16), zarr v2 numpy codes (<f4, |u1) or the ml_dtypes names
    Orbax writes for the types numpy lacks."""
    import numpy as np

    if not isinstance(code, str):
        raise DataError(f"{where}: a data type that is not a name ({str(code)[:40]})")
    name = ZARR2_DTYPES.get(code, code)
    if name not in dtypes.BY_NAME:
        try:
            parsed = np.dtype(code)
        except TypeError:
            raise DataError(f"{where}: data type {code!r}, which ckpt does not read") from None
        if parsed.byteorder == ">":
            raise DataError(f"{where}: big-endian data type {code!r}, which ckpt does not read")
        name = parsed.name
    if name not in dtypes.BY_NAME:
        raise DataError(f"{where}: data type {code!r}, which ckpt does not read")
    return dtypes.BY_NAME[name]


def array_info(raw: bytes, where: str, zarr3: bool) -> ArrayInfo:
    doc = structured.load_json(raw.decode("utf-8", "replace"), where, DataError)
    if not isinstance(doc, dict):
        raise DataError(f"{where}: not a zarr array's metadata")
    shape = doc.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise DataError(f"{where}: no array shape")
    if zarr3:
        grid = doc.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape") if isinstance(doc.get("chunk_grid"), dict) else None
        dtype = _dtype(doc.get("data_type"), where)
    else:
        grid = doc.get("chunks")
        dtype = _dtype(doc.get("dtype"), where)
    if not isinstance(grid, list) or len(grid) != len(shape) or not all(isinstance(n, int) and n > 0 for n in grid):
        grid = list(shape)  # a 0-d array: one chunk
    return ArrayInfo(tuple(shape), dtype, tuple(grid), doc)
