"""DeepSpeed universal checkpoints (the output of `ds_to_universal`), read without DeepSpeed.

Layout (deepspeed/checkpoint/ds_to_universal.py, docs/formats.md §2.13): `<root>/latest_universal` names a tag
folder, which holds copies of the run's model-states files (`mp_rank_00_model_states.pt`; at stage 3 every rank's
`zero_pp_rank_R_mp_rank_00_model_states.pt`) and `zero/`: one folder per parameter, named by its FQN, holding
`fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` and `step.pt`, plus `zero/optimizer_state.pt` (param groups by index, ZeRO
bookkeeping). Stages 1/2 save each state as `{'param': tensor, 'cat_dim': 0}` in the parameter's shape, stage 3 as
a bare flat tensor. Parameters without optimizer state (frozen, or never given a gradient) have `fp32.pt` alone.

The checkpoint reads as the native DeepSpeed reader names one (weights = the fp32 masters, moments under
`optimizer.state.FQN.KEY`, param groups by name), so its training state moves through deepspeed_training: to native
DeepSpeed at any world size (`reshard`, loaded by a plain `load_checkpoint`) or to DCP. Buffers and tied aliases
come from the model states, as DeepSpeed's universal loader takes them: the `zero/` copies of those are float casts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Box, Checkpoint, FileInfo, FlatRange, ObjectEntry, Piece, TensorEntry
from ckpt_cli.core.paths import present, step_number
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.core.tree import path_name
from ckpt_cli.errors import DataError
from ckpt_cli.formats.deepspeed import rank_files
from ckpt_cli.formats.deepspeed import reader as deepspeed
from ckpt_cli.formats.deepspeed.model_states import frozen_and_buffers
from ckpt_cli.formats.deepspeed.rank_files import DS_GLOBALS, LazyRanks, RankFile
from ckpt_cli.formats.deepspeed.reader import MODEL_STATES
from ckpt_cli.formats.deepspeed.reader import READER as NATIVE
from ckpt_cli.formats.deepspeed.variants import refuse_variants
from ckpt_cli.formats.torch_save import Shared, crc_problems, open_archive, stored_array

LATEST = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
STATES = ("fp32", "exp_avg", "exp_avg_sq", "step")


def is_universal_tag(path: Path) -> bool:
    """A tag folder ds_to_universal wrote: `zero/` beside a model-states file."""
    zero = path / ZERO
    return path.is_dir() and zero.is_dir() and any(MODEL_STATES.match(p.name) for p in path.iterdir())


TAGS = deepspeed.Tags(
    LATEST,
    is_universal_tag,
    "universal checkpoint tag",
    "is not a universal checkpoint (zero/ + model states)",
    f"no DeepSpeed universal checkpoint here (no '{LATEST}', no tag folder with zero/)",
)
list_tags, resolve_tag = TAGS.names, TAGS.resolve


@dataclass
class UniversalSource:
    """What deepspeed_training reads beside the tensors: the (rank-0) model states."""

    folder: Path
    model: RankFile


class UniversalReader:
    name = "deepspeed-universal"

    def detect(self, path: Path) -> bool:
        """A universal tag folder, or a save folder that `latest_universal` and no native `latest` describe (a folder
        with both is read as native DeepSpeed, as a plain load_checkpoint reads it; --format or --tag picks this)."""
        if not path.is_dir():
            return False
        return is_universal_tag(path) or (present(path / LATEST) and not present(path / deepspeed.LATEST))

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        folder, tag, notes = resolve_tag(path, options.tag)
        parsed = Shared()
        model_paths = sorted((p for p in folder.iterdir() if MODEL_STATES.match(p.name)), key=lambda p: p.name)
        rank0 = [p for p in model_paths if (m := MODEL_STATES.match(p.name)) and m.group(1) in (None, "0")]
        if not rank0:
            raise DataError(f"{folder}: no rank-0 model-states file (mp_rank_00_model_states.pt)")
        first = rank_files.load(rank0[0], options, parsed)
        model = first.tree
        refuse_variants(folder, model, MODEL_STATES)
        optim_path = folder / ZERO / OPTIMIZER_STATE
        optim = rank_files.load(optim_path, options, parsed) if present(optim_path) else None
        shapes: list[Mapping[str, Any]] = model.get("param_shapes") or []
        expected = {n: tuple(s) for group in shapes for n, s in group.items()}
        expected.update({n: tuple(s) for n, s in (model.get("frozen_param_shapes") or {}).items()})
        shared = dict(model.get("shared_params") or {})
        module = model.get("module") or {}
        stage = _stage(optim, model)
        files = [first.path] + [p for p in model_paths if p != first.path] + ([optim_path] if optim else [])
        # Buffers and frozen parameters as the native reader gives them, from the model states (their zero/ copies
        # are float casts of the module's, and stage 3 has none of the frozen ones: docs/formats.md §2.13)
        ranks = _model_ranks(folder, model_paths, first, options, parsed)
        from_model_states = frozen_and_buffers(first, ranks, max(len(ranks), 1), stage)
        skip = set(from_model_states)
        tensors, read_files = self._param_tensors(folder / ZERO, expected, skip, shared, module, options, parsed)
        files += read_files
        tensors.update(from_model_states)
        tensors.update(_group_steps(optim, shapes, tensors))
        for alias, owner in shared.items():
            if owner in tensors:
                tensors[alias] = TensorEntry(alias, tensors[owner].dtype, tensors[owner].shape, "model", tensors[owner].pieces)
        groups = _param_groups(optim, shapes, optim_path)
        client_tensors, objects = NATIVE._client_state(first, groups)
        tensors.update(client_tensors)
        osd = optim.tree if optim else {}
        world = osd.get("partition_count")
        world = max(world) if isinstance(world, list) and world else world
        details = {
            "zero_stage": stage,
            "universal": True,
            "saved_world_size": world if isinstance(world, int) else None,
            "param_groups": len(groups),
            "parameters": sum(1 for t in tensors.values() if t.role == "model"),
            "ds_version": model.get("ds_version"),
            "tags": ", ".join(list_tags(path)) if folder != path else tag,
        }
        ckpt = Checkpoint(
            format=self.name,
            path=str(path),
            tensors=tensors,
            objects=objects,
            files=[FileInfo(str(p), p.stat().st_size) for p in files],
            tag=tag,
            step=step_number(model.get("global_steps"), f"{first.path}: global_steps"),
            world_size=None,  # a universal checkpoint loads at any world size
            details=details,
            notes=notes,
        )
        ckpt.training_state = NATIVE._training_state(ckpt, "universal checkpoint")
        ckpt.source = UniversalSource(folder, first)
        return ckpt

    def _param_tensors(
        self,
        zero: Path,
        expected: dict[str, tuple[int, ...]],
        skip: set[str],
        shared: dict[str, str],
        module: Mapping[str, Any],
        options: ReadOptions,
        parsed: Shared,
    ) -> tuple[dict[str, TensorEntry], list[Path]]:
        """Each parameter folder's states as logical tensors (weights by FQN, moments as the native reader names them)."""
        tensors: dict[str, TensorEntry] = {}
        files: list[Path] = []
        folders = {p.name: p for p in zero.iterdir() if p.is_dir()}
        for name in [*expected, *(n for n in folders if n not in expected)]:
            if name in skip or name in shared:  # taken from the model states; the folder's files are still checked
                files += sorted(p for p in folders[name].iterdir() if p.suffix == ".pt") if name in folders else []
                continue
            param = folders.get(name)
            if param is None:
                raise DataError(f"{zero}: no folder for parameter '{name}' (the model states list it); an incomplete conversion?")
            shape = expected.get(name)
            if shape is None:
                ref = module.get(name)
                shape = tuple(ref.shape) if isinstance(ref, TensorRef) else None
            states = {s: param / f"{s}.pt" for s in STATES if present(param / f"{s}.pt")}
            if "fp32" not in states:
                raise DataError(f"{param}: no fp32.pt (every parameter of a universal checkpoint has its fp32 weight)")
            moments = [s for s in ("exp_avg", "exp_avg_sq") if s in states]
            if len(moments) == 1:
                missing = ({"exp_avg", "exp_avg_sq"} - set(moments)).pop()
                raise DataError(f"{param}: {moments[0]}.pt without {missing}.pt; an incomplete conversion?")
            for state, file in states.items():
                entry = _state_tensor(file, name, state, shape, options, parsed)
                tensors[entry.name] = entry
                files.append(file)
        return tensors, files

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        problems: list[str] = []
        weights = {n for n, t in ckpt.tensors.items() if t.role == "model"}
        trained = any(t.role == "optimizer" for t in ckpt.tensors.values())  # a checkpoint saved with optimizer state
        for group in (ckpt.objects.get("optimizer.param_groups") or ObjectEntry("", [], "optimizer")).value:
            for name in group.get("params", []):
                if name not in weights:
                    problems.append(f"{ckpt.path}: the param groups name '{name}', which has no folder under zero/")
                elif trained and f"optimizer.state.{name}.exp_avg" not in ckpt.tensors:
                    problems.append(f"{ckpt.path}: '{name}' is trained (in a param group) but zero/{name}/ holds no exp_avg.pt")
        return problems + (crc_problems(f.path for f in ckpt.files) if deep else [])


