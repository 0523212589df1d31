"""Conversions among safetensors, hf and torch: bit-exact, checked by the real loaders."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_same_tensors, mixed_state_dict
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file


def load_any(path):
    """Load with the real consumer of each format."""
    if path.is_dir():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        out = {}
        for file in sorted(set(index["weight_map"].values())):
            out.update(load_file(path / file))
        assert set(out) == set(index["weight_map"])
        return out
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True, mmap=True)


@pytest.mark.parametrize("src", ["safetensors", "torch", "hf"])
@pytest.mark.parametrize("to", ["safetensors", "torch", "hf"])
def test_convert_roundtrips_bit_exact(ckpt, mixed_files, tmp_path, src, to):
    dest = tmp_path / ("out" if to == "hf" else f"out.{'pt' if to == 'torch' else 'safetensors'}")
    res = ckpt("convert", mixed_files[src], dest, "--to", to, "--quiet")
    assert res.code == 0, res.err
    assert_same_tensors(load_any(dest), mixed_state_dict())
    back = tmp_path / "back.safetensors"
    assert ckpt("convert", dest, back, "--to", "safetensors", "-q").code == 0
    assert_same_tensors(load_file(back), mixed_state_dict())


def test_safetensors_output_is_byte_identical_to_save_file(ckpt, mixed_files, tmp_path):
    dest = tmp_path / "out.safetensors"
    assert ckpt("convert", mixed_files["torch"], dest, "--to", "safetensors", "-q").code == 0
    assert dest.read_bytes() == mixed_files["safetensors"].read_bytes()


def test_split_by_size_is_byte_identical_to_the_hub(ckpt, mixed_files, tmp_path):
    """Same shard boundaries, file names and bytes as huggingface_hub.save_torch_state_dict."""
    sd = mixed_state_dict()
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(sd, tmp_path / "hub", max_shard_size=200)
    res = ckpt("split", mixed_files["torch"], tmp_path / "ours", "--max-shard-size", "200", "-q")
    assert res.code == 0, res.err
    hub_files = sorted(p.name for p in (tmp_path / "hub").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == hub_files
    for name in hub_files:
        ours, hub = (tmp_path / "ours" / name).read_bytes(), (tmp_path / "hub" / name).read_bytes()
        if name.endswith(".json"):
            assert json.loads(ours) == json.loads(hub)
        else:
            assert ours == hub, name


def test_num_shards_gives_exactly_n_balanced_shards(ckpt, tmp_path):
    sd = {f"w{i}": torch.full((100 + i,), float(i)) for i in range(10)}
    save_file(sd, tmp_path / "in.safetensors")
    assert ckpt("split", tmp_path / "in.safetensors", tmp_path / "out", "--num-shards", "4", "-q").code == 0
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert [p.name for p in shards] == [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)]
    sizes = [p.stat().st_size for p in shards]
    assert max(sizes) < 2 * min(sizes)
    assert_same_tensors(load_any(tmp_path / "out"), sd)
    assert ckpt("reshard", tmp_path / "out", tmp_path / "two", "--num-shards", "2", "-q").code == 0
    assert len(list((tmp_path / "two").glob("*.safetensors"))) == 2
    assert_same_tensors(load_any(tmp_path / "two"), sd)


def test_torch_output_keeps_nesting_ties_and_training_state(ckpt, tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 1,
        "rng": [torch.get_rng_state()],
        "dataloader": {"epoch": 2, "offset": 96, "name": "train"},
        "dtype": torch.bfloat16,
    }
    torch.save(state, tmp_path / "in.pt")
    assert ckpt("convert", tmp_path / "in.pt", tmp_path / "out.pt", "--to", "torch", "-q").code == 0
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["step"] == 1 and out["dataloader"] == state["dataloader"] and out["dtype"] is torch.bfloat16
    assert out["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert isinstance(out["rng"], list) and torch.equal(out["rng"][0], state["rng"][0])
    for k, v in state["optimizer"]["state"][0].items():
        assert torch.equal(out["optimizer"]["state"][0][k], v)
    w = out["model"]
    assert w["0.weight"].data_ptr() == w["1.weight"].data_ptr()  # still tied
    torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)).load_state_dict(w)


def test_views_write_only_the_bytes_they_see(ckpt, tmp_path):
    """A slice of a big storage must not drag the whole storage along (zero_to_fp32's .bin bloat)."""
    big = torch.arange(100_000, dtype=torch.float32)
    sd = {"a": big[10:20], "t": torch.arange(12.0).reshape(3, 4).t()}
    torch.save(sd, tmp_path / "views.pt")
    assert ckpt("convert", tmp_path / "views.pt", tmp_path / "out.pt", "--to", "torch", "-q").code == 0
    assert (tmp_path / "out.pt").stat().st_size < 10_000
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["t"], sd["t"])
    assert ckpt("convert", tmp_path / "views.pt", tmp_path / "out.safetensors", "--to", "safetensors", "-q").code == 0
    assert torch.equal(load_file(tmp_path / "out.safetensors")["t"], sd["t"])


def test_dtype_cast_select_and_prefixes(ckpt, tmp_path):
    sd = {"model.a": torch.randn(3, 3), "model.b": torch.randn(2), "model.ids": torch.arange(4)}
    save_file(sd, tmp_path / "in.safetensors")
    res = ckpt(
        "convert",
        tmp_path / "in.safetensors",
        tmp_path / "o.safetensors",
        "--to",
        "safetensors",
        "--dtype",
        "bf16",
        "--select",
        "model.a",
        "--select",
        "model.ids",
        "--strip-prefix",
        "model.",
        "--add-prefix",
        "x.",
    )
    assert res.code == 0, res.err
    out = load_file(tmp_path / "o.safetensors")
    assert sorted(out) == ["x.a", "x.ids"]
    assert torch.equal(out["x.a"], sd["model.a"].to(torch.bfloat16))
    assert out["x.ids"].dtype == torch.int64  # integers are never cast


def test_merge_weights_only_and_all(ckpt, tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}}, "step": 5}, tmp_path / "in.pt")
    assert ckpt("merge", tmp_path / "in.pt", tmp_path / "w.safetensors", "-q").code == 0
    assert list(load_file(tmp_path / "w.safetensors")) == ["model.w"]
    assert ckpt("merge", tmp_path / "in.pt", tmp_path / "all.pt", "--all", "-q").code == 0
    out = torch.load(tmp_path / "all.pt", weights_only=True)
    assert out["step"] == 5 and torch.equal(out["optimizer"]["state"][0]["exp_avg"], torch.zeros(2))
    res = ckpt("merge", tmp_path / "in.pt", tmp_path / "all.safetensors", "--all")
    assert res.code == 2 and "safetensors cannot hold" in res.err


def test_legacy_bin_index_is_read(ckpt, tmp_path):
    """huggingface_hub's pickle sharding (pytorch_model-0000k-of-0000n.bin + pytorch_model.bin.index.json)."""
    sd = mixed_state_dict()
    (tmp_path / "legacy").mkdir()
    save_torch_state_dict(sd, tmp_path / "legacy", max_shard_size=200, safe_serialization=False)
    assert (tmp_path / "legacy" / "pytorch_model.bin.index.json").exists()
    doc = json.loads(ckpt("inspect", tmp_path / "legacy", "--json").out)
    assert doc["format"] == "hf" and doc["num_tensors"] == len(sd)
    assert ckpt("verify", tmp_path / "legacy", "--deep").code == 0
    assert ckpt("merge", tmp_path / "legacy", tmp_path / "m.safetensors", "-q").code == 0
    assert_same_tensors(load_file(tmp_path / "m.safetensors"), sd)
