"""The command line as users and CI meet it: exit codes, one-line errors, atomic writes, outputs."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import run_subprocess
from safetensors.torch import load_file, save_file

from ckpt_cli.core.write import executor, sinks, source_order


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.safetensors"
    save_file({"a.weight": torch.randn(4, 4), "b.weight": torch.randn(8)}, path)
    return path


def test_entry_point_errors_are_one_line_without_traceback(tmp_path):
    res = run_subprocess("inspect", tmp_path / "nope")
    assert res.code == 2 and res.err.strip().count("\n") == 0 and "no such file" in res.err
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{abc}")
    res = run_subprocess("verify", tmp_path / "junk.safetensors")
    assert res.code == 1 and "Traceback" not in res.err + res.out
    res = run_subprocess("convert", tmp_path / "junk.safetensors", tmp_path / "o", "--to", "hf")
    assert res.code == 1 and res.err.count("\n") == 1 and "junk.safetensors" in res.err
    res = run_subprocess("convert", tmp_path / "junk.safetensors", tmp_path / "o", "--to", "hf", env={"CKPT_DEBUG": "1"})
    assert "Traceback" in res.err


def test_usage_errors_exit_2(ckpt, small, tmp_path):
    assert ckpt("convert", small, tmp_path / "o", "--to", "nosuch").code == 2
    assert ckpt("inspect", small, "--format", "nosuch").code == 2
    assert ckpt("split", small, tmp_path / "o", "--max-shard-size", "5XB").code == 2
    assert ckpt("split", small, tmp_path / "o", "--max-shard-size", "5GB", "--num-shards", "2").code == 2
    assert ckpt("convert", small, tmp_path / "o", "--to", "hf", "--dtype", "fp12").code == 2
    assert ckpt("frobnicate").code == 2
    res = ckpt("reshard", small, tmp_path / "o", "--world-size", "2")
    assert res.code == 2 and "split" in res.err
    res = ckpt("convert", small, tmp_path / "o", "--to", "deepspeed", "--world-size", "2")
    assert res.code == 2 and "no optimizer state" in res.err


def test_refuses_to_overwrite_and_replaces_with_overwrite(ckpt, small, tmp_path):
    dest = tmp_path / "out"
    assert ckpt("split", small, dest, "-q").code == 0
    (dest / "keep").write_text("x")
    res = ckpt("split", small, dest, "--num-shards", "2")
    assert res.code == 2 and "--overwrite" in res.err and (dest / "keep").exists()
    assert ckpt("split", small, dest, "--num-shards", "2", "--overwrite", "-q").code == 0  # a checkpoint is replaced whole
    assert not (dest / "keep").exists() and (dest / "model-00002-of-00002.safetensors").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(ckpt, small, tmp_path):
    dest = tmp_path / "out"
    res = ckpt("split", small, dest, "--num-shards", "2", "--dry-run")
    assert res.code == 0 and not dest.exists()
    assert "model-00001-of-00002.safetensors" in res.out and "estimated peak memory" in res.out
    plan = json.loads(ckpt("split", small, dest, "--num-shards", "2", "--dry-run", "--json").out)
    assert plan["placement"] == {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    assert plan["estimated_peak_rss"] > 0 and len(plan["files"]) == 3


def test_a_failed_write_leaves_no_destination(ckpt, small, tmp_path, monkeypatch):
    def explode(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(executor, "stream_tensor", explode)  # a tensor written by the file's threads
    monkeypatch.setattr(sinks, "stream_tensor", explode)  # a file of byte copies alone, written in order by one thread
    monkeypatch.setattr(source_order, "copy_runs", explode)  # local files written in the order their sources hold the bytes
    res = ckpt("split", small, tmp_path / "out")
    assert res.code == 130 and "interrupted" in res.err
    assert list(tmp_path.iterdir()) == [small]  # no destination, no partial temp folder


def test_inspect_json_yaml_filter(ckpt, small):
    doc = json.loads(ckpt("inspect", small, "--json").out)
    expected_keys = {
        "path",
        "format",
        "tag",
        "step",
        "world_size",
        "num_tensors",
        "num_params",
        "total_bytes",
        "dtypes",
        "files",
        "training_state",
        "tensors",
        "details",
    }
    assert expected_keys <= set(doc)
    assert doc["format"] == "safetensors" and doc["num_params"] == 24 and doc["dtypes"] == {"float32": 96}
    assert doc["tensors"][0] == {"name": "a.weight", "dtype": "float32", "shape": [4, 4], "role": "model", "pieces": 1}
    filtered = json.loads(ckpt("inspect", small, "--json", "--filter", "b.*").out)
    assert [t["name"] for t in filtered["tensors"]] == ["b.weight"] and filtered["num_params"] == 8
    assert yaml.safe_load(ckpt("inspect", small, "--yaml").out)["num_tensors"] == 2
    human = ckpt("inspect", small, "--tensors").out
    assert "safetensors" in human and "a.weight" in human and "[4, 4]" in human


def test_inspect_training_state(ckpt, tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    model(torch.ones(3)).sum().backward()
    opt.step()
    sched.step()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "lr_scheduler": sched.state_dict(),
            "global_step": 7,
            "rng_state": torch.get_rng_state(),
            "dataloader": {"offset": 56},
            "wandb_id": "abc",
        },
        tmp_path / "state.pt",
    )
    doc = json.loads(ckpt("inspect", tmp_path / "state.pt", "--json").out)
    state = doc["training_state"]
    assert doc["step"] == 7 and doc["num_params"] == 8
    assert state["optimizer"]["kind"] == "Adam/AdamW" and state["optimizer"]["param_groups"] == 1
    assert state["lr_scheduler"]["last_epoch"] == 1
    assert state["rng"] and state["dataloader"] == {"offset": 56} and state["client_state"] == {"keys": ["wandb_id"]}
    roles = {t["name"]: t["role"] for t in doc["tensors"]}
    assert roles["model.weight"] == "model" and roles["optimizer.state.0.exp_avg"] == "optimizer" and roles["rng_state"] == "other"


def test_run_folder_tags(ckpt, tmp_path):
    run = tmp_path / "run"
    for step in (1000, 2000, 500):
        (run / f"step_{step}").mkdir(parents=True)
        save_file({"w": torch.full((2,), float(step))}, run / f"step_{step}" / "model.safetensors")
    doc = json.loads(ckpt("inspect", run, "--json").out)
    assert [t["tag"] for t in doc["tags"]] == ["step_500", "step_1000", "step_2000"] and doc["tag"] == "step_2000"
    res = ckpt("merge", run, tmp_path / "m.safetensors")
    assert res.code == 0 and "step_2000" in res.err
    assert load_file(tmp_path / "m.safetensors")["w"][0] == 2000
    assert ckpt("merge", run, tmp_path / "m1.safetensors", "--tag", "step_1000", "-q").code == 0
    assert load_file(tmp_path / "m1.safetensors")["w"][0] == 1000
    assert ckpt("merge", run, tmp_path / "m2.safetensors", "--tag", "step_3").code == 2
    for by_step in ("500", "step_500"):  # a step number, or the folder name: the same checkpoint
        assert json.loads(ckpt("inspect", run, "--json", "--tag", by_step).out)["tag"] == "step_500"
    assert ckpt("inspect", run, "--tag", "5").code == 2


def test_a_tag_names_a_checkpoint_by_name_stem_or_step():
    from ckpt_cli.core.tags import named

    names = ["step_100.safetensors", "step_1000.safetensors", "global_step3", "checkpoint-20", "run1/global_step_7/actor"]
    assert named("step_100.safetensors", names) == ["step_100.safetensors"]
    assert named("step_100", names) == ["step_100.safetensors"]
    assert named("100", names) == ["step_100.safetensors"] and named("1000", names) == ["step_1000.safetensors"]
    assert named("3", names) == ["global_step3"] and named("20", names) == ["checkpoint-20"]
    assert named("7", names) == ["run1/global_step_7/actor"]
    assert named("10", names) == [] and named("step", names) == []
    assert named("5", ["step_5", "step_5.safetensors"]) == ["step_5", "step_5.safetensors"]  # ambiguous: the caller refuses


def test_progress_only_on_a_terminal(small, tmp_path):
    res = run_subprocess("split", small, tmp_path / "out")
    assert res.code == 0 and "\r" not in res.err and "wrote hf" in res.err
    res = run_subprocess("split", small, tmp_path / "out2", "--quiet")
    assert res.code == 0 and res.err == ""


def test_demo_writes_every_format_and_every_command_works(ckpt, tmp_path):
    demo = tmp_path / "demo"
    res = ckpt("demo", demo)
    assert res.code == 0, res.err
    for sample in ("training_state.pt", "dcp", "model.safetensors", "hf", "run"):
        assert ckpt("inspect", demo / sample).code == 0
        assert ckpt("verify", demo / sample, "--deep", "--finite").code == 0
    assert ckpt("verify", demo / "hf", "--against", demo / "model.safetensors").code == 0
    # the demo's DCP is keyed by parameter name (get_state_dict): it moves to DeepSpeed whole
    assert ckpt("convert", demo / "dcp", demo / "ds", "--to", "deepspeed", "--world-size", "2", "--zero-stage", "2").code == 0
    assert ckpt("verify", demo / "ds", "--against", demo / "dcp").code == 0
    assert ckpt("reshard", demo / "dcp", tmp_path / "dcp4", "--world-size", "4", "-q").code == 0
    assert ckpt("merge", demo / "hf", tmp_path / "m.pt", "-q").code == 0
    assert (
        ckpt("convert", demo / "training_state.pt", tmp_path / "w", "--to", "hf", "--weights-only", "--strip-prefix", "model.", "-q").code
        == 0
    )
    state = torch.load(demo / "training_state.pt", weights_only=True)
    merged = load_file(tmp_path / "w" / "model-00001-of-00001.safetensors")
    assert torch.equal(merged["embed.weight"], state["model"]["embed.weight"])
    assert ckpt("demo", demo).code == 2  # exists


def test_workers_do_not_change_the_output(ckpt, tmp_path):
    sd = {f"w{i}": torch.randn(50 + i, 7) for i in range(12)}
    save_file(sd, tmp_path / "in.safetensors")
    for workers in ("1", "3"):
        res = ckpt("split", tmp_path / "in.safetensors", tmp_path / f"out{workers}", "--num-shards", "5", "--workers", workers, "-q")
        assert res.code == 0, res.err
    for f in (tmp_path / "out1").iterdir():
        assert f.read_bytes() == (tmp_path / "out3" / f.name).read_bytes()


def test_ls_of_a_folder_without_checkpoints_suggests_no_option_it_lacks(ckpt, tmp_path):
    (tmp_path / "root" / "logs").mkdir(parents=True)
    res = ckpt("ls", tmp_path / "root")
    assert res.code == 2 and "no checkpoint" in res.err and "use --format" not in res.err and "ckpt inspect SRC --format" in res.err


def test_filter_is_the_glob_option_of_every_command_and_select_still_works(ckpt, small, tmp_path):
    """One vocabulary: --filter in inspect, diff and every writing command; the writers' former --select is hidden
    from --help and still taken, with a note."""
    from typer.testing import CliRunner

    from ckpt_cli.cli.app import app

    for command in ("inspect", "diff", "convert", "reshard", "merge", "split"):
        shown = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "--filter" in shown and "--select" not in shown, command
    kept = ckpt("merge", small, tmp_path / "a.safetensors", "--filter", "a*")
    former = ckpt("merge", small, tmp_path / "b.safetensors", "--select", "a*")
    assert kept.code == former.code == 0 and "--select is now --filter" in former.err
    assert load_file(tmp_path / "a.safetensors").keys() == load_file(tmp_path / "b.safetensors").keys()
    assert ckpt("merge", small, tmp_path / "c.safetensors", "--filter", "nothing*").code == 2