def _model_ranks(folder: Path, paths: list[Path], first: RankFile, options: ReadOptions, parsed: Shared) -> LazyRanks:
    """Every rank's model states by rank (stage 3's zero_pp_rank_R files; none at stages 1/2), each parsed when asked for:
    at stage 3 each holds a fragment of every frozen parameter."""
    ranks = {int(m.group(1)): p for p in paths if (m := MODEL_STATES.match(p.name)) and m.group(1) is not None}
    if ranks and sorted(ranks) != list(range(len(ranks))):
        raise DataError(f"{folder}: model-states files of ranks {sorted(ranks)}; stage 3 needs ranks 0..{len(ranks) - 1}")
    return LazyRanks(ranks, lambda p: rank_files.load(p, options, parsed), {0: first} if 0 in ranks else {})


def _state_tensor(file: Path, name: str, state: str, shape: tuple[int, ...] | None, options: ReadOptions, parsed: Shared) -> TensorEntry:
    """One state file as a tensor of the parameter's shape (stage 3 stores it flat); `step` is 0-d."""
    tree, records = open_archive(file, options, DS_GLOBALS, not_zip=None, parsed=parsed)
    ref = tree.get("param") if isinstance(tree, dict) else tree
    if not isinstance(ref, TensorRef):
        raise DataError(f"{file}: holds {type(ref).__name__}, not a tensor ('param')")
    array = stored_array(ref, records, str(file), name)
    want = () if state == "step" else shape if shape is not None else tuple(ref.shape)
    if math.prod(ref.shape) != math.prod(want):
        raise DataError(f"{file}: {math.prod(ref.shape)} elements, but '{name}' has shape {list(want)} ({math.prod(want)} elements)")
    if state == "fp32":
        return TensorEntry(name, ref.dtype, want, "model", _flat_pieces(array, want))
    path = ("optimizer", "state", name, state)
    return TensorEntry(path_name(path), ref.dtype, want, "optimizer", _flat_pieces(array, want), path)


