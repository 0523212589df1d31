"""DeepSpeed ZeRO: checkpoints saved by real DeepSpeed (CPU, gloo, torchrun); exports checked against
DeepSpeed's own zero_to_fp32, its public fp32 API, ds_to_universal and transformers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import DS_CONFIGS, Evil, assert_fails, assert_same_tensors, ds_to_universal
from safetensors.torch import load_file

from ckpt_cli.core.reading import SourceFiles, read_elements
from ckpt_cli.ops.source import open_checkpoint

ZERO_CONFIGS = [c for c in DS_CONFIGS if not c.endswith("acc32")]  # zero_to_fp32 refuses BF16_Optimizer checkpoints


def zero_to_fp32(path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        sd = get_fp32_state_dict_from_zero_checkpoint(str(path))
    return {k: v.contiguous() for k, v in sd.items()}


def logical(ckpt, name):
    t = ckpt.tensors[name]
    return read_elements(t, 0, t.numel, SourceFiles()).reshape(t.shape)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("config", ZERO_CONFIGS)
def test_weights_export_equals_zero_to_fp32(ckpt, ds_saves, tmp_path, world, config):
    src = ds_saves[world] / config
    res = ckpt("merge", src, tmp_path / "w.pt", "-q")
    assert res.code == 0, res.err
    ours = torch.load(tmp_path / "w.pt", weights_only=True)
    reference = zero_to_fp32(src)
    if config.startswith("stage1"):
        # Stage 1 saves no frozen_param_* keys and zero_to_fp32 silently drops frozen params; ckpt takes them from `module`.
        assert sorted(set(ours) - set(reference)) == ["frozen.bias", "frozen.weight"]
        module = torch.load(next((src / "global_step3").glob("mp_rank_00_model_states.pt")), weights_only=False)["module"]
        for name in ("frozen.weight", "frozen.bias"):
            assert torch.equal(ours.pop(name), module[name])
    assert_same_tensors(ours, reference)
    assert ours["head.weight"].data_ptr() == ours["embed.weight"].data_ptr()  # the tied alias stays tied in a .pt
    res = ckpt("merge", src, tmp_path / "w.safetensors", "-q")
    assert res.code == 0
    st = load_file(tmp_path / "w.safetensors")
    assert "head.weight" not in st and torch.equal(st["embed.weight"], reference["embed.weight"])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("config", [c for c in DS_CONFIGS if not c.endswith("rr")])
def test_fp32_master_equals_deepspeeds_own_view(ds_saves, world, config):
    """Every trainable parameter equals deepspeed.utils.safe_get_full_fp32_param at save time (BF16_Optimizer too).
    Not under round_robin_gradients: that API maps params by original-order offsets into the round-robin flat buffer
    (mixed_precision_linkage.py, docs/formats.md §2.6 step 8) and returns other params' values at W > 1; zero_to_fp32 agrees
    with ckpt there (test_weights_export_equals_zero_to_fp32)."""
    src = ds_saves[world] / config
    ckpt = open_checkpoint(src)
    reference = torch.load(src / "reference.pt", weights_only=True)
    for name, value in reference.items():
        assert torch.equal(logical(ckpt, name), value), name


@pytest.mark.parametrize("config", ["stage1-fp32", "stage2-bf16", "stage3-fp32", "stage3-bf16"])
def test_moments_equal_ds_to_universal(ds_saves, tmp_path, config):
    """Per-parameter fp32, exp_avg, exp_avg_sq and step equal DeepSpeed's universal-checkpoint extraction."""
    src = ds_saves[2] / config
    reference = ds_to_universal(src / "global_step3", tmp_path / "universal")
    ckpt = open_checkpoint(src)
    compared = 0
    for param, state in reference.items():
        for key, ref in state.items():
            if key == "fp32" and (ref.dtype != torch.float32 or "exp_avg" not in state):
                # Only optimizer-owned params have a master there: bf16 runs store the 16-bit module weight for
                # frozen params and tied aliases (zero_to_fp32, which ckpt matches, maps an alias to its owner).
                continue
            name = param if key == "fp32" else f"optimizer.state.{param}.{key}"
            ours = logical(ckpt, name)
            assert torch.equal(ours, ref.reshape(ours.shape).to(ours.dtype)), name
            compared += 1
    assert compared >= 7 * 3


