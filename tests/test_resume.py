"""A run moves between DeepSpeed and FSDP2 (and through ckpt within one) and resumes exactly.

One model and recipe (tests/producers/resume.py) is trained by real DeepSpeed ZeRO-2/3 and real FSDP2
on the CPU. Straight runs train 6 steps and save at step 3; ckpt converts those step-3 checkpoints;
the real frameworks load them (plain `load_checkpoint`; `dcp.load` + `set_state_dict`) and train
steps 3-5. Same framework and world size: the final state is bit-identical to the straight run.
Across frameworks: the loaded fp32 weights and Adam moments equal the source bit for bit (DeepSpeed's
side read by DeepSpeed's own ds_to_universal), step and lr are equal, and the losses of the next
steps agree to float32 rounding of the gradient average (rtol 1e-6).
"""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import DS_CONFIGS, ds_to_universal, torchrun

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,  # FSDP2's recipe does not clip either
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1000,
}
LOSS_RTOL = 1e-6


def cli(*args: str | Path) -> None:
    from ckpt_cli.cli.app import main

    try:
        main([str(a) for a in args] + ["--quiet"])
    except SystemExit as exc:
        assert not exc.code, f"ckpt {' '.join(map(str, args))} exited {exc.code}"


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Path:
    """Straight runs at 2 ranks, ckpt's conversions of their step-3 checkpoints, and the resumed runs."""
    root = tmp_path_factory.mktemp("resume")
    for stage in (2, 3):
        (root / f"ds{stage}.json").write_text(json.dumps({**CONFIG, "zero_optimization": {"stage": stage}}))
    (root / "ds2-bf16.json").write_text(json.dumps({**CONFIG, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    r = lambda name: root / name  # noqa: E731
    torchrun(2, "resume.py", f"ds:2:{r('ds2.json')}:{r('ds2')}", f"ds:3:{r('ds3.json')}:{r('ds3')}", f"fsdp:{r('fsdp')}")
    for stage in (2, 3):
        src = r(f"ds{stage}") / "at3"
        cli("reshard", src, r(f"ds{stage}-reshard"), "--world-size", "2")
        cli("convert", src, r(f"ds{stage}-dcp2"), "--to", "dcp", "--world-size", "2")
        cli(
            "convert",
            r(f"ds{stage}-dcp2"),
            r(f"ds{stage}-back"),
            "--to",
            "deepspeed",
            "--world-size",
            "2",
            "--ds-config",
            r(f"ds{stage}.json"),
        )
        cli("convert", src, r(f"ds{stage}-dcp3"), "--to", "dcp", "--world-size", "3")
    cli("convert", r("ds2") / "at3", r("ds2-to3"), "--to", "deepspeed", "--world-size", "2", "--ds-config", r("ds3.json"))
    fsdp = r("fsdp") / "at3"
    cli("reshard", fsdp, r("fsdp-reshard"), "--world-size", "2")
    cli("convert", fsdp, r("fsdp-ds"), "--to", "deepspeed", "--world-size", "2", "--zero-stage", "2", "--ds-config", r("ds2.json"))
    cli("convert", r("fsdp-ds"), r("fsdp-back"), "--to", "dcp", "--world-size", "2")
    cli("convert", fsdp, r("fsdp-ds3"), "--to", "deepspeed", "--world-size", "3", "--ds-config", r("ds2.json"))
    cli("convert", fsdp, r("fsdp-bf16"), "--to", "deepspeed", "--world-size", "2", "--ds-config", r("ds2-bf16.json"))
    cli("reshard", fsdp, r("fsdp-reshard3"), "--world-size", "3")
    torchrun(
        2,
        "resume.py",
        *(f"ds:{s}:{r(f'ds{s}.json')}:{r(f'ds{s}-{v}-run')}:{r(f'ds{s}-{v}')}" for s in (2, 3) for v in ("reshard", "back")),
        *(f"fsdp:{r(f'fsdp-{v}-run')}:{r(f'fsdp-{v}')}" for v in ("reshard", "back")),
        f"ds:2:{r('ds2-bf16.json')}:{r('fsdp-bf16-run')}:{r('fsdp-bf16')}",
        f"ds:3:{r('ds3.json')}:{r('ds2-to3-run')}:{r('ds2-to3')}",
    )
    torchrun(
        3,
        "resume.py",
        *(f"fsdp:{r(f'ds{s}-dcp3-run')}:{r(f'ds{s}-dcp3')}" for s in (2, 3)),
        f"ds:2:{r('ds2.json')}:{r('fsdp-ds3-run')}:{r('fsdp-ds3')}",
        f"fsdp:{r('fsdp-reshard3-run')}:{r('fsdp-reshard3')}",
    )
    return root


def tensor_leaves(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in tensor_leaves(value, f"{prefix}.{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in tensor_leaves(value, f"{prefix}.{i}").items()}
    return {}


def _partition_padding(shape: torch.Size, world: int, rank: int) -> list[bool]:
    n = math.prod(shape)
    per = -(-n // world)
    held = min(per, max(n - rank * per, 0))
    return [False] * held + [True] * (per - held)


def stage3_padding(model_states: Path, world: int, rank: int) -> dict[str, torch.Tensor]:
    """Masks of the elements of rank's ZeRO-3 partitions that belong to no parameter, by tensor key:
    flat fp32 groups and frozen fragments. DeepSpeed leaves them uninitialised (they never reach a
    parameter); ckpt writes zeros there."""
    states = torch.load(model_states, weights_only=False)
    masks = {}
    for s, group in enumerate(states["param_shapes"]):
        masks[f".optimizer_state_dict.fp32_flat_groups.{s}"] = [
            m for shape in group.values() for m in _partition_padding(shape, world, rank)
        ]
    for name, shape in (states.get("frozen_param_shapes") or {}).items():
        masks[f".frozen_param_fragments.{name}"] = _partition_padding(shape, world, rank)
    return {k: torch.tensor(v, dtype=torch.bool) for k, v in masks.items()}


def assert_same_deepspeed_state(a: Path, b: Path, world: int) -> None:
    """Every tensor of every file of two DeepSpeed saves is bit-identical (ZeRO-3 padding excepted)."""
    files = sorted(Path(p).relative_to(a) for p in glob.glob(f"{a}/*/*.pt"))
    assert files and files == sorted(Path(p).relative_to(b) for p in glob.glob(f"{b}/*/*.pt"))
    for rel in files:
        x = tensor_leaves(torch.load(a / rel, weights_only=False))
        y = tensor_leaves(torch.load(b / rel, weights_only=False))
        assert sorted(x) == sorted(y), rel
        for key in x:
            left, right = x[key], y[key]
            if rel.name.startswith("zero_pp_rank_") and (".fp32_flat_groups." in key or ".frozen_param_fragments." in key):
                rank = int(rel.name.split("_")[3])
                mask = stage3_padding(a / rel.parent / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", world, rank)[key]
                left, right = left[~mask], right[~mask]
            assert left.dtype == right.dtype and torch.equal(left, right), f"{rel}: {key}"


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("via", ["reshard", "back"])
def test_deepspeed_resumes_exactly(runs, stage, via):
    """Straight 6 steps == 3 steps, ckpt (reshard to 2 ranks, or to dcp and back), plain load_checkpoint, 3 steps."""
    straight, resumed = runs / f"ds{stage}" / "final", runs / f"ds{stage}-{via}-run" / "final"
    assert_same_deepspeed_state(straight, resumed, 2)
    if stage == 3 and via == "reshard":  # each rank's own client state (DeepSpeed keeps it per rank at stage 3)
        assert [json.loads((runs / f"ds3-reshard-run/loaded-seen-by-rank{r}.json").read_text()) for r in (0, 1)] == [0, 1]
    assert json.loads((runs / f"ds{stage}-{via}-run/losses.json").read_text()) == json.loads((runs / f"ds{stage}/losses.json").read_text())


@pytest.mark.parametrize("via", ["reshard", "back"])
def test_fsdp2_resumes_exactly(runs, via):
    """Straight 6 steps == 3 steps, ckpt (reshard to 2 ranks, or to DeepSpeed ZeRO-2 and back), dcp.load, 3 steps."""
    want = torch.load(runs / "fsdp/final.pt", weights_only=True)
    got = torch.load(runs / f"fsdp-{via}-run/final.pt", weights_only=True)
    assert sorted(want) == sorted(got)
    for key in want:
        assert got[key] == want[key] if key == "lr" else torch.equal(got[key], want[key]), key
    for rank in (0, 1):  # per-rank values come back to their own ranks
        loaded = json.loads((runs / f"fsdp-{via}-run/loaded-dataloader-rank{rank}.json").read_text())
        assert loaded == {"offset": 6, f"dp_rank_{rank}": {"position": 100 * rank + 3}}
        assert json.loads((runs / f"fsdp-{via}-run/loaded-rng-rank{rank}.json").read_text()) == [rank]


def universal(tag_folder: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer-owned parameters of DeepSpeed's own extraction (ds_to_universal)."""
    return {name: state for name, state in ds_to_universal(tag_folder, out).items() if "exp_avg" in state}


def group_lrs_and_steps(optim_file: Path) -> tuple[list[float], list[float]]:
    """DeepSpeed's base optimizer: each param group's lr and Adam step, as saved."""
    osd = torch.load(optim_file, weights_only=False)["optimizer_state_dict"]
    inner = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
    return [g["lr"] for g in inner["param_groups"]], [float(s["step"]) for s in inner["state"].values()]


def assert_losses_close(got: Path, want: Path) -> None:
    a, b = json.loads(got.read_text()), json.loads(want.read_text())
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=LOSS_RTOL), (a, b)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_to_fsdp2_at_another_world_size(runs, tmp_path, stage):
    """DeepSpeed ZeRO-{2,3} on 2 ranks -> convert --to dcp --world-size 3 -> FSDP2 on 3 ranks."""
    reference = universal(runs / f"ds{stage}/at3/global_step3", tmp_path / "universal")
    loaded = torch.load(runs / f"ds{stage}-dcp3-run/loaded.pt", weights_only=True)
    assert len(reference) == 7
    for name, state in reference.items():
        fp32 = loaded[f"model.{name}"]
        assert torch.equal(fp32, state["fp32"].reshape(fp32.shape)), name
        for key in ("exp_avg", "exp_avg_sq"):
            mine = loaded[f"optim.{name}.{key}"]
            assert torch.equal(mine, state[key].reshape(mine.shape)), (name, key)
        assert float(loaded[f"optim.{name}.step"]) == 3.0, name
    lrs, steps = group_lrs_and_steps(runs / f"ds{stage}/at3/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert loaded["lr"] == lrs and steps == [3.0, 3.0]
    assert torch.equal(loaded["model.head.weight"], loaded["model.embed.weight"])  # the tie survives
    assert_losses_close(runs / f"ds{stage}-dcp3-run/losses.json", runs / f"ds{stage}/losses.json")
    for rank in range(3):
        assert json.loads((runs / f"ds{stage}-dcp3-run/loaded-dataloader-rank{rank}.json").read_text()) == {"offset": 6}


def test_fsdp2_to_deepspeed_at_another_world_size(runs, tmp_path):
    """FSDP2 on 2 ranks -> convert --to deepspeed --world-size 3 --ds-config -> DeepSpeed ZeRO-2 on 3 ranks
    (read back by ds_to_universal from what the loaded engine saves)."""
    source = torch.load(runs / "fsdp/at3.pt", weights_only=True)
    loaded = universal(runs / "fsdp-ds3-run/loaded/global_step3", tmp_path / "universal")
    assert len(loaded) == 7
    for name, state in loaded.items():
        want = source[f"model.{name}"]
        assert torch.equal(state["fp32"].reshape(want.shape), want), name
        for key in ("exp_avg", "exp_avg_sq"):
            want = source[f"optim.{name}.{key}"]
            assert torch.equal(state[key].reshape(want.shape), want), (name, key)
        assert float(state["step"]) == float(source[f"optim.{name}.step"]) == 3.0
    lrs, steps = group_lrs_and_steps(runs / "fsdp-ds3-run/loaded/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert lrs == source["lr"] and steps == [3.0, 3.0]
    written = torch.load(runs / "fsdp-ds3/global_step3/mp_rank_00_model_states.pt", weights_only=False)
    assert written["shared_params"] == {"head.weight": "embed.weight"}  # found by equal bytes
    assert list(written["frozen_param_shapes"]) == ["frozen.weight", "frozen.bias"] and written["buffer_names"] == ["scale"]
    assert_losses_close(runs / "fsdp-ds3-run/losses.json", runs / "fsdp/losses.json")
    # Per-rank values under 3 ranks, rule 'wrap': rank 2 takes rank 0's; DeepSpeed hands every rank the client state.
    loaded_client = json.loads((runs / "fsdp-ds3-run/loaded-dataloader-rank0.json").read_text())
    assert loaded_client == {"offset": 6, **{f"dp_rank_{r}": {"position": 100 * (r % 2) + 3} for r in range(3)}}


def test_deepspeed_stage_change(runs, tmp_path):
    """ZeRO-2 -> convert --to deepspeed --ds-config (stage 3) -> a ZeRO-3 engine loads the same state and trains on."""
    before = universal(runs / "ds2/at3/global_step3", tmp_path / "before")
    after = universal(runs / "ds2-to3-run/loaded/global_step3", tmp_path / "after")
    assert sorted(before) == sorted(after) and len(before) == 7
    for name in before:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after[name][key].flatten(), before[name][key].flatten()), (name, key)
    assert_losses_close(runs / "ds2-to3-run/losses.json", runs / "ds2/losses.json")


def test_fsdp2_to_deepspeed_bf16(runs, tmp_path):
    """The precision comes from --ds-config: a bf16 ZeRO-2 engine loads the fp32 masters and moments exactly
    (its module weights are their bf16 casts) and trains on, close to the fp32 run."""
    source = torch.load(runs / "fsdp/at3.pt", weights_only=True)
    loaded = universal(runs / "fsdp-bf16-run/loaded/global_step3", tmp_path / "universal")
    for name, state in loaded.items():
        for key, prefix in (("fp32", "model"), ("exp_avg", "optim"), ("exp_avg_sq", "optim")):
            want = source[f"{prefix}.{name}" if key == "fp32" else f"optim.{name}.{key}"]
            assert torch.equal(state[key].reshape(want.shape), want), (name, key)
    module = torch.load(runs / "fsdp-bf16/global_step3/mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module["block.0.weight"].dtype == torch.bfloat16
    assert torch.equal(module["block.0.weight"], source["model.block.0.weight"].to(torch.bfloat16))
    got = json.loads((runs / "fsdp-bf16-run/losses.json").read_text())
    want = json.loads((runs / "fsdp/losses.json").read_text())
    assert all(math.isclose(a, b, rel_tol=0.05) for a, b in zip(got, want)), (got, want)


def test_dcp_reshard_applies_the_per_rank_rule(runs, ckpt, tmp_path):
    for rank in range(3):  # FSDP2 on 3 ranks, each reading its own dp_rank_R (rank 2 wraps to rank 0)
        loaded = json.loads((runs / f"fsdp-reshard3-run/loaded-dataloader-rank{rank}.json").read_text())
        assert loaded == {"offset": 6, f"dp_rank_{rank}": {"position": 100 * (rank % 2) + 3}}
        assert json.loads((runs / f"fsdp-reshard3-run/loaded-rng-rank{rank}.json").read_text()) == [rank % 2]
    res = ckpt("reshard", runs / "fsdp/at3", tmp_path / "first", "--world-size", "3", "--per-rank-state", "first")
    assert res.code == 0 and "per-rank state dataloader.dp_rank_{}.position, rng.rank_{} (2 ranks -> 3): rule 'first'" in res.err
    doc = json.loads(ckpt("inspect", tmp_path / "first", "--json").out)
    assert doc["training_state"]["dataloader"]["dp_rank_2.position"] == 3
    res = ckpt("reshard", runs / "fsdp/at3", tmp_path / "drop", "--world-size", "3", "--per-rank-state", "drop")
    assert res.code == 0 and "left out" in res.err
    doc = json.loads(ckpt("inspect", tmp_path / "drop", "--json").out)
    assert doc["training_state"]["dataloader"] == {"offset": 6}


def test_dcp_from_deepspeed_has_fsdp2s_layout(runs):
    """Same keys, shapes, dtypes and chunks as FSDP2 + get_state_dict saves for the same model on 2 ranks."""
    from torch.distributed.checkpoint import FileSystemReader

    def layout(path: Path) -> dict[str, object]:
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        out: dict[str, object] = {}
        for key, md in meta.items():
            if key.startswith(("model.", "optim.")):
                chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] if hasattr(md, "chunks") else None
                out[key] = (tuple(md.size), md.properties.dtype, sorted(chunks)) if chunks is not None else "bytes"
        return out

    assert layout(runs / "ds2-dcp2") == layout(runs / "fsdp/at3")


@pytest.mark.parametrize("src", ["ds2-dcp3", "fsdp-ds3"])
def test_inspect_shows_carried_training_state(runs, ckpt, src):
    doc = json.loads(ckpt("inspect", runs / src, "--json").out)
    state = doc["training_state"]
    assert doc["step"] == 3
    assert state["optimizer"]["states"] == ["exp_avg", "exp_avg_sq", "step"] and state["optimizer"]["param_groups"] == 2
    assert state["lr_scheduler"]["last_epoch"] == 3
    assert state["dataloader"]["offset"] == 6


def test_torchtitan_layout_round_trip(runs, ckpt, tmp_path):
    """--layout torchtitan: model keys at the top, optimizer flattened per parameter; read back, detected, and
    converted to DeepSpeed it gives the very files the get_state_dict layout gives."""
    res = ckpt("convert", runs / "ds2/at3", tmp_path / "titan", "--to", "dcp", "--world-size", "2", "--layout", "torchtitan")
    assert res.code == 0, res.err
    doc = json.loads(ckpt("inspect", tmp_path / "titan", "--json").out)
    names = {t["name"] for t in doc["tensors"]}
    assert "embed.weight" in names and "optimizer.state.embed.weight.exp_avg" in names and doc["details"]["key_layout"] == "torchtitan"
    config = runs / "ds2.json"
    for name, src in (("a", tmp_path / "titan"), ("b", runs / "ds2-dcp2")):
        res = ckpt("convert", src, tmp_path / name, "--to", "deepspeed", "--world-size", "2", "--ds-config", config)
        assert res.code == 0, res.err
    files = sorted((tmp_path / "a").rglob("*.pt"))
    assert len(files) == 3
    for f in files:  # the same trees (pickle memo sharing of equal values may differ byte-wise)
        a = torch.load(f, weights_only=False)
        b = torch.load(tmp_path / "b" / f.relative_to(tmp_path / "a"), weights_only=False)
        assert plain(a) == plain(b), f


def plain(tree: object) -> object:
    """A comparable copy: tensors as (dtype, shape, bytes), DeepSpeed objects as their attributes."""
    if isinstance(tree, torch.Tensor):
        return str(tree.dtype), tuple(tree.shape), tree.contiguous().view(-1).view(torch.uint8).tolist()
    if isinstance(tree, dict):
        return {k: plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [plain(v) for v in tree]
    if hasattr(tree, "__dict__"):
        return type(tree).__name__, plain(vars(tree))
    return tree


def test_real_torchtitan_layout(runs, ckpt, tmp_path):
    """A DCP save in torchtitan's layout (real FSDP2, flatten_optimizer_state_dict=True) is detected, converts to the
    same DeepSpeed checkpoint as the get_state_dict save of the same state, and ckpt's own torchtitan output has its keys."""
    titan = runs / "fsdp/at3-torchtitan"
    doc = json.loads(ckpt("inspect", titan, "--json").out)
    assert doc["details"]["key_layout"] == "torchtitan" and doc["step"] == 3  # train_state.step
    optimizer = doc["training_state"]["optimizer"]
    assert optimizer["states"] == ["exp_avg", "exp_avg_sq", "step"] and optimizer["param_groups"] == 2
    assert doc["training_state"]["client_state"] is None
    res = ckpt("convert", titan, tmp_path / "ds", "--to", "deepspeed", "--world-size", "2", "--ds-config", runs / "ds2.json")
    assert res.code == 0, res.err
    for f in sorted((runs / "fsdp-ds").rglob("*.pt")):
        got = torch.load(tmp_path / "ds" / f.relative_to(runs / "fsdp-ds"), weights_only=False)
        want = torch.load(f, weights_only=False)
        for tree in (got, want):  # the get_state_dict save also holds the dataloader and per-rank RNG
            tree.pop("dataloader", None), tree.pop("rng", None)
        assert plain(got) == plain(want), f
    assert ckpt("convert", titan, tmp_path / "titan3", "--to", "dcp", "--world-size", "2", "--layout", "torchtitan").code == 0
    assert ckpt("convert", runs / "ds2/at3", tmp_path / "ours", "--to", "dcp", "--world-size", "2", "--layout", "torchtitan").code == 0
    from torch.distributed.checkpoint import FileSystemReader

    def keys(path: Path) -> set[str]:  # the saved state, without the client's dataloader and rank marks
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k for k in meta if not k.startswith(("dataloader", "seen_by_rank"))}

    assert keys(tmp_path / "ours") == keys(titan) == keys(tmp_path / "titan3")


def test_name_mapping(runs, ckpt, tmp_path):
    """Renames apply to weights, optimizer state and param groups alike, shown by --dry-run; a YAML map adds ties."""
    res = ckpt("convert", runs / "ds2/at3", tmp_path / "wrapped", "--to", "dcp", "--world-size", "2", "--rename", "^=_orig_mod.module.")
    assert res.code == 0, res.err
    doc = json.loads(ckpt("inspect", tmp_path / "wrapped", "--json").out)
    assert "model._orig_mod.module.embed.weight" in {t["name"] for t in doc["tensors"]}
    name_map = tmp_path / "names.yaml"
    name_map.write_text("rename:\n  - {from: '^module\\.', to: ''}\ntied:\n  head.weight: embed.weight\n")
    args = ["convert", tmp_path / "wrapped", tmp_path / "ds", "--to", "deepspeed", "--world-size", "2", "--ds-config", runs / "ds2.json"]
    res = ckpt(*args, "--name-map", name_map, "--dry-run")
    assert res.code == 0 and "drop segments _orig_mod" in res.out and "rename /^module\\./" in res.out and "tie head.weight" in res.out
    assert ckpt(*args, "--name-map", name_map).code == 0
    model = torch.load(tmp_path / "ds/global_step3/mp_rank_00_model_states.pt", weights_only=False)
    assert model["shared_params"] == {"head.weight": "embed.weight"} and "embed.weight" in model["param_shapes"][0]
    assert "head.weight" not in model["frozen_param_shapes"]


# Refused cross-framework calls: (source, extra arguments, what the one-line error must say). Sources and files by
# placeholder: FSDP and DS are runs of the resume fixture, TORCH a torch file without optimizer, FP16/AUTO/DS2/NONE configs.
TO_DS = ("--to", "deepspeed", "--world-size", "2")
TO_DCP = ("--to", "dcp", "--world-size", "2")
REFUSALS = {
    "no-stage": ("FSDP", TO_DS, "--zero-stage"),
    "fp16-target": ("FSDP", (*TO_DS, "--ds-config", "FP16"), "fp16"),
    "auto-config": ("FSDP", (*TO_DS, "--ds-config", "AUTO"), '"auto"'),
    "stage-disagrees": ("FSDP", (*TO_DS, "--zero-stage", "3", "--ds-config", "DS2"), "disagrees"),
    "no-optimizer": ("TORCH", (*TO_DS, "--zero-stage", "2"), "no optimizer state"),
    "bad-layout": ("DS", (*TO_DCP, "--layout", "megatron"), "--layout"),
    "bad-regex": ("DS", (*TO_DCP, "--rename", "(=x"), "bad regular expression"),
    "bad-group": ("DS", (*TO_DCP, "--rename", "(embed)=\\2"), "invalid group"),
    "select-with-state": ("DS", (*TO_DCP, "--filter", "embed*", "--layout", "torchtitan"), "--filter"),
    "missing-name-map": ("DS", (*TO_DCP, "--name-map", "NONE"), "name map"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(runs, ckpt, tmp_path, mixed_files, case):
    fp16 = tmp_path / "fp16.json"
    fp16.write_text(json.dumps({**CONFIG, "zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}))
    auto = tmp_path / "auto.json"  # as Hugging Face Trainer configs leave them
    auto.write_text(json.dumps({**CONFIG, "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}))
    files = {
        "FSDP": runs / "fsdp/at3",
        "DS": runs / "ds2/at3",
        "TORCH": mixed_files["torch"],
        "FP16": fp16,
        "AUTO": auto,
        "DS2": runs / "ds2.json",
        "NONE": tmp_path / "none.yaml",
    }
    source, extra, needle = REFUSALS[case]
    x = tmp_path / "x"
    res = ckpt("convert", files[source], x, *(files.get(a, a) for a in extra))
    assert res.code == 2 and needle in res.err and "Traceback" not in res.err, res.err
    assert not x.exists()


def test_verify_against_across_frameworks(runs, ckpt):
    """verify --against matches one run's tensors by parameter name across DeepSpeed and DCP key layouts."""
    res = ckpt("verify", runs / "ds2-dcp3", "--against", runs / "ds2/at3")
    assert res.code == 0 and "by parameter name (deepspeed vs get_state_dict key layouts)" in res.out, res.out + res.err
    res = ckpt("verify", runs / "fsdp-ds3", "--against", runs / "fsdp/at3", "--json")
    assert res.code == 0, res.out
    res = ckpt("verify", runs / "ds2-dcp3", "--against", runs / "ds2/final")  # three steps later
    assert res.code == 1 and "tensor 'optimizer.state.embed.weight.exp_avg': values differ" in res.out + res.err


@pytest.mark.parametrize("config", DS_CONFIGS)
def test_every_deepspeed_variant_round_trips_through_dcp(ds_saves, ckpt, tmp_path, config):
    """Every stage and precision (BF16_Optimizer, round robin too) -> dcp at 3 ranks: the same weights and optimizer
    state by parameter name; and back to DeepSpeed at 2 ranks with the run's own config: the same again."""
    src = ds_saves[2] / config
    res = ckpt("convert", src, tmp_path / "dcp", "--to", "dcp", "--world-size", "3")
    assert res.code == 0, res.err
    res = ckpt("verify", tmp_path / "dcp", "--against", src)
    assert res.code == 0 and "by parameter name" in res.out, res.out
    if config == "stage1-bf16acc32":  # the BF16_Optimizer is not a target
        return
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(
        json.dumps(
            torch.load(
                src / "global_step3/mp_rank_00_model_states.pt"
                if "stage3" not in config
                else src / "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt",
                weights_only=False,
            )["ds_config"]
        )
    )
    names = tmp_path / "names.yaml"
    names.write_text("tied: {head.weight: embed.weight}\n")  # DCP does not record ties; the name map does
    args = ("--to", "deepspeed", "--world-size", "2", "--ds-config", ds_config, "--name-map", names)
    res = ckpt("convert", tmp_path / "dcp", tmp_path / "back", *args)
    assert res.code == 0, res.err
    doc = json.loads(ckpt("verify", tmp_path / "back", "--against", src, "--json").out)
    assert doc["ok"], doc["problems"]


def test_deepspeed_reshard_applies_the_per_rank_rule(runs, ckpt, tmp_path):
    """Client state with per-rank keys (here from FSDP2's dataloader) follows --per-rank-state in a DeepSpeed reshard."""
    res = ckpt("reshard", runs / "fsdp-ds", tmp_path / "ds3", "--world-size", "3")
    assert res.code == 0 and "per-rank state dataloader.dp_rank_{}.position, rng.rank_{} (2 ranks -> 3): rule 'wrap'" in res.err
    tree = torch.load(tmp_path / "ds3/global_step3/mp_rank_00_model_states.pt", weights_only=False)
    assert tree["dataloader"]["dp_rank_2"] == {"position": 3} and torch.equal(tree["rng"]["rank_2"], tree["rng"]["rank_0"])
    res = ckpt("reshard", runs / "fsdp-ds", tmp_path / "drop", "--world-size", "3", "--per-rank-state", "drop")
    tree = torch.load(tmp_path / "drop/global_step3/mp_rank_00_model_states.pt", weights_only=False)
    assert res.code == 0 and tree["dataloader"] == {"offset": 6} and "rng" not in tree


def test_per_rank_keys_are_data_parallel_ranks_only():
    from ckpt_cli.core.model import ObjectEntry
    from ckpt_cli.core.training import apply_per_rank_rule

    def entry(*path):
        return ObjectEntry(".".join(path), path[-1], path=path)

    names = [("rng", "rank_0"), ("rng", "rank_1"), ("cfg", "lora_rank_16"), ("tp_rank_0",), ("x", "rank_00"), ("x", "rank_01")]
    entries = [entry(*p) for p in names] + [entry("gap", "rank_1")]
    out, note = apply_per_rank_rule(entries, 3, "wrap")
    assert note == "per-rank state rng.rank_{}, x.rank_{} (2 ranks -> 3): rule 'wrap': new rank r takes old rank r mod 2"
    paths = {e.path for e in out}
    assert ("rng", "rank_2") in paths and ("x", "rank_02") in paths  # zero padding kept
    assert {("cfg", "lora_rank_16"), ("tp_rank_0",), ("gap", "rank_1")} <= paths and len(out) == 9
    assert apply_per_rank_rule(entries, 2, "wrap") == (entries, None)
