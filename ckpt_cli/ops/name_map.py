"""A name map (--rename, --name-map) applied to a checkpoint written as tensors: hf, safetensors and torch exports.

Training-state conversions rename parameters through their own path (ops/crossframework.py); a weights export
takes the checkpoint's tensors as they are, so each is split by the first `split` that matches its name
(core/row_split.py: fused QKV to q/k/v, SwiGLU fc1 to gate/up, stacked layers to one tensor each), else renamed.
Nothing is read: split outputs point at the source's stored bytes.
"""

from __future__ import annotations

import dataclasses

from ckpt_cli.core.model import Checkpoint, ObjectEntry, TensorEntry
from ckpt_cli.core.training import NameMap
from ckpt_cli.errors import UsageError


def weights_view(ckpt: Checkpoint, names: NameMap) -> Checkpoint:
    """The checkpoint with the map's splits and renames applied to its tensor (and value) names."""
    tensors: dict[str, TensorEntry] = {}
    split, outputs, renamed = 0, 0, 0
    for entry in ckpt.tensors.values():
        base = names.strip(entry.name)
        parts = next((p for s in names.splits if (p := s.apply(entry, base)) is not None), None)
        if parts is not None:
            split, outputs = split + 1, outputs + len(parts)
        else:
            new = names.apply(entry.name)
            renamed += new != entry.name
            parts = [entry if new == entry.name else dataclasses.replace(entry, name=new, path=(new,))]
        for part in parts:
            if part.name in tensors:
                raise UsageError(f"the name map names two tensors '{part.name}' ({entry.name} is one); adjust --name-map/--rename")
            tensors[part.name] = part
    objects: dict[str, ObjectEntry] = {}
    for obj in ckpt.objects.values():
        new = names.apply(obj.name)
        if new in objects or new in tensors:
            raise UsageError(f"the name map names two entries '{new}' ({obj.name} is one); adjust --name-map/--rename")
        objects[new] = obj if new == obj.name else dataclasses.replace(obj, name=new, path=(new,))
    note = f"name map: {split} tensors split into {outputs}, {renamed} renamed"
    return dataclasses.replace(ckpt, tensors=tensors, objects=objects, notes=[*ckpt.notes, note])
