"""Views of a checkpoint for writing: select names, rename prefixes, keep weights only, cast dtypes.

A view is a new Checkpoint over the same stored pieces; nothing is read. A logical tensor whose
dtype differs from its pieces' stored dtype is cast by the executor as it streams.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_cli.core import dtypes
from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import Checkpoint, ObjectEntry, PathKey, TensorEntry
from ckpt_cli.errors import TORCH_INSTALL, UsageError
from ckpt_cli.options import QUANTIZE_METHODS, SelectOptions


@dataclass(frozen=True)
class Transform:
    select: tuple[str, ...] = ()  # shell globs over tensor names; empty keeps all
    exclude: tuple[str, ...] = ()  # shell globs over tensor names left out (after select)
    strip_prefix: str | None = None
    add_prefix: str | None = None
    weights_only: bool = False
    dtype: DType | None = None  # cast floating-point model weights (optimizer state keeps its precision)
    quantize: str | None = None  # "fp8": model weights to FP8 block-scaled (ops/quantized.py); q8_0, ...: GGUF's


def from_options(select: SelectOptions, weights_only: bool) -> Transform:
    """The transform the selection options ask for (`weights_only`: as the command decides it, e.g. merge without --all)."""
    cast = dtypes.cast_target(select.dtype)
    if (cast is not None or select.quantize is not None) and not _have_torch():  # before any work, not after the plan's notes
        raise UsageError(f"converting dtypes needs torch, which is not installed: {TORCH_INSTALL}")
    if select.quantize is not None and select.quantize not in QUANTIZE_METHODS:
        raise UsageError(f"--quantize {select.quantize!r}: ckpt quantizes to {', '.join(QUANTIZE_METHODS)}")
    return Transform(
        tuple(select.filter or ()), tuple(select.exclude or ()), select.strip_prefix, select.add_prefix, weights_only, cast, select.quantize
    )


def _have_torch() -> bool:
    """Whether torch is installed, found without importing it (a GGUF write quantizes in numpy: +200 MB if imported)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def matches(name: str, globs: Sequence[str]) -> bool:
    return not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)


def kept(name: str, t: Transform) -> bool:
    """Whether `t` keeps the tensor or value `name`: it matches --filter (if given) and no --exclude."""
    return matches(name, t.select) and not any(fnmatch.fnmatchcase(name, g) for g in t.exclude)


def _strip(name: str, path: PathKey, prefix: str) -> tuple[str, PathKey]:
    if not name.startswith(prefix):
        return name, path
    rest = name[len(prefix) :]
    joined = ""
    for k, key in enumerate(path):  # drop whole leading path items when the prefix ends on one
        joined += f"{key}."
        if joined == prefix or joined[:-1] == prefix:
            return rest, path[k + 1 :] if path[k + 1 :] else (rest,)
    return rest, (rest,)


def _add(name: str, path: PathKey, prefix: str) -> tuple[str, PathKey]:
    if prefix.endswith("."):
        return prefix + name, (prefix[:-1], *path)
    return prefix + name, (prefix + str(path[0]), *path[1:])


def _rename(name: str, path: PathKey, t: Transform) -> tuple[str, PathKey]:
    if t.strip_prefix:
        name, path = _strip(name, path, t.strip_prefix)
    if t.add_prefix:
        name, path = _add(name, path, t.add_prefix)
    return name, path


def apply(ckpt: Checkpoint, t: Transform) -> Checkpoint:
    """The checkpoint as the writer should see it under transform `t`."""
    tensors: dict[str, TensorEntry] = {}
    for entry in ckpt.tensors.values():
        if (t.weights_only and entry.role != "model") or not kept(entry.name, t):
            continue
        name, path = _rename(entry.name, entry.path, t)
        dtype = t.dtype if t.dtype is not None and entry.dtype.is_float and entry.role == "model" else entry.dtype
        if name in tensors:
            raise UsageError(f"two tensors are both renamed to '{name}'; adjust --strip-prefix/--add-prefix")
        unchanged = name == entry.name and path == entry.path and dtype == entry.dtype  # held once, not copied
        tensors[name] = entry if unchanged else dataclasses.replace(entry, name=name, path=path, dtype=dtype)
    objects: dict[str, ObjectEntry] = {}
    if not t.weights_only and not t.select:
        for obj in ckpt.objects.values():
            if not kept(obj.name, t):
                continue
            name, path = _rename(obj.name, obj.path, t)
            objects[name] = obj if name == obj.name and path == obj.path else dataclasses.replace(obj, name=name, path=path)
    if t.select and not tensors:
        raise UsageError(f"--filter {' '.join(t.select)} matches no tensor")
    if t.exclude and not tensors:
        raise UsageError(f"--exclude {' '.join(t.exclude)} leaves no tensor to write")
    containers = ckpt.containers if not (t.strip_prefix or t.add_prefix) else {}
    return dataclasses.replace(ckpt, tensors=tensors, objects=objects, containers=containers, notes=list(ckpt.notes))


def without_copies(ckpt: Checkpoint, t: Transform) -> Checkpoint:
    """The checkpoint less the tensors that copy another one it holds (DeepSpeed's module.* beside the fp32 master
    weights): another format gets each tensor once. Said in a note when `t` would have written them."""
    copies = [e for e in ckpt.tensors.values() if e.copy_of is not None and e.copy_of in ckpt.tensors]
    if not copies:
        return ckpt
    left_out = {e.name for e in copies}
    tensors = {n: e for n, e in ckpt.tensors.items() if n not in left_out}
    wanted = [e for e in copies if not (t.weights_only and e.role != "model") and kept(e.name, t)]
    notes = list(ckpt.notes)
    if wanted:
        first = f"{wanted[0].name} of {wanted[0].copy_of}"
        notes.append(f"left out {len(wanted)} tensors that copy a weight written under its own name ({first}, ...)")
    return dataclasses.replace(ckpt, tensors=tensors, notes=notes)