def _flat_pieces(array: Any, shape: tuple[int, ...]) -> list[Piece]:
    """The stored array's elements in row-major order as the whole tensor (a contiguous view of any shape)."""
    if not array.is_contiguous:
        raise DataError(f"{array.path}: a strided view; a universal checkpoint stores each state whole")
    n = math.prod(shape)
    return [Piece(FlatRange(0, n), array, 0)] if n else []


def _group_steps(optim: RankFile | None, shapes: list[Mapping[str, Any]], tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Adam's step for trained parameters that have no step.pt (ds_to_universal's stage-3 path writes none): the
    base optimizer's step of the parameter's flat group, kept in optimizer_state.pt (as the native reader takes it)."""
    state = ((optim.tree.get("optimizer_state_dict") or {}).get("state") or {}) if optim else {}
    out = {}
    for g, group in enumerate(shapes):
        ref = (state.get(g) or {}).get("step") if isinstance(state.get(g), dict) else None
        if not isinstance(ref, TensorRef) or ref.shape:
            continue
        for name in group:
            path = ("optimizer", "state", name, "step")
            if path_name(path) not in tensors and f"optimizer.state.{name}.exp_avg" in tensors:
                assert optim is not None
                out[path_name(path)] = TensorEntry(
                    path_name(path), ref.dtype, (), "optimizer", [Piece(Box((), ()), optim.array(ref))], path
                )
    return out


def _stage(optim: RankFile | None, model: Mapping[str, Any]) -> int | None:
    stage = (optim.tree if optim else {}).get("zero_stage")
    if isinstance(stage, int):
        return int(stage)
    zero = (model.get("ds_config") or {}).get("zero_optimization") or {}
    return zero.get("stage") if isinstance(zero.get("stage"), int) else None


def _param_groups(optim: RankFile | None, shapes: list[Mapping[str, Any]], where: Path) -> list[dict[str, Any]]:
    """The optimizer's param groups with each group's flat-tensor indices (into `param_shapes`) replaced by the names."""
    if optim is None:
        return []
    groups = optim.tree.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise DataError(f"{where}: no param_groups")
    names = [list(s) for s in shapes]
    out = []
    for group in groups:
        params = group.get("params", [])
        if not all(isinstance(i, int) and 0 <= i < len(names) for i in params):
            raise DataError(f"{where}: a param group names flat groups {params!r}; the model states have {len(names)}")
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": [n for i in params for n in names[i]]})
    return out


READER = UniversalReader()
