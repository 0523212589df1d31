"""A name map (--rename, --name-map, --preset) applied to a checkpoint written as tensors: hf, safetensors and torch exports.

Training-state conversions rename parameters through their own path (ops/crossframework.py); a weights export
takes the checkpoint's tensors as they are: tensors a `stack` matches are laid end to end into one (core/names/stack.py:
per-expert weights into packed experts), and a tensor an `unstack` matches becomes one per index of an axis
(core/names/unstack.py: a scanned JAX model's layers). Then each tensor, in this order, is viewed in another shape by
the first `reshape` that matches its name (core/names/reshape.py), transposed (core/names/rope.py), permuted by the
first `permute` (q/k rows to the other rotary layout, per head), multiplied by the first `scale`
(core/names/scale.py), and split by the first `split` (core/names/row_split.py: fused QKV to q/k/v, SwiGLU fc1 to
gate/up, stacked layers to one tensor each) or renamed.
Nothing is read here: split outputs point at the source's stored bytes, permuted and scaled ones are computed as they
are read.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import closing
from typing import Any

from ckpt_cli.core.model import Checkpoint, ObjectEntry, TensorEntry
from ckpt_cli.core.names import rope
from ckpt_cli.core.names.reshape import Reshape, reshaped
from ckpt_cli.core.names.row_split import RowSplit
from ckpt_cli.core.names.scale import Scale, scaled
from ckpt_cli.core.training import NameMap
from ckpt_cli.errors import UsageError


def weights_view(ckpt: Checkpoint, names: NameMap) -> Checkpoint:
    """The checkpoint with the map's stacks, permutes, splits and renames applied to its tensors (and its values' names)."""
    tensors: dict[str, TensorEntry] = {}
    split, outputs, renamed, permuted, turned, shaped, unstacked, scaled_ = 0, 0, 0, 0, 0, 0, 0, 0
    configured: list[RowSplit | Reshape | Scale] = [*names.splits, *names.reshapes, *names.scales]
    needs = any(isinstance(p.heads, str) for p in names.permutes) or any(c.needs_config() for c in configured)
    config = model_config(ckpt) if needs else None
    splits = [s.resolved(config) for s in names.splits]
    sources = dict(ckpt.tensors)
    stacked: dict[str, TensorEntry] = {}
    for stack in names.stacks:
        made, taken = stack.gather(sources, names.strip)
        stacked.update(made)
        sources = {n: e for n, e in sources.items() if n not in taken}
    left_out = [n for n, e in sources.items() if any(re.fullmatch(p, names.strip(n)) for p in names.zeros)]
    for name in left_out:
        _require_zero(sources.pop(name))
    entries: list[TensorEntry] = []
    for entry in sources.values():  # a scanned model's layers first: every later rule sees one layer's tensor
        layers = next((u for un in names.unstacks if (u := un.apply(entry, names.strip(entry.name))) is not None), None)
        unstacked += layers is not None
        entries += layers if layers is not None else [entry]
    for entry in entries:
        base = names.strip(entry.name)
        reshape = next((r for r in names.reshapes if r.matches(base)), None)
        if reshape is not None:  # first: a JAX kernel [embed, heads, head_dim] becomes the 2-D weight the rest expects
            entry = reshaped(entry, reshape.target(entry, config))
            shaped += 1
        transpose = any(re.fullmatch(p, base) for p in names.transposes)
        if transpose:  # then [in, out] becomes a torch Linear's [out, in], whose rows a permute moves
            entry = rope.transposed(entry, entry.name)
            turned += 1
        permute = next((p for p in names.permutes if re.fullmatch(p.pattern, base)), None)
        if permute is not None:
            entry = rope.permuted(entry, entry.name, permute.head_count(config, entry.name), permute.rope)
            permuted += 1
        scale = next((s for s in names.scales if re.fullmatch(s.pattern, base)), None)
        if scale is not None:
            entry = scaled(entry, scale.factor(config))
            scaled_ += 1
        parts = next((p for s in splits if (p := s.apply(entry, base)) is not None), None)
        if parts is not None and (permute is not None or transpose or scale is not None):
            raise UsageError(
                f"the name map splits '{entry.name}' and permutes, transposes or scales it; split the fused tensor, then change its parts"
            )
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
    for name, entry in stacked.items():
        if name in tensors:
            raise UsageError(f"the name map names two tensors '{name}' (a stack's output is one); adjust --name-map")
        tensors[name] = entry
    objects: dict[str, ObjectEntry] = {}
    for obj in ckpt.objects.values():
        new = names.apply(obj.name)
        if new in objects or new in tensors:
            raise UsageError(f"the name map names two entries '{new}' ({obj.name} is one); adjust --name-map/--rename")
        objects[new] = obj if new == obj.name else dataclasses.replace(obj, name=new, path=(new,))
    note = f"name map: {split} tensors split into {outputs}, {renamed} renamed"
    if left_out:
        note += f", {len(left_out)} all-zero tensors left out ({left_out[0]}{', ...' if len(left_out) > 1 else ''})"
    if names.reshapes:
        note += f", {shaped} reshaped"
    if names.unstacks:
        note += f", {unstacked} unstacked into {len(entries) - len(sources) + unstacked}"
    if names.transposes:
        note += f", {turned} transposed"
    if names.scales:
        note += f", {scaled_} scaled"
    if names.stacks:
        note += f", {len(ckpt.tensors) - len(sources)} stacked into {len(stacked)}"
    if names.permutes:
        note += f", {permuted} permuted to the other rotary layout"
        if not permuted:
            note += " (the map's permute matched no tensor: is it the map for this model?)"
    return dataclasses.replace(ckpt, tensors=tensors, objects=objects, notes=[*ckpt.notes, note])


def _require_zero(entry: TensorEntry) -> None:
    """A tensor the target model has no place for (a name map's `zero`) may be left out only while it changes nothing:
    all its bytes zero (a -0.0 counts as a value). Read here, a window at a time; such tensors are small (a router bias)."""
    from ckpt_cli.core.reading import SourceFiles, tensor_bytes

    with closing(SourceFiles()) as sources:
        if all(not any(memoryview(block).cast("B")) for block in tensor_bytes(entry, sources)):
            return
    raise UsageError(
        f"{entry.name} is not all zeros, and the target model has no place for it (the map leaves it out only while it is "
        "zero): the release would compute something else. Export it with a name map of your own that keeps or drops it"
    )


def model_config(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The model's config.json as a dict (a multimodal one's text_config, which holds the head counts); None without one."""
    from ckpt_cli.formats.companions import companion_config  # (inspect of a safetensors file imports no folder format)

    config = companion_config(ckpt)
    if config is not None and isinstance(config.get("text_config"), dict) and "num_attention_heads" not in config:
        return config["text_config"]
    return config
