"""A DeepSpeed file's tree written again: its tensors as TensorEntries over the stored bytes (`tensorize`), the
entries a new rank rewrites left out or made its own (`outline`, `own`), the client state re-keyed for a new world
size, and the torch.save segments of the result. Used by the reshard writer (formats/deepspeed/writer.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ckpt_cli.core.model import Box, Checkpoint, ObjectEntry, Piece, TensorEntry
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.training import apply_per_rank_rule
from ckpt_cli.core.tree import flatten, path_name, unflatten
from ckpt_cli.core.write.plan import OutputFile
from ckpt_cli.formats.deepspeed.partitions import ZeroFile
from ckpt_cli.formats.deepspeed.reader import ENGINE_KEYS, LAYOUT_KEYS
from ckpt_cli.formats.torch_save import torch_file_segments


def tensorize(rank_file: ZeroFile, tree: Any = None) -> Any:
    """A copy of the file's tree (or of `tree`, read from it) whose tensors are TensorEntries over the stored bytes
    (module weights may tie)."""

    def convert(value: Any, under_module: bool) -> Any:
        if isinstance(value, TensorRef):
            array = rank_file.array(value)
            return TensorEntry(
                "",
                value.dtype,
                value.shape,
                "model" if under_module else "other",
                [Piece(Box((0,) * len(value.shape), value.shape), array)],
            )
        if isinstance(value, dict):
            out = type(value)() if isinstance(value, OrderedDict) else {}
            for k, v in value.items():
                out[k] = convert(v, under_module or k == "module")
            return out
        if isinstance(value, list):
            return [convert(v, under_module) for v in value]
        if isinstance(value, tuple) and any(isinstance(v, TensorRef) for v in value):
            return tuple(convert(v, under_module) for v in value)
        if isinstance(value, TensorEntry):  # a tree built from another checkpoint's tensors: their entries as they are
            return value
        return copy.deepcopy(value)

    return convert(rank_file.tree if tree is None else tree, False)


def outline(optimizer_file: ZeroFile, remade: tuple[str, ...]) -> Any:
    """The optimizer file's tree with the optimizer_state_dict entries `remade` for each new rank left None (key order
    kept), so that they are not copied first: rank 0 of 2 holds the slice mappings of half of 20,000 params."""
    tree = copy.copy(optimizer_file.tree)
    osd = tree["optimizer_state_dict"] = copy.copy(tree["optimizer_state_dict"])
    for key in remade:
        if key in osd:
            osd[key] = None
    return tree


def own(tree: dict[Any, Any], *paths: tuple[Any, ...]) -> dict[Any, Any]:
    """A shallow copy of `tree` whose dicts along each of `paths` are copies too: what one rank's file rewrites is its
    own, the rest is shared with the other ranks' (read only). A template tensorized once serves 1,024 ranks."""
    top = copy.copy(tree)
    for path in paths:
        node = top
        for key in path:
            node[key] = copy.copy(node[key])
            node = node[key]
    return top


def file_segments(tree: Any, where: str) -> list[Any]:
    """torch.save segments for a tree whose leaves are TensorEntries and plain values."""
    leaves, values, containers = flatten(tree, lambda v: isinstance(v, TensorEntry), where)
    tensors = {}
    for path, entry in leaves:
        name = path_name(path)
        tensors[name] = dataclasses.replace(entry, name=name, path=path)
    objects = {path_name(p): ObjectEntry(path_name(p), v, "other", p) for p, v in values}
    return torch_file_segments(Checkpoint("deepspeed", where, tensors, objects, containers=containers))


def built(name: str, make: Callable[[], list[Any]], ckpt: Checkpoint) -> OutputFile:
    """A rank file whose segments are made when it is written: a reshard to many ranks holds one at a time."""
    return OutputFile(name, build=make, reads=tuple(str(f.path) for f in ckpt.files))


def rekey_client_state(tree: dict[str, Any], world: int, rule: str) -> str | None:
    """Apply the per-rank rule (core/training.py) to the client state of a model-states tree in place."""
    client = {k: v for k, v in tree.items() if k not in LAYOUT_KEYS and k not in ENGINE_KEYS}
    if not client:
        return None
    tensors, values, containers = flatten(client, lambda v: isinstance(v, TensorEntry), "client state")
    entries, note = apply_per_rank_rule([ObjectEntry(path_name(p), v, "other", p) for p, v in tensors + values], world, rule)
    if note:
        for key in client:
            del tree[key]
        tree.update(unflatten([(e.path, e.value) for e in entries], containers))
    return note


def state_entry(ckpt: Checkpoint, param: str, key: str) -> TensorEntry:
    """A param's fp32 master weight (key "") or its optimizer state `key`."""
    return ckpt.tensors[param if not key else f"optimizer.state.{param}.{key}"]
