"""ckpt diff: two steps of one run, a checkpoint against its conversion, a tampered copy, a renamed tensor,
tolerances, the training state, --json keys, bad calls, and windows of bounded size."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import mixed_state_dict, run_folder_checkpoint
from safetensors.torch import load_file, save_file

from ckpt_cli.core import reading
from ckpt_cli.ops.diff import group_of

JSON_KEYS = {
    "a",
    "b",
    "equal",
    "atol",
    "rtol",
    "matched_by",
    "counts",
    "groups",
    "tensors",
    "only_in_a",
    "only_in_b",
    "renamed",
    "shape_changed",
    "dtype_changed",
    "tied",
    "training_state",
    "notes",
}
TENSOR_KEYS = {"name", "group", "dtype_a", "dtype_b", "shape", "identical", "equal", "max_abs", "rel_l2", "cosine", "mismatched"}
GROUP_KEYS = {"group", "tensors", "differ", "max_abs", "rel_l2", "cosine", "worst"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """`ckpt demo`: torch.save and DCP of one training state, its safetensors and hf weights, a DeepSpeed conversion."""
    from ckpt_cli.ops.demo import write_demo

    folder = tmp_path_factory.mktemp("diff") / "demo"
    write_demo(folder)
    return folder


def doc(res) -> dict:
    parsed = json.loads(res.out)
    assert set(parsed) == JSON_KEYS
    return parsed


def tamper(path: Path, name: str, values: torch.Tensor) -> None:
    """Overwrite tensor `name` of a safetensors file in place (same dtype and size), as bit rot or a bad copy would."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + size])[name]["data_offsets"]
    data = values.contiguous().view(torch.uint8).numpy().tobytes()
    assert len(data) == end - begin
    with path.open("r+b") as f:
        f.seek(8 + size + begin)
        f.write(data)


def test_a_checkpoint_and_its_conversions_are_equal(ckpt, mixed_files, demo, tmp_path):
    # every dtype, 0-d and empty tensors, in three formats written by their own producers
    res = ckpt("diff", mixed_files["safetensors"], mixed_files["hf"])
    assert res.code == 0, res.out + res.err
    assert "result   equal (bit-exact)" in res.out and f"{len(mixed_state_dict())} identical" in res.out
    assert ckpt("diff", mixed_files["torch"], mixed_files["safetensors"]).code == 0
    # converted by ckpt convert: safetensors -> torch, and a DCP training state -> DeepSpeed ZeRO-2 on 3 ranks
    assert ckpt("convert", mixed_files["safetensors"], tmp_path / "m.pt", "--to", "torch", "-q").code == 0
    assert ckpt("diff", mixed_files["safetensors"], tmp_path / "m.pt").code == 0
    ds = tmp_path / "ds"
    assert ckpt("convert", demo / "dcp", ds, "--to", "deepspeed", "--zero-stage", "2", "--world-size", "3", "-q").code == 0
    res = ckpt("diff", demo / "dcp", ds, "--json")
    assert res.code == 0, res.out + res.err
    d = doc(res)
    assert d["equal"] and d["matched_by"] == "parameter name (deepspeed vs get_state_dict key layouts)"
    assert d["counts"]["matched"] == d["counts"]["identical"] == 16 + 45  # weights (tied one included) + AdamW state
    assert d["training_state"] == [] and d["a"]["step"] == d["b"]["step"] == 3
    assert ckpt("diff", demo / "hf", demo / "model.safetensors").code == 0
    # the weights export of a training run: weights identical, the optimizer state and training state only in B
    res = ckpt("diff", demo / "hf", demo / "dcp", "--json")
    d = doc(res)
    assert res.code == 1 and d["counts"]["identical"] == 15 and d["counts"]["only_in_b"] == 45  # AdamW state
    assert d["tied"] == [{"side": "b", "name": "lm_head.weight", "tied_to": "embed.weight"}]  # DCP saved the tie twice
    assert {e["key"] for e in d["training_state"]} == {"step", "optimizer", "lr_scheduler", "dataloader", "rng"}
    # the tied alias DeepSpeed records and safetensors stores once is no difference
    res = ckpt("diff", demo / "model.safetensors", demo / "deepspeed", "--filter", "*.weight", "--filter", "*.bias")
    assert res.code == 0 and "lm_head.weight is tied to embed.weight" in res.out, res.out


