"""Issue 52, items 8, 9, 12 and 15, each as a family: the names inspect shows are the names the exports act on (every
run-folder kind that nests), one rule for which checkpoint a folder holding several means (inspect, ls and verify
agree, a note names it), inspect of a run root keeps stdout for the report (--quiet, --json) with ls's step, and files
of other tools under a run root are never called damaged while a truncated torch file still is."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RUN_FOLDERS, run_folder_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file


def model_names(ckpt, src: Path) -> list[str]:
    res = ckpt("inspect", src, "--json", "--quiet")
    assert res.code == 0 and not res.err, res.err
    return [t["name"] for t in json.loads(res.out)["tensors"] if t["role"] == "model"]


def written(path: Path) -> list[str]:
    with safe_open(str(path), "np") as f:
        return sorted(f.keys())


# ---- item 8: the names inspect shows are the names convert/merge/--select/--strip-prefix act on -----------------


@pytest.mark.parametrize("name", RUN_FOLDERS)
def test_names_inspect_shows_are_the_names_exports_act_on(ckpt, run_folders, tmp_path, name):
    checkpoint = run_folder_checkpoint(run_folders[name])
    shown = model_names(ckpt, checkpoint)
    assert ckpt("merge", checkpoint, tmp_path / "all.safetensors", "--quiet").code == 0
    assert written(tmp_path / "all.safetensors") == sorted(shown)  # merge writes every model weight as shown
    for one in (shown[0], shown[len(shown) // 2], shown[-1]):  # --select NAME read off inspect selects that tensor
        out = tmp_path / f"one-{shown.index(one)}.safetensors"
        res = ckpt("convert", checkpoint, out, "--to", "safetensors", "--weights-only", "--select", one, "--quiet")
        assert res.code == 0, res.err
        assert written(out) == [one]
        filtered = json.loads(ckpt("inspect", checkpoint, "--json", "--filter", one, "--quiet").out)
        assert [t["name"] for t in filtered["tensors"]] == [one]
    prefix = os.path.commonprefix(shown)
    prefix = prefix[: prefix.rfind(".") + 1]  # the common prefix up to a dot, as a user reads it off inspect
    if prefix:
        res = ckpt("merge", checkpoint, tmp_path / "stripped.safetensors", "--strip-prefix", prefix, "--quiet")
        assert res.code == 0, res.err
        assert written(tmp_path / "stripped.safetensors") == sorted(n[len(prefix) :] for n in shown)
    tree = json.loads(ckpt("inspect", checkpoint, "--tree", "--json", "--quiet").out)
    tops = {c["name"].split(".")[0] for c in tree["roles"]["model"].get("children", [])}
    assert tops == {n.split(".")[0] for n in shown}, (tops, shown[:3])
    text = ckpt("inspect", checkpoint, "--tensors", "--quiet").out
    assert all(f"\n{n} " in text for n in shown)


def test_a_renamed_view_says_so_on_stderr(ckpt, run_folders):
    """Where the shown names drop the framework's nesting key, a note says what is stored (stderr, not --quiet)."""
    for name in ("lightning-fsdp", "lightning-plain", "trainer-fsdp2", "accelerate-fsdp2"):
        res = ckpt("inspect", run_folder_checkpoint(run_folders[name]))
        assert "nesting key" in res.err and "nesting key" not in res.out, name
        assert "nesting key" not in ckpt("inspect", run_folder_checkpoint(run_folders[name]), "--quiet").err


# ---- item 9: one rule for a folder holding several checkpoints ------------------------------------------------------


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 4, generator=g), "b.bias": torch.randn(4, generator=g)}


def _hf_plus_pt(root: Path) -> None:
    root.mkdir()
    save_file(_weights(0), str(root / "model.safetensors"))
    (root / "config.json").write_text("{}")
    torch.save(_weights(1), root / "extra.pt")


def _root_with_steps(root: Path) -> None:
    (root / "ckpts").mkdir(parents=True)
    for step in (10, 30, 20):
        save_file(_weights(step), str(root / "ckpts" / f"step_{step}.safetensors"))


def _hf_with_a_run(root: Path) -> None:
    _hf_plus_pt(root)
    (root / "extra.pt").unlink()
    _root_with_steps(root / "nested")
    shutil.move(root / "nested" / "ckpts", root / "checkpoints")
    shutil.rmtree(root / "nested")
    torch.save(_weights(7), root / "final.pt")


