"""DeepSpeed pipeline parallelism (`deepspeed.pipe.PipelineModule`, ZeRO-0/1 data parallelism inside each stage).

Each stage s saves its own `mp_rank_{s:02d}_model_states.pt` (`module` None; `param_shapes` under the PipelineModule's
names, `3.lin.weight`; `checkpoint_parallel_dimensions` {pp_degree, tp_degree}) and its own ZeRO files
`zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt`, partitioned over the stage's data-parallel group; the weights in the
training dtype are in one `layer_{idx:02d}-model_states.pt` per layer (`PipelineModule.save_state_dict`: the layer's own
state dict). A stage reads as a dense ZeRO checkpoint (deepspeed.py `read_tag`); the stages together give every
parameter once (a tied layer's parameter, held by every stage that uses it, from the first). A reshard rewrites each
stage for the new data-parallel size and copies the layer files. Rules: docs/formats.md §2.14.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core.dtypes import dtype_digest
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint, FileInfo, ObjectEntry, TensorEntry
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats.deepspeed.variants import PIPELINE_LAYER

STAGE_MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
LAYER_INDEX = re.compile(r"^layer_(\d+)")


def is_pipeline(folder: Path, model: Mapping[str, Any]) -> bool:
    dims = model.get("checkpoint_parallel_dimensions") or {}
    return dims.get("pp_degree", 1) > 1 or any(PIPELINE_LAYER.match(p.name) for p in folder.iterdir())


@dataclass
class PipelineSource:
    """What the DeepSpeed writer needs: each stage read as a checkpoint of its own, and the layer files."""

    folder: Path
    stages: list[Checkpoint]
    layers: dict[str, Any]  # file name -> its parsed file (a RankFile)
    dtypes: bytes  # dtypes.dtype_digest of the tensors read

    @property
    def data_parallel(self) -> int:
        return self.stages[0].world_size or 1

    @property
    def model(self) -> Any:
        """Stage 0's model states (engine keys, client state) with every stage's buffer names, as a ZeRO source's."""
        trees = [stage.source.model.tree for stage in self.stages]
        buffers = [n for tree in trees for n in (tree.get("buffer_names") or [])]
        return _Tree({**trees[0], "buffer_names": buffers})


@dataclass
class _Tree:
    tree: dict[str, Any]


def read(
    reader: Any,
    path: Path,
    folder: Path,
    tag: str,
    notes: list[str],
    options: ReadOptions,
    load: Callable[[Path], Any],
    model: Mapping[str, Any],
) -> Checkpoint:
    """The stages (each through `reader.read_tag`) and the layer files as one checkpoint of the whole model; `model`: the
    model states the reader opened first (every stage's records the same parallel dimensions)."""
    stage_files = sorted(int(m.group(1)) for p in folder.iterdir() if (m := STAGE_MODEL_STATES.match(p.name)))
    if not stage_files:
        raise DataError(f"{folder}: pipeline layer files without any stage's model states (mp_rank_XX_model_states.pt)")
    dims = model.get("checkpoint_parallel_dimensions") or {}
    count = dims.get("pp_degree") or len(stage_files)
    if stage_files != list(range(count)):
        missing = min(set(range(count)) - set(stage_files), default=len(stage_files))
        raise DataError(f"{folder}: mp_rank_{missing:02d}_model_states.pt of pipeline stage {missing} is missing ({count} stages)")
    stages = [reader.read_tag(path, folder, tag, [], options, stage_of=s) for s in range(count)]
    for s, stage in enumerate(stages):
        if stage.details.get("moe_layers") or stage.details.get("zero_stage") not in (1, None):
            raise UsageError(f"{folder}: pipeline stage {s} is ZeRO-{stage.details.get('zero_stage')}; ckpt reads pipelines at ZeRO-1")
    worlds = {stage.world_size for stage in stages}
    if len(worlds) != 1:
        raise DataError(f"{folder}: the pipeline stages are partitioned over different data-parallel sizes ({sorted(map(str, worlds))})")
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    tied = []
    for stage in stages:
        for name, entry in stage.tensors.items():
            if name not in tensors:
                tensors[name] = entry
            elif entry.role == "model":
                tied.append(name)  # a tied layer's parameter: every stage using it holds a copy (kept in sync)
        for name, obj in stage.objects.items():
            objects.setdefault(name, obj)
    groups = [g for stage in stages for g in stage.objects["optimizer.param_groups"].value]
    objects["optimizer.param_groups"] = dataclasses.replace(objects["optimizer.param_groups"], value=groups)
    layers = {p.name: load(p) for p in sorted(folder.iterdir()) if PIPELINE_LAYER.match(p.name)}
    buffers = {str(n) for stage in stages for n in (stage.source.model.tree.get("buffer_names") or [])}
    tensors.update(_layer_tensors(layers, tensors, buffers))
    if tied:
        notes.append(f"{len(tied)} parameters of tied layers are held by several stages (e.g. {tied[0]}): read from the first")
    files = [info for stage in stages for info in stage.files] + [FileInfo(str(f.path), f.path.stat().st_size) for f in layers.values()]
    dp = stages[0].world_size or 1
    details = {**stages[0].details, "pipeline_stages": count, "data_parallel_size": dp, "param_groups": len(groups)}
    details["partition_count"] = dp
    ckpt = Checkpoint(reader.name, str(path), tensors, objects, files, tag, stages[0].step, dp * count, details=details, notes=notes)
    ckpt.training_state = reader._training_state(ckpt, details.get("optimizer_wrapper", ""))
    ckpt.source = PipelineSource(folder, stages, layers, dtype_digest(tensors))
    return ckpt


def missing_layers(source: PipelineSource) -> list[str]:
    """A layer holding parameters (`IDX.name` in a stage's param_shapes) without its layer file: DeepSpeed's
    load_state_dir finds no file for it and fails (docs/formats.md §2.14)."""
    have = {int(m.group(1)) for name in source.layers if (m := LAYER_INDEX.match(name))}
    owners = sorted({int(n.split(".", 1)[0]) for stage in source.stages for n in stage.tensors if n.split(".", 1)[0].isdigit()})
    return [f"{source.folder}: layer_{i:02d}-model_states.pt is missing (layer {i} holds parameters)" for i in owners if i not in have]


def _layer_tensors(layers: Mapping[str, Any], params: Mapping[str, TensorEntry], buffers: set[str]) -> dict[str, TensorEntry]:
    """The layer files' tensors: a parameter's copy in the training dtype as `module.<name>`, a buffer under its name,
    anything else (a tied layer's copy, whose parameter is named after the tie) as `module.layer_XX.<key>`."""
    out = {}
    for file_name, f in layers.items():
        match = LAYER_INDEX.match(file_name)
        assert match, f"{file_name}: read as a layer file (PIPELINE_LAYER), so named layer_<index>"
        index = int(match.group(1))
        for key, ref in f.tree.items():
            if not isinstance(ref, TensorRef):
                continue
            name = f"{index}.{key}"
            if name in buffers:
                out[name] = TensorEntry(name, ref.dtype, ref.shape, "model", f.whole(ref))
            elif name in params:
                path = ("module", name)
                out[f"module.{name}"] = TensorEntry(f"module.{name}", ref.dtype, ref.shape, "other", f.whole(ref), path, copy_of=name)
            else:
                path = ("module", f"layer_{index:02d}.{key}")
                out[f"module.layer_{index:02d}.{key}"] = TensorEntry(path_name(path), ref.dtype, ref.shape, "other", f.whole(ref), path)
    return out
