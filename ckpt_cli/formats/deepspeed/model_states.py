"""What a DeepSpeed model-states file holds beside the partitioned parameters: buffers, frozen parameters, and the
module's own copies of the trained parameters in the training dtype (docs/formats.md §2.3, §2.8). `first` is the
(rank-0) model-states file: a RankFile of deepspeed.py, with `tree`, `array` and `whole`."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from ckpt_cli.core import dtypes
from ckpt_cli.core.model import Box, LazyPieces, Piece, TensorEntry
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.formats.deepspeed import layout as zl
from ckpt_cli.formats.deepspeed.partitions import stage3_frozen_pieces


def frozen_and_buffers(first: Any, models: Mapping[int, Any], world: int, stage: int | None) -> dict[str, TensorEntry]:
    """Buffers (as zero_to_fp32: floating ones in fp32) and frozen params (training dtype)."""
    model = first.tree
    module = model.get("module") or {}
    out: dict[str, TensorEntry] = {}
    for name in model.get("buffer_names") or []:
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            logical = dtypes.FLOAT32 if ref.dtype.is_float else ref.dtype
            out[name] = TensorEntry(name, logical, ref.shape, "model", first.whole(ref))
    shapes = model.get("frozen_param_shapes") or {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        n = math.prod(shape)
        if stage == 3:  # every rank's model states hold a fragment: read when a command reads the data
            dtype = models[0].tree["frozen_param_fragments"][name].dtype
            pieces = LazyPieces(functools.partial(stage3_frozen_pieces, models, name, n, world), zl.stage3_rank_count(n, world))
            out[name] = TensorEntry(name, dtype, shape, "model", pieces)
        else:
            ref = model["frozen_param_fragments"][name]
            out[name] = TensorEntry(name, ref.dtype, shape, "model", [Piece(Box((0,) * len(shape), shape), first.array(ref))])
    if model.get("frozen_param_shapes") is None and stage != 3:
        # Stage 1 saves no frozen_* keys (zero_to_fp32 then drops frozen params); `module` still has them whole.
        owned = {n for group in model.get("param_shapes") or [] for n in group} | set(model.get("shared_params") or {})
        for name, ref in module.items():
            if isinstance(ref, TensorRef) and name not in owned and name not in out and math.prod(ref.shape) != 0:
                out[name] = TensorEntry(name, ref.dtype, ref.shape, "model", first.whole(ref))
    return out


def training_dtype_weights(first: Any, stage: int | None) -> dict[str, TensorEntry]:
    """The module's own copies of the trainable params (training dtype: bf16/fp16 or fp32), as `module.<name>`.
    Stage 3 saves only empty placeholders there, so it has none."""
    model = first.tree
    owned = [n for group in model.get("param_shapes") or [] for n in group]
    module = model.get("module") or {}
    out = {}
    for name in owned if stage != 3 else []:
        ref = module.get(name)
        if isinstance(ref, TensorRef) and math.prod(ref.shape) != 0:
            path, full = ("module", name), f"module.{name}"
            out[full] = TensorEntry(full, ref.dtype, ref.shape, "other", first.whole(ref), path, copy_of=name)
    return out