FOLDERS = {"hf+pt": _hf_plus_pt, "steps": _root_with_steps, "hf+run": _hf_with_a_run}


def _demo(ckpt, tmp_path_factory) -> Path:
    demo = tmp_path_factory.mktemp("rules") / "demo"
    assert ckpt("demo", demo, "--quiet").code == 0
    return demo


@pytest.mark.parametrize("kind", ["demo", *FOLDERS])
def test_one_rule_for_a_folder_of_several(ckpt, tmp_path, tmp_path_factory, kind):
    if kind == "demo":
        root = _demo(ckpt, tmp_path_factory)
    else:
        root = tmp_path / kind
        FOLDERS[kind](root)
        if kind == "steps":
            root = root / "ckpts"
    rows = json.loads(ckpt("ls", root, "--json").out)["checkpoints"]
    chosen = [r["path"] for r in rows if r["chosen"]]
    assert len(chosen) == 1 and len(rows) >= 2, rows
    chosen_path = str(root / chosen[0])
    inspected = ckpt("inspect", root, "--json")
    assert inspected.code == 0, inspected.err
    assert json.loads(inspected.out)["path"] == chosen_path
    plain = ckpt("inspect", root)
    assert f"'{chosen[0]}'" in plain.err and "--tag" in plain.err and "note:" not in plain.out
    assert not ckpt("inspect", root, "--quiet").err
    verified = ckpt("verify", root)
    assert verified.code == 0 and verified.out.startswith(f"OK {chosen_path} "), verified.out
    assert f"'{chosen[0]}'" in verified.err
    assert json.loads(ckpt("verify", root, "--json").out)["path"] == chosen_path
    other = next(r["path"] for r in rows if not r["chosen"])  # --tag picks another, as the note says
    assert json.loads(ckpt("inspect", root, "--tag", other, "--json").out)["path"] == str(root / other)


def test_a_folder_of_runs_in_folders_of_their_own_is_still_refused(ckpt, tmp_path):
    for run in ("a", "b"):
        _root_with_steps(tmp_path / run)
    res = ckpt("inspect", tmp_path)
    assert res.code == 2 and "runs" in res.err
    assert not any(r["chosen"] for r in json.loads(ckpt("ls", tmp_path, "--json").out)["checkpoints"])


def _release_with_original(root: Path) -> str:
    """A Hub release as Meta ships Llama: sharded safetensors + index, the original consolidated .pth in original/."""
    from huggingface_hub import save_torch_state_dict

    root.mkdir()
    save_torch_state_dict(_weights(0), root, max_shard_size=40)
    (root / "original").mkdir()
    torch.save(_weights(0), root / "original" / "consolidated.00.pth")
    return "hf"