def test_two_steps_of_the_demo_run(ckpt, demo):
    res = ckpt("diff", demo / "run", demo / "run", "--tag-a", "step_100.safetensors")
    assert res.code == 1
    assert "15 tensors differ (bit-exact)" in res.out and "blocks.0" in res.out
    lines = res.out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("group"))) + 1 :]
    rel = [float(line.split()[4]) for line in table if line and line.split()[0] in ("blocks.0", "blocks.1", "norm", "embed")]
    assert rel == sorted(rel, reverse=True), "groups worst first"


@pytest.mark.parametrize("name", ["trainer-plain", "trainer-ds2"])
def test_two_steps_of_a_trainer_run(ckpt, run_folders, name):
    root = run_folders[name]
    res = ckpt("diff", run_folder_checkpoint(root, 2), run_folder_checkpoint(root, 4), "--json")
    d = doc(res)
    assert res.code == 1 and not d["equal"]
    assert d["a"]["step"] == 2 and d["b"]["step"] == 4
    weights = [t for t in d["tensors"] if t["name"].startswith("model.layers.")]
    assert weights and all(not t["identical"] and t["max_abs"] > 0 and t["rel_l2"] > 0 for t in weights)
    assert {t["group"] for t in weights} == {"model.layers.0", "model.layers.1"}
    assert not d["only_in_a"] and not d["only_in_b"] and not d["shape_changed"]
    keys = {e["key"]: e for e in d["training_state"]}
    assert keys["step"]["a"] == 2 and keys["step"]["b"] == 4
    assert any(k.startswith("lr_scheduler.") for k in keys), keys
    assert keys["param_groups.0.lr"]["a"] < keys["param_groups.0.lr"]["b"]  # warmup
    text = ckpt("diff", run_folder_checkpoint(root, 2), run_folder_checkpoint(root, 4)).out
    assert "training state (A -> B)" in text and "  step " in text and "param_groups.0.lr" in text
    # a step against itself
    assert ckpt("diff", run_folder_checkpoint(root, 4), root).code == 0


def test_one_run_in_deepspeed_and_fsdp2_matches_by_parameter_name(ckpt, run_folders):
    """Trainer on DeepSpeed ZeRO-2 and on FSDP2 (DCP, model and optimizer parts): the same run, reduced in another
    order; weights and AdamW state match by parameter name and agree to float32 rounding."""
    ds, fsdp = run_folder_checkpoint(run_folders["trainer-ds2"]), run_folder_checkpoint(run_folders["trainer-fsdp2"])
    d = doc(ckpt("diff", ds, fsdp, "--json"))
    assert d["matched_by"] == "parameter name (deepspeed vs get_state_dict key layouts)"
    assert d["counts"]["matched"] == 21 + 3 * 21 and not d["only_in_a"] and not d["only_in_b"] and not d["training_state"]
    assert d["counts"]["differ"] > 0 and all(t["rel_l2"] < 1e-5 and t["cosine"] > 0.99999 for t in d["tensors"])
    assert {g["group"] for g in d["groups"]} >= {"model.layers.0", "optimizer.state.model.layers.0"}
    res = ckpt("diff", ds, fsdp, "--rtol", "1e-5", "--atol", "1e-8")
    assert res.code == 0 and "equal (within atol=1e-08 rtol=1e-05)" in res.out, res.out


def test_a_tampered_copy_names_the_tensor(ckpt, mixed_files, tmp_path):
    copy = tmp_path / "tampered.safetensors"
    copy.write_bytes(mixed_files["safetensors"].read_bytes())
    original = load_file(mixed_files["safetensors"])["layer.0.weight"]
    changed = original.clone()
    changed[1, 2, 0] += 0.5
    tamper(copy, "layer.0.weight", changed)
    res = ckpt("diff", mixed_files["hf"], copy)
    assert res.code == 1 and "1 tensors differ" in res.out and "layer.0.weight" in res.out, res.out
    d = doc(ckpt("diff", mixed_files["hf"], copy, "--json"))
    worst = d["tensors"][0]
    assert worst["name"] == "layer.0.weight" and not worst["equal"] and worst["mismatched"] == 1
    assert worst["max_abs"] == pytest.approx(0.5)
    a64, b64 = original.double().flatten(), changed.double().flatten()
    assert worst["rel_l2"] == pytest.approx(float((a64 - b64).norm() / a64.norm()))
    assert worst["cosine"] == pytest.approx(float(a64 @ b64 / (a64.norm() * b64.norm())))
    assert all(t["identical"] for t in d["tensors"][1:])
    assert d["groups"][0]["group"] == "layer.0" and d["groups"][0]["worst"] == "layer.0.weight"
    # verify --against, through the same comparison, agrees
    assert "layer.0.weight" in ckpt("verify", copy, "--against", mixed_files["hf"]).out