def test_inspect_deepspeed(ckpt, ds_saves):
    doc = json.loads(ckpt("inspect", ds_saves[3] / "stage3-bf16", "--json").out)
    assert doc["format"] == "deepspeed" and doc["world_size"] == 3 and doc["step"] == 3 and doc["tag"] == "global_step3"
    details = doc["details"]
    assert details["zero_stage"] == 3 and details["precision"] == "bf16" and details["partition_count"] == 3
    assert details["param_groups"] == 2 and details["optimizer_wrapper"] == "DeepSpeedZeroOptimizer_Stage3"
    state = doc["training_state"]
    assert state["optimizer"]["kind"] == "Adam/AdamW" and state["optimizer"]["param_groups"] == 2
    assert state["dataloader"] == {"offset": 18} and state["lr_scheduler"]["last_batch_iteration"] == 2
    roles = {t["name"]: t["role"] for t in doc["tensors"]}
    assert roles["embed.weight"] == "model" and roles["optimizer.state.embed.weight.exp_avg"] == "optimizer"
    shapes = {t["name"]: t["shape"] for t in doc["tensors"]}
    assert shapes["block.0.weight"] == [29, 12] and shapes["scale"] == [12] and shapes["frozen.weight"] == [7, 12]
    bf16opt = json.loads(ckpt("inspect", ds_saves[2] / "stage1-bf16acc32", "--json").out)
    assert bf16opt["details"]["optimizer_wrapper"] == "BF16_Optimizer"


