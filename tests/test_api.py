"""The Python API: the examples of docs/api.md run, tensors read through it equal what the real producers'
loaders give (DCP, DeepSpeed, hf, and every dtype), its reports are the CLI's, and it never imports the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import assert_same_tensors, ds_to_universal
from safetensors.torch import load_file
from test_architecture import GRAPH
from test_dcp import flat_state
from test_deepspeed import zero_to_fp32
from test_readme import ROOT, run_command, shell_env

import ckpt_cli
from ckpt_cli.errors import DataError, UsageError

API_PAGE = ROOT / "docs" / "api.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", API_PAGE.read_text(), flags=re.DOTALL | re.MULTILINE)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A folder where `ckpt demo demo` ran, as the examples of docs/api.md expect."""
    root = tmp_path_factory.mktemp("api-demo")
    out = run_command("ckpt demo demo", root)
    assert (root / "demo" / "hf").is_dir(), out
    return root


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3 and all("import ckpt_cli" in b for b in BLOCKS)


def test_readme_python_examples_run(demo):
    """Every block, in page order, in its own interpreter (a notebook's fresh kernel), in the demo folder."""
    for index, block in enumerate(BLOCKS):
        needs = ("parity",) if "parity(" in block else ()  # docs/api.md says what ckpt_cli.parity needs installed
        proc = subprocess.run([sys.executable, "-c", block], cwd=demo, env=shell_env(needs), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"docs/api.md Python block {index} failed:\n{block}\n{proc.stderr[-3000:]}"


def read_all(path, **kwargs):
    with ckpt_cli.open(path, **kwargs) as ckpt:
        return {name: ckpt.tensor(name) for name in ckpt.tensors}


def test_tensor_of_an_hf_checkpoint_equals_load_file(tiny_llama):
    model, root = tiny_llama
    reference = {}
    for shard in (root / "sharded").glob("*.safetensors"):
        reference.update(load_file(shard))
    assert_same_tensors(read_all(root / "sharded"), reference)
    with ckpt_cli.open(root / "sharded") as ckpt:
        name = "model.layers.1.mlp.down_proj.weight"
        assert np.array_equal(ckpt.numpy(name), reference[name].numpy())
        assert ckpt.tensors[name] == ckpt_cli.TensorInfo(name, "float32", (32, 64), "model", 1, 2048, 8192)


def test_tensor_of_every_dtype_equals_the_producers(mixed_files):
    reference = load_file(mixed_files["safetensors"])
    for fmt in ("safetensors", "torch", "hf"):
        ours = read_all(mixed_files[fmt])
        assert_same_tensors(ours, reference)
        with ckpt_cli.open(mixed_files[fmt]) as ckpt:
            for name, tensor in reference.items():
                if tensor.dtype == torch.bfloat16:
                    with pytest.raises(UsageError, match="bfloat16"):
                        ckpt.numpy(name)
                    assert np.array_equal(ckpt.numpy(name, dtype="float32"), tensor.float().numpy())
                else:
                    array = ckpt.numpy(name)
                    assert array.dtype == tensor.numpy().dtype and array.shape == tuple(tensor.shape), name
                    assert array.tobytes() == tensor.numpy().tobytes(), name
            assert torch.equal(ckpt.tensor("fp32", dtype="bf16"), reference["fp32"].to(torch.bfloat16))


def test_numpy_reads_need_no_torch(mixed_files):
    code = (
        "import sys, ckpt_cli\n"
        f"with ckpt_cli.open({str(mixed_files['hf'])!r}) as c:\n"
        "    a = c.numpy('layer.0.weight'); b = c.numpy('int64')\n"
        "assert a.shape == (4, 4, 2) and b.dtype.name == 'int64'\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tensor_of_a_dcp_checkpoint_equals_dcp_load(fsdp2_saves):
    """FSDP2 at 2 ranks: each tensor gathered from its two chunks, as dcp's own single-process load gives it."""
    src = fsdp2_saves[2] / "ckpt"
    reference = {k: v for k, v in flat_state(src).items() if isinstance(v, torch.Tensor)}
    ours = read_all(src)
    assert set(ours) <= set(reference) and any(t.pieces > 1 for t in ckpt_cli.open(src).tensors.values())
    assert_same_tensors(ours, {k: reference[k] for k in ours})


@pytest.mark.parametrize("config", ["stage2-fp32", "stage3-bf16"])
def test_tensor_of_a_deepspeed_checkpoint_equals_deepspeeds_own(ds_saves, tmp_path, config):
    """Weights gathered from the ranks' partitions equal zero_to_fp32's, and Adam moments equal DeepSpeed's
    universal-checkpoint extraction."""
    src = ds_saves[2] / config
    with ckpt_cli.open(src) as ckpt:
        for name, ref in zero_to_fp32(src).items():
            ours = ckpt.tensor(name)
            assert ours.shape == ref.shape and torch.equal(ours.to(ref.dtype), ref), name
        compared = 0
        for param, states in ds_to_universal(src / ckpt.tag, tmp_path / "universal").items():
            for state in ("exp_avg", "exp_avg_sq"):
                if state in states:
                    ours = ckpt.tensor(f"optimizer.state.{param}.{state}")
                    assert ours.dtype == states[state].dtype and torch.equal(ours, states[state].reshape(ours.shape)), (param, state)
                    compared += 1
        assert compared >= 10


def test_open_exposes_metadata_and_closes_its_files(ds_saves):
    src = ds_saves[2] / "stage2-fp32"
    before = len(os.listdir("/proc/self/fd"))
    with ckpt_cli.open(src) as ckpt:
        assert (ckpt.format, ckpt.step, ckpt.world_size) == ("deepspeed", 3, 2)
        assert ckpt.summary() == ckpt_cli.inspect(src)
        assert ckpt.training_state == ckpt.summary()["training_state"]
        assert {i.role for i in ckpt.tensors.values()} == {"model", "optimizer", "other"}
        assert ckpt.tree().to_json()["roles"]["model"]["params"] == ckpt.summary()["num_params"]
        for name in list(ckpt)[:5]:
            ckpt.tensor(name)
        assert len(os.listdir("/proc/self/fd")) > before
        assert repr(ckpt).startswith("<ckpt_cli.Checkpoint deepspeed")
    assert len(os.listdir("/proc/self/fd")) == before


def test_reports_are_the_clis(ckpt, demo, tmp_path):
    src = demo / "demo" / "training_state.pt"
    assert ckpt_cli.inspect(src) == json.loads(ckpt("inspect", src, "--json").out)
    assert ckpt_cli.verify(src, deep=True).to_json() == json.loads(ckpt("verify", src, "--deep", "--json").out)
    args = ("--to", "hf", "--weights-only", "--strip-prefix", "model.", "--max-shard-size", "30kB")
    cli_plan = json.loads(ckpt("convert", src, tmp_path / "cli", *args, "--dry-run", "--json").out)
    options = {"to": "hf", "weights_only": True, "strip_prefix": "model."}
    api_plan = ckpt_cli.convert(src, tmp_path / "cli", **options, max_shard_size=30_000, dry_run=True)
    assert api_plan.to_json() == cli_plan and not api_plan.written and not (tmp_path / "cli").exists()
    # the same write through both: the same files, byte for byte
    assert ckpt("convert", src, tmp_path / "cli", *args, "-q").code == 0
    done = ckpt_cli.convert(src, tmp_path / "api", **options, max_shard_size="30kB")
    assert done.written and done.notes == cli_plan["notes"]
    for f in done.files:
        assert (tmp_path / "api" / f["path"]).read_bytes() == (tmp_path / "cli" / f["path"]).read_bytes()
    assert ckpt_cli.split(src, tmp_path / "split", num_shards=2).format == "hf"
    assert ckpt_cli.merge(tmp_path / "split", tmp_path / "m.pt").destination == str(tmp_path / "m.pt")
    assert ckpt_cli.reshard(demo / "demo" / "dcp", tmp_path / "dcp2", world_size=2).written
    assert ckpt_cli.verify(tmp_path / "dcp2", against=demo / "demo" / "dcp").ok


def test_errors_are_ckpt_errors(demo, tmp_path):
    src = demo / "demo" / "hf"
    with pytest.raises(UsageError, match="no such file or folder"):
        ckpt_cli.open(tmp_path / "missing")
    with pytest.raises(UsageError, match="world_size applies to deepspeed, dcp and dtensor targets, not hf"):
        ckpt_cli.convert(src, tmp_path / "x", to="hf", world_size=2)
    with pytest.raises(UsageError, match="not both"):
        ckpt_cli.split(src, tmp_path / "x", num_shards=2, max_shard_size="1MB")
    with pytest.raises(UsageError, match="keep, fp32, bf16, fp16"):
        ckpt_cli.merge(src, tmp_path / "x.safetensors", dtype="fp7")
    broken = tmp_path / "broken.safetensors"
    data = (demo / "demo" / "model.safetensors").read_bytes()
    broken.write_bytes(data[:-100])
    assert not ckpt_cli.verify(broken).ok and "truncated" in ckpt_cli.verify(broken).problems[0]
    with pytest.raises(DataError, match="runs past the end of the file"):
        ckpt_cli.convert(broken, tmp_path / "y", to="hf")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data)
    with ckpt_cli.open(cut) as ckpt:
        cut.write_bytes(data[:-100])  # truncated after it was opened: the read names the file
        with pytest.raises(DataError, match=f"{cut}: truncated"):
            ckpt.tensor(list(ckpt)[-1])
    # `filter=` is the keyword of every call that takes the CLI's --filter, and its errors name it so
    for call in (lambda f: ckpt_cli.inspect(src, filter=f), lambda f: ckpt_cli.diff(src, src, filter=f)):
        with pytest.raises(UsageError, match=r"^filter nothing\* matches no tensor"):
            call("nothing*")
    assert [t["name"] for t in ckpt_cli.inspect(src, filter="*embed*")["tensors"]] == ["embed.weight"]
    with ckpt_cli.open(src) as ckpt:
        assert ckpt.summary(filter=["*embed*"])["tensors"] == ckpt_cli.inspect(src, filter="*embed*")["tensors"]


def test_the_api_never_imports_the_cli():
    seen, todo = set(), ["ckpt_cli.api"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += GRAPH.get(name, ())
    assert not [m for m in seen if m.startswith("ckpt_cli.cli")]
    assert {"open", "convert", "reshard", "merge", "split", "verify", "inspect"} <= set(ckpt_cli.__all__)