def test_a_renamed_tensor_is_reported_as_renamed(ckpt, mixed_files, tmp_path):
    sd = load_file(mixed_files["safetensors"])
    sd["layer.0.renamed"] = sd.pop("layer.0.weight")
    sd["extra"] = torch.zeros(3)
    save_file(sd, tmp_path / "renamed.safetensors", metadata={"format": "pt"})
    res = ckpt("diff", mixed_files["torch"], tmp_path / "renamed.safetensors")
    assert res.code == 1
    assert "renamed (1): layer.0.weight -> layer.0.renamed" in res.out and "only in B (1): extra" in res.out, res.out
    d = doc(ckpt("diff", mixed_files["torch"], tmp_path / "renamed.safetensors", "--json"))
    assert d["renamed"] == [{"a": "layer.0.weight", "b": "layer.0.renamed"}] and d["only_in_b"] == ["extra"]
    assert d["only_in_a"] == [] and d["counts"]["identical"] == len(sd) - 2
    # a changed shape
    sd = load_file(mixed_files["safetensors"])
    sd["fp32"] = torch.zeros(5, 7)
    save_file(sd, tmp_path / "reshaped.safetensors")
    d = doc(ckpt("diff", mixed_files["safetensors"], tmp_path / "reshaped.safetensors", "--json"))
    assert d["shape_changed"] == [{"name": "fp32", "a": [7, 5], "b": [5, 7]}] and not d["equal"]


def test_tolerances(ckpt, tmp_path):
    g = torch.Generator().manual_seed(1)
    a = {"w": torch.rand(1000, generator=g) + 3.0, "same": torch.ones(4), "nan": torch.tensor([1.0, math.nan])}
    b = {"w": a["w"] + 1e-3, "same": torch.ones(4), "nan": torch.tensor([1.0, math.nan])}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert ckpt("diff", pa, pb).code == 1
    assert ckpt("diff", pa, pb, "--atol", "5e-4").code == 1
    res = ckpt("diff", pa, pb, "--atol", "2e-3")
    assert res.code == 0 and "2 identical, 1 within tolerance" in res.out and "equal (within atol=0.002 rtol=0)" in res.out, res.out
    assert ckpt("diff", pa, pb, "--rtol", "1e-2").code == 0  # |a-b| <= rtol * |b| with |b| > 1 (as torch.allclose)
    assert ckpt("diff", pa, pb, "--rtol", "1e-6").code == 1
    d = doc(ckpt("diff", pa, pb, "--atol", "5e-4", "--json"))
    w = next(t for t in d["tensors"] if t["name"] == "w")
    want = torch.isclose(b["w"].double(), a["w"].double(), atol=5e-4, rtol=0)  # a float32 sum: not exactly 1e-3
    assert w["mismatched"] == int((~want).sum()) and w["max_abs"] == pytest.approx(float((b["w"] - a["w"]).abs().max()))
    assert d["atol"] == 5e-4 and d["rtol"] == 0
    # NaN against NaN is equal; against a number it is not, and max |a-b| is not finite (null)
    b["nan"] = torch.tensor([1.0, 2.0])
    save_file(b, tmp_path / "c.safetensors")
    d = doc(ckpt("diff", pa, tmp_path / "c.safetensors", "--atol", "1", "--json"))
    nan = next(t for t in d["tensors"] if t["name"] == "nan")
    assert not nan["equal"] and nan["max_abs"] is None and nan["mismatched"] == 1 and not d["equal"]
    # a dtype change: a difference when bit-exact, compared by value with a tolerance
    save_file({k: v.to(torch.float64) for k, v in a.items()}, tmp_path / "a64.safetensors")
    assert ckpt("diff", pa, tmp_path / "a64.safetensors").code == 1
    res = ckpt("diff", pa, tmp_path / "a64.safetensors", "--atol", "1e-12")
    assert res.code == 0 and "dtype changed (3)" in res.out, res.out