def test_reading_needs_neither_deepspeed_nor_torch(ds_saves):
    code = (
        "import sys; from ckpt_cli.ops.inspect import summary; from ckpt_cli.ops.source import open_checkpoint; "
        f"summary(open_checkpoint({str(ds_saves[2] / 'stage2-bf16')!r})); "
        "assert 'deepspeed' not in sys.modules and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_deepspeed_trained_transformer_loads_with_from_pretrained(ckpt, ds_saves, tmp_path):
    from transformers import LlamaForCausalLM

    src = ds_saves[2] / "llama"
    out = tmp_path / "release"
    assert ckpt("convert", src, out, "--to", "hf", "--max-shard-size", "40KB", "-q").code == 0
    for f in (ds_saves[2] / "llama_config").iterdir():
        shutil.copy(f, out / f.name)
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same_tensors(model.state_dict(), zero_to_fp32(src))


# ---- verify: broken checkpoints --------------------------------------------------------------


@pytest.fixture
def copy_s2(ds_saves, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(ds_saves[2] / "stage2-fp32", dest)
    return dest


def test_verify_passes_every_fixture(ckpt, ds_saves):
    for world in (1, 2, 3):
        for config in DS_CONFIGS:
            res = ckpt("verify", ds_saves[world] / config, "--deep")
            assert res.code == 0, res.out + res.err


def test_verify_missing_rank_file(ckpt, copy_s2):
    (copy_s2 / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert_fails(ckpt("verify", copy_s2), "partition_count is 2", "rank 1")


def test_verify_truncated_pt(ckpt, copy_s2):
    path = copy_s2 / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.truncate(path, path.stat().st_size - 100)
    assert_fails(ckpt("verify", copy_s2), path.name)


def test_verify_deep_flipped_byte(ckpt, copy_s2):
    from ckpt_cli.core.pickles.zipio import read_records

    path = copy_s2 / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(path, "rb") as f:
        rec = max(read_records(f, path.name).values(), key=lambda r: r.size)
    data = bytearray(path.read_bytes())
    data[rec.data_offset + rec.size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert ckpt("verify", copy_s2).code == 0
    assert_fails(ckpt("verify", copy_s2, "--deep"), path.name, "CRC32")


def test_verify_latest_names_missing_tag(ckpt, copy_s2):
    (copy_s2 / "latest").write_text("global_step9")
    assert_fails(ckpt("verify", copy_s2), "latest", "global_step9")


def test_verify_newer_tag_without_latest(ckpt, copy_s2):
    shutil.copytree(copy_s2 / "global_step3", copy_s2 / "global_step6")
    (copy_s2 / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert_fails(ckpt("verify", copy_s2), "global_step6", "did not finish")
    assert ckpt("verify", copy_s2, "--tag", "global_step3").code == 0


def test_verify_rank_files_disagree(ckpt, copy_s2):
    path = copy_s2 / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = torch.load(path, weights_only=False)
    state["optimizer_state_dict"]["zero_stage"] = 1
    torch.save(state, path)
    assert_fails(ckpt("verify", copy_s2), "disagree", "zero_stage")


def test_malicious_pt_is_refused_and_never_runs(ckpt, copy_s2, tmp_path):
    marker = tmp_path / "pwned"
    path = copy_s2 / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    state["client"] = Evil(marker)
    torch.save(state, path)
    for args in (["inspect", copy_s2], ["verify", copy_s2], ["merge", copy_s2, tmp_path / "m.safetensors"]):
        assert_fails(ckpt(*args), "posix.system", "--trust-pickle")
    assert not marker.exists() and not (tmp_path / "m.safetensors").exists()


# ---- reshard: real DeepSpeed at the new world size loads it --------------------------------------

RESHARDS = [(2, 1), (1, 2), (2, 3), (3, 2)]


@pytest.fixture(scope="session")
def ds_resumed(ds_saves, tmp_path_factory):
    """Every config resharded N->M, loaded by DeepSpeed at M (plain load_checkpoint), saved again at once and
    trained 2 more steps; beside it each original continued at its own N. One torchrun launch per world size."""
    from conftest import ckpt_quiet, torchrun

    root = tmp_path_factory.mktemp("ds_resumed")
    tasks: dict[int, list[str]] = {1: [], 2: [], 3: []}
    for config in DS_CONFIGS:
        for src, dst in RESHARDS:
            resharded = root / f"{config}-{src}to{dst}"
            ckpt_quiet("reshard", ds_saves[src] / config, resharded, "--world-size", dst)
            tasks[dst].append(f"{resharded}:{config}:{root / 'resumed' / f'{config}-{src}to{dst}'}")
        for world in (1, 2, 3):
            tasks[world].append(f"{ds_saves[world] / config}:{config}:{root / 'resumed' / f'{config}-{world}'}")
    for world, items in tasks.items():
        torchrun(world, "deepspeed_train.py", "resume", *items, timeout=900)
    return root / "resumed"


def all_tensors(path):
    ckpt = open_checkpoint(path)
    return ckpt, {name: logical(ckpt, name) for name in ckpt.tensors}


@pytest.mark.parametrize("src,dst", RESHARDS)
@pytest.mark.parametrize("config", DS_CONFIGS)
def test_reshard_loads_in_deepspeed_and_resaves_identically(ds_saves, ds_resumed, config, src, dst):
    """DeepSpeed at M loads the resharded checkpoint with plain load_checkpoint; its immediate re-save holds the same
    fp32 master weights, exp_avg, exp_avg_sq and step (bit for bit), LR scheduler, global steps and client state."""
    assert_resaved_state(ds_saves[src] / config, ds_resumed / f"{config}-{src}to{dst}" / "resaved", dst)


def assert_resaved_state(original, resaved_dir, world):
    """What DeepSpeed re-saved at `world` right after loading holds the original's fp32 master weights, exp_avg,
    exp_avg_sq and step (bit for bit), ZeRO stage, LR scheduler, global steps, client state and group hyper-parameters."""
    source, before = all_tensors(original)
    resaved, after = all_tensors(resaved_dir)
    assert resaved.world_size == world and resaved.details["zero_stage"] == source.details["zero_stage"]
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    for key in ("lr_scheduler.last_batch_iteration", "global_steps", "dataloader.offset"):
        assert resaved.objects[key].value == source.objects[key].value, key
    groups = source.objects["optimizer.param_groups"].value
    assert [g["weight_decay"] for g in resaved.objects["optimizer.param_groups"].value] == [g["weight_decay"] for g in groups]


@pytest.mark.parametrize("src,dst", RESHARDS)
@pytest.mark.parametrize("config", DS_CONFIGS)
def test_training_continues_after_reshard(ds_resumed, config, src, dst):
    """Two more steps at M from the resharded checkpoint match two steps at N from the original. Tolerance: the
    gradient all-reduce sums in another order at another world size; bf16 runs round weights to 8 bits of mantissa."""
    ours_dir, reference_dir = ds_resumed / f"{config}-{src}to{dst}", ds_resumed / f"{config}-{src}"
    if config in ZERO_CONFIGS:  # the weights DeepSpeed saved after the two steps, read back by zero_to_fp32
        ours, reference = zero_to_fp32(ours_dir / "after"), zero_to_fp32(reference_dir / "after")
    else:  # BF16_Optimizer, which zero_to_fp32 refuses: DeepSpeed's safe_get_full_fp32_param after the steps
        ours, reference = (torch.load(d / "after.pt", weights_only=True) for d in (ours_dir, reference_dir))
    tolerance = 1e-5 if "fp32" in config else 1e-3
    for name, value in reference.items():
        assert torch.allclose(ours[name], value, rtol=0, atol=tolerance), (name, float((ours[name] - value).abs().max()))


def test_tensor_parallel_save_is_refused_with_what_would_make_it_readable(ckpt, ds_saves, tmp_path):
    """mp_rank_01 files hold a second tensor-parallel rank's slices under the same names; without DeepSpeed's
    universal-checkpoint patterns nothing says along which dimension each tensor was split."""
    src = tmp_path / "tp2"
    shutil.copytree(ds_saves[2] / "stage2-fp32", src)
    tag = next(p for p in src.iterdir() if p.is_dir())
    for f in list(tag.iterdir()):
        shutil.copy(f, tag / f.name.replace("mp_rank_00", "mp_rank_01"))
    res = ckpt("inspect", src)
    assert res.code == 2 and "tensor-parallel checkpoint (2 mp_rank files)" in res.err and "universal_checkpoint_info" in res.err
    assert "Traceback" not in res.err


@pytest.mark.parametrize("config", ["stage2-fp32", "stage3-fp32"])
def test_inspect_parses_one_optimizer_file_checks_the_others_and_one_model_states(ds_saves, config, monkeypatch):
    """inspect parses rank 0's optimizer file (it tells the layout) and checks each other's without building it (a
    hostile pickle in any of them is refused, never passed over), parses one model-states file (stage 3 repeats the
    module description on every rank), and makes no pieces: it counts them from the partition arithmetic, as many as
    the full read makes."""
    import ckpt_cli
    from ckpt_cli.formats.deepspeed import rank_files

    parsed: list[str] = []
    checked: list[str] = []
    real_load, real_check = rank_files.load, rank_files.check
    monkeypatch.setattr(rank_files, "load", lambda path, *a, **k: parsed.append(path.name) or real_load(path, *a, **k))
    monkeypatch.setattr(rank_files, "check", lambda path, *a, **k: checked.append(path.name) or real_check(path, *a, **k))
    doc = ckpt_cli.inspect(ds_saves[2] / config)
    models = [n for n in parsed if "model_states" in n]
    assert [n for n in parsed if "optim_states" in n] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert checked == ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert models == ["zero_pp_rank_0_mp_rank_00_model_states.pt" if config.startswith("stage3") else "mp_rank_00_model_states.pt"]
    parsed.clear()
    full = open_checkpoint(ds_saves[2] / config)
    assert doc["num_tensors"] == len(full.tensors)
    assert [t["pieces"] for t in doc["tensors"]] == [len(t.pieces) for t in full.tensors.values()]  # counted, then made
    assert [p for t in full.tensors.values() for p in t.pieces]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in parsed  # pieces, once made, parse the file they lie in


def test_a_stage2_layout_parses_each_rank_file_once_a_group_and_keeps_none(ds_saves, monkeypatch):
    """The pieces of every parameter and moment of a group parse each rank's optimizer file once, for all the group's
    keys, and do not keep it (1,024 parsed rank files of a 20,000-parameter model held 16 MB); nor does verify."""
    from ckpt_cli.formats.deepspeed import rank_files
    from ckpt_cli.ops.structure import format_check

    parsed: list[str] = []
    real = rank_files.load
    monkeypatch.setattr(rank_files, "load", lambda path, *a, **k: parsed.append(path.name) or real(path, *a, **k))
    ckpt = open_checkpoint(ds_saves[3] / "stage2-fp32")
    groups = len(ckpt.source.layout.shapes)
    assert [p for t in ckpt.tensors.values() for p in t.pieces]
    for rank in (1, 2):
        assert 1 <= parsed.count(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") <= groups
    assert set(ckpt.source.optims.loaded) == {0}
    assert format_check(ckpt, False) == [] and set(ckpt.source.optims.loaded) == {0}


def test_rank_files_share_what_they_repeat(ds_saves):
    """Every ZeRO-1/2 rank file repeats param_alignment_paddings (a zero per param: 160 KB a rank of a 20,000-param
    model, 1,024 ranks): the read keeps one list, the first rank's, and what differs per rank stays each rank's own."""
    from ckpt_cli.core.tree import share_equal

    src = open_checkpoint(ds_saves[3] / "stage2-fp32").source
    osds = [src.optims[r].tree["optimizer_state_dict"] for r in range(3)]
    assert osds[1]["param_alignment_paddings"] is osds[0]["param_alignment_paddings"] is osds[2]["param_alignment_paddings"]
    assert osds[1]["param_slice_mappings"] != osds[0]["param_slice_mappings"]  # each rank's own
    assert osds[1]["single_partition_of_fp32_groups"] is not osds[0]["single_partition_of_fp32_groups"]  # tensor refs: never
    values, like = {"same": [[0, 0], [1]], "other": [0, 1], "refs": [object()], "text": "a"}, {"same": [[0, 0], [1]], "other": [0]}
    like["refs"] = values["refs"][:]
    share_equal(values, like)
    assert values["same"] is like["same"] and values["other"] == [0, 1] and values["refs"] is not like["refs"]
    # equal is not enough: the same types too (True == 1 == 1.0), and no subclass of a plain type
    size = type("Size", (tuple,), {})
    values = {"bools": [True, 0], "floats": [1.0, 0], "sizes": [size((2, 3))], "nested": [[0, (1, "a")]], "nan": [float("nan")]}
    like = {"bools": [1, 0], "floats": [1, 0], "sizes": [(2, 3)], "nested": [[0, (1, "a")]], "nan": [float("nan")]}
    share_equal(values, like)
    assert [k for k in values if values[k] is like[k]] == ["nested"]  # NaN != NaN: not equal, not shared
    assert type(values["bools"][0]) is bool and type(values["floats"][0]) is float and type(values["sizes"][0]) is size
    # inside nested dicts too (base_optimizer_state's param_groups: a list of dicts), their own dicts left as they are
    values = {"base": {"groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "state": {0: [1]}, "mine": [2.0]}}
    like = {"base": {"groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "state": {0: [1]}, "mine": [2]}}
    share_equal(values, like)
    assert values["base"] is not like["base"] and values["base"]["groups"] is like["base"]["groups"]
    assert values["base"]["state"][0] is like["base"]["state"][0] and values["base"]["mine"] is not like["base"]["mine"]


@pytest.mark.parametrize("config", ["stage2-fp32", "stage3-fp32"])
def test_rank_files_leave_the_shared_template_as_it_was(ds_saves, tmp_path, config):
    """Each new rank's optimizer file is made from one template of the source's tree (tensorized once); what a rank
    rewrites is its own copy, so files made side by side in threads never see another rank's entries."""
    import ckpt_cli

    request = ckpt_cli.convert_request(ds_saves[2] / config, tmp_path / "out", to="deepspeed", world_size=3)
    built = [f for f in ckpt_cli.prepare(request).job.plan.files if f.build is not None and "optim_states" in f.relpath]
    built[0].build()
    make = built[0].build  # stage 1/2: partial(Stage12Reshard._optimizer_file, ...); 3: partial(_rank_file, self._optimizer, ...)
    reshard = getattr(make.func, "__self__", None) or make.args[0].__self__
    template = reshard._template
    before = repr(template)
    for f in built:
        f.build()
    assert repr(template) == before


@pytest.mark.parametrize("to", ["deepspeed", "dcp"])
def test_a_wide_write_makes_each_built_file_once(ds_saves, tmp_path, to):
    """A rank file of a wide write is built (its segments made) when it is written, and only then: its size, known
    once it is made, must not make it a second time (opening the sink first did: a 1,024-rank reshard took twice as long)."""
    import ckpt_cli

    request = ckpt_cli.convert_request(ds_saves[2] / "stage2-fp32", tmp_path / "out", to=to, world_size=3)
    prepared = ckpt_cli.prepare(request)
    built = [f for f in prepared.job.plan.files if f.build is not None]
    assert built, "the writer plans its rank files as built files"
    calls: dict[str, int] = {}
    for f in built:
        make = f.build

        def counted(make=make, name=f.relpath):
            calls[name] = calls.get(name, 0) + 1
            return make()

        f.build = counted
    prepared.write()
    assert calls == {f.relpath: 1 for f in built}, calls


def test_ep_size_of_a_dense_checkpoint_is_refused(ckpt, ds_saves, tmp_path):
    res = ckpt("reshard", ds_saves[2] / "stage2-fp32", tmp_path / "out", "--world-size", 4, "--ep-size", 2)
    assert res.code == 2 and "--ep-size applies to DeepSpeed MoE checkpoints" in res.err and "Traceback" not in res.err
    assert not (tmp_path / "out").exists()


def test_pipeline_with_tensor_parallelism_is_refused_by_name(ckpt, tmp_path):
    """Pipeline stages are read (tests/test_deepspeed_pipe.py); with tensor parallelism inside them
    (checkpoint_parallel_dimensions tp_degree > 1) the slices cannot be joined: refused as such, not as a plain
    tensor-parallel save. Hand-made model states as DeepSpeed 0.19 names them (only the refusal is tested here)."""
    tag = tmp_path / "run" / "global_step2"
    tag.mkdir(parents=True)
    (tmp_path / "run" / "latest").write_text("global_step2")
    for stage in (0, 1):
        state = {"module": None, "param_shapes": [{}], "dp_world_size": 1, "mp_world_size": 4}
        state["checkpoint_parallel_dimensions"] = {"pp_degree": 2, "tp_degree": 2}
        torch.save(state, tag / f"mp_rank_0{stage}_model_states.pt")
        torch.save({"weight": torch.zeros(2)}, tag / f"layer_0{stage}-model_00-model_states.pt")
    res = ckpt("inspect", tmp_path / "run")
    assert res.code == 2 and "pipeline- and tensor-parallel checkpoint (tp_degree 2)" in res.err, res.err