def _dcp_with_extra(root: Path) -> str:
    """A DCP save (its .metadata names the folder whole) beside a sharded/ copy and a loose .pt."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_weights(0), checkpoint_id=str(root))
    save_file(_weights(1), str(root / "model.safetensors"))
    (root / "sharded").mkdir()
    torch.save(_weights(2), root / "sharded" / "extra.pt")
    return "dcp"


@pytest.mark.parametrize("build", [_release_with_original, _dcp_with_extra], ids=lambda f: f.__name__.strip("_"))
def test_a_folder_its_own_index_names_is_itself_whatever_lies_beside(ckpt, tmp_path, build):
    """A folder whose index or metadata file names it whole is that checkpoint, not a run root of what it also holds."""
    folder = tmp_path / "ckpt"
    fmt = build(folder)
    res = ckpt("inspect", folder, "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert (report["format"], report["path"]) == (fmt, str(folder))
    assert ckpt("verify", folder).out.startswith(f"OK {folder} ({fmt})")


def test_a_checkpoint_folder_alone_is_itself(ckpt, tmp_path):
    """An hf folder with nothing else in it reads as itself, as before: no note, no choice."""
    folder = tmp_path / "release"
    _hf_plus_pt(folder)
    (folder / "extra.pt").unlink()
    res = ckpt("inspect", folder, "--json")
    assert json.loads(res.out)["path"] == str(folder) and json.loads(res.out)["format"] == "hf" and not res.err


# ---- item 12: inspect of a run root: stdout holds the report only, the step is ls's ---------------------------------


@pytest.mark.parametrize("kind", ["demo/run", "steps", "trainer-plain", "lightning-fsdp", "accelerate-ds"])
def test_inspect_of_a_run_root_keeps_stdout_for_the_report(ckpt, run_folders, tmp_path, tmp_path_factory, kind):
    if kind == "demo/run":
        root = _demo(ckpt, tmp_path_factory) / "run"
    elif kind == "steps":
        _root_with_steps(tmp_path / "r")
        root = tmp_path / "r" / "ckpts"
    else:
        root = run_folders[kind]
    quiet = ckpt("inspect", root, "--quiet")
    assert quiet.code == 0 and not quiet.err
    assert quiet.out.startswith("path ") and "note:" not in quiet.out and "checkpoints under" not in quiet.out
    loud = ckpt("inspect", root)
    assert loud.out == quiet.out and "note:" in loud.err and "checkpoints under this folder" in loud.err
    doc = json.loads(ckpt("inspect", root, "--json").out)  # stdout is JSON alone
    rows = json.loads(ckpt("ls", root, "--json").out)["checkpoints"]
    row = next(r for r in rows if r["chosen"])
    assert doc["path"] == str(root / row["path"]) and doc["step"] == row["step"] is not None
    step_line = next(line for line in quiet.out.splitlines() if line.startswith("step "))
    assert step_line.split()[-1] == str(row["step"])


# ---- item 15: files of other tools under a run root ---------------------------------------------------------------


def _npz(p: Path) -> None:
    np.savez(p, a=np.zeros(3))


def _npy(p: Path) -> None:
    np.save(p, np.arange(5))


def _zip(p: Path) -> None:
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("notes.txt", "hello")


def _pickle(p: Path) -> None:
    p.write_bytes(pickle.dumps({"vocab": {"a": 1}, "merges": [("a", "b")]}))


def _random(p: Path) -> None:
    p.write_bytes(np.random.default_rng(0).bytes(300))


def _text(p: Path) -> None:
    p.write_text("not a safetensors file, but named as one\n" * 4)


FOREIGN = {
    "arrays.npz": _npz,
    "step_5.npz": _npz,
    "arr.npy": _npy,
    "bundle.zip": _zip,
    "bundle.pt": _zip,
    "tokenizer.pkl": _pickle,
    "optim_state.pt": _pickle,
    "state.bin": _pickle,
    "noise.pt": _random,
    "noise.pth": _random,
    "fake.safetensors": _text,
    "zipped.safetensors": _zip,
}


@pytest.mark.parametrize("foreign", sorted(FOREIGN))
def test_files_of_other_tools_under_a_run_root_are_never_called_damaged(ckpt, tmp_path, foreign):
    root = tmp_path / "run"
    root.mkdir()
    torch.save(_weights(1), root / "step_100.pt")
    FOREIGN[foreign](root / foreign)
    res = ckpt("ls", root, "--json")
    assert res.code == 0, res.err
    rows = json.loads(res.out)["checkpoints"]
    assert [r["path"] for r in rows] == ["step_100.pt"] and rows[0]["complete"] and rows[0]["chosen"]
    assert "INCOMPLETE" not in ckpt("ls", root).out
    assert ckpt("verify", root).code == 0


@pytest.mark.parametrize("cut", [0.9, 0.5, 0.1, 64])
def test_a_truncated_torch_file_is_still_damaged(ckpt, tmp_path, cut):
    root = tmp_path / "run"
    root.mkdir()
    torch.save(_weights(1), root / "step_100.pt")
    data = (root / "step_100.pt").read_bytes()
    (root / "step_200.pt").write_bytes(data[: int(len(data) * cut) if cut < 1 else cut])
    _npz(root / "step_300.npz")
    rows = json.loads(ckpt("ls", root, "--json").out)["checkpoints"]
    assert [(r["path"], r["complete"]) for r in rows] == [("step_100.pt", True), ("step_200.pt", False)]
    assert "INCOMPLETE" in ckpt("ls", root).out


@pytest.mark.parametrize("foreign", ["extra.npz", "tokenizer.pkl", "bundle.zip"])
def test_a_foreign_file_inside_a_run_checkpoint_is_no_damage(ckpt, run_folders, tmp_path, foreign):
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(run_folder_checkpoint(run_folders["trainer-plain"]), copy)
    {"extra.npz": _npz, "tokenizer.pkl": _pickle, "bundle.zip": _zip}[foreign](copy / foreign)
    res = ckpt("verify", copy)
    assert res.code == 0, res.out
    assert "damaged" not in ckpt("inspect", copy).err