def test_json_keys_groups_and_filter(ckpt, tiny_llama, tmp_path):
    _, root = tiny_llama
    d = doc(ckpt("diff", root / "single", root / "sharded", "--json"))
    assert d["equal"] and d["counts"]["identical"] == d["counts"]["matched"] > 10
    assert set(d["counts"]) == {
        "matched",
        "identical",
        "within_tolerance",
        "differ",
        "only_in_a",
        "only_in_b",
        "renamed",
        "shape_changed",
        "dtype_changed",
        "training_state",
    }
    assert all(set(t) == TENSOR_KEYS for t in d["tensors"]) and all(set(g) == GROUP_KEYS for g in d["groups"])
    assert {"model.layers.0", "model.layers.1", "model.norm", "model.embed_tokens"} <= {g["group"] for g in d["groups"]}
    assert set(d["a"]) == {"path", "format", "tag", "step", "tensors"}
    d = doc(ckpt("diff", root / "single", root / "sharded", "--json", "--filter", "model.layers.1.*", "--depth", "4"))
    assert d["tensors"] and all(t["name"].startswith("model.layers.1.") for t in d["tensors"])
    assert {g["group"] for g in d["groups"]} <= {"model.layers.1.self_attn", "model.layers.1.mlp", "model.layers.1.input_layernorm"} | {
        "model.layers.1.post_attention_layernorm"
    }


def test_bad_calls_exit_2_with_one_line(ckpt, mixed_files, tmp_path):
    for args in (
        [mixed_files["hf"], tmp_path / "missing"],
        [mixed_files["hf"], mixed_files["hf"], "--atol", "-1"],
        [mixed_files["hf"], mixed_files["hf"], "--format-b", "nope"],
        [mixed_files["hf"]],
    ):
        res = ckpt("diff", *args)
        assert res.code == 2 and "Traceback" not in res.err, (args, res.err)
    res = ckpt("diff", mixed_files["hf"], tmp_path / "missing")
    assert res.err.count("\n") == 1 and "missing" in res.err


def test_windows_are_bounded_and_groups(monkeypatch, ckpt, tmp_path):
    """A tensor of 3 windows against a perturbed copy and a bf16 cast: no read larger than a window."""
    big = torch.randn(3 * reading.BLOCK_BYTES // 4 + 5, generator=torch.Generator().manual_seed(2))
    save_file({"big": big}, tmp_path / "a.safetensors")
    save_file({"big": big.to(torch.bfloat16)}, tmp_path / "b.safetensors")
    changed = big.clone()
    changed[-1] += 1
    save_file({"big": changed}, tmp_path / "c.safetensors")
    largest = []
    real = reading.read_elements

    def spy(entry, start, count, sources):
        largest.append(count * entry.dtype.itemsize)
        return real(entry, start, count, sources)

    monkeypatch.setattr("ckpt_cli.ops.values.read_elements", spy)
    d = doc(ckpt("diff", tmp_path / "a.safetensors", tmp_path / "c.safetensors", "--json"))
    assert d["tensors"][0]["mismatched"] == 1 and d["tensors"][0]["max_abs"] == pytest.approx(1.0)
    a64, c64 = big.double(), changed.double()  # the first windows were equal: their norms count all the same
    assert d["tensors"][0]["rel_l2"] == pytest.approx(float((a64 - c64).norm() / a64.norm()), rel=1e-9)
    assert d["tensors"][0]["cosine"] == pytest.approx(float(a64 @ c64 / (a64.norm() * c64.norm())), rel=1e-12)
    d = doc(ckpt("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--rtol", "1e-2", "--json"))
    assert d["equal"] and d["tensors"][0]["cosine"] > 0.9999
    assert largest and max(largest) <= reading.BLOCK_BYTES


def test_identical_plain_bytes_need_no_torch(mixed_files):
    """Tensors stored plainly and identical are compared as bytes: torch is never imported (memory stays small)."""
    probe = (
        "import sys\nfrom ckpt_cli.ops.diff import diff, DiffOptions\n"
        f"assert diff({str(mixed_files['safetensors'])!r}, {str(mixed_files['hf'])!r}, DiffOptions()).equal\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_group_of():
    assert group_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert group_of("model.norm.weight") == "model.norm"
    assert group_of("lm_head.weight") == "lm_head"
    assert group_of("scalar") == "scalar"
    assert group_of("optimizer.state.model.layers.3.mlp.up_proj.weight.exp_avg") == "optimizer.state.model.layers.3"
    assert group_of("optimizer.state.3.exp_avg") == "optimizer.state.3"
    assert group_of("model.layers.3.mlp.up_proj.weight", depth=4) == "model.layers.3.mlp"
