"""Orbax saves (read only), from the real producer (tests/producers/orbax_train_state.py): a JAX train state over 8
simulated devices saved with Orbax's defaults (OCDBT + zarr v2), with OCDBT off (zarr3), and from two JAX processes.
Every array out of ckpt is bit-equal to what the producer held; damaged copies fail with exit 1 naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_fails

pytest.importorskip("tensorstore")

SAVES = {"ocdbt": "ocdbt/7", "zarr3": "zarr3/7", "zarr2": "zarr2/7", "multi": "multi/7"}
WQ = "params.decoder.layers_0.mlp.wi"


def expected(root: Path, save: str) -> dict[str, np.ndarray]:
    """The producer's arrays, as raw bytes (bfloat16 as its uint16 bits)."""
    folder = root / ("multi_arrays" if save == "multi" else "arrays")
    index = json.loads((folder / "index.json").read_text())
    return {name: np.load(folder / f"{name}.npy").reshape(-1).view(np.uint8) for name in index}


def as_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


@pytest.mark.parametrize("save", SAVES)
def test_inspect(orbax_saves, ckpt, save):
    res = ckpt("inspect", orbax_saves / SAVES[save], "--json")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    assert (doc["format"], doc["step"], doc["world_size"], doc["num_tensors"]) == ("orbax", 7, 8, 29)
    roles = {t["name"]: t["role"] for t in doc["tensors"]}
    assert roles[WQ] == "model" and roles["opt_state.0.mu.embed.embedding"] == "optimizer"
    assert roles["opt_state.0.count"] == "optimizer" and roles["step"] == "other"
    assert {t["name"]: t["dtype"] for t in doc["tensors"]}["params.embed.embedding"] == "bfloat16"
    details = doc["details"]
    assert details["processes"] == (2 if save == "multi" else 1)
    assert details["items"] == ["state"]
    assert details["sharding"][WQ] == "P('data', 'model') over data=4 x model=2"
    assert details["sharding"]["params.head.bias"] == "P('model') over data=4 x model=2"
    assert doc["training_state"]["optimizer"]["kind"] == "Adam/AdamW (optax)"
    assert doc["training_state"]["optimizer"]["states"] == ["count", "mu", "nu"]


@pytest.mark.parametrize("save", SAVES)
def test_verify(orbax_saves, ckpt, save):
    res = ckpt("verify", orbax_saves / SAVES[save], "--deep")
    assert res.code == 0, res.out + res.err
    assert "orbax stores no checksums" in res.out + res.err


def test_run_root_and_tag(orbax_saves, ckpt):
    res = ckpt("inspect", orbax_saves / "zarr3", "--json")
    assert res.code == 0 and json.loads(res.out)["step"] == 7


@pytest.mark.parametrize("save", SAVES)
def test_merge_and_torch_bit_equal(orbax_saves, ckpt, tmp_path, save):
    from safetensors.torch import load_file

    want = expected(orbax_saves, save)
    src = orbax_saves / SAVES[save]
    assert ckpt("merge", src, tmp_path / "w.safetensors").code == 0
    merged = load_file(tmp_path / "w.safetensors")
    assert sorted(merged) == sorted(n for n in want if n.startswith("params."))
    assert ckpt("convert", src, tmp_path / "all.pt", "--to", "torch").code == 0
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert sorted(everything) == sorted(want)
    for name, raw in want.items():
        assert np.array_equal(as_bytes(everything[name]), raw), name
        if name in merged:
            assert np.array_equal(as_bytes(merged[name]), raw), name


def test_hf_and_dcp_bit_equal(orbax_saves, ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    want = expected(orbax_saves, "ocdbt")
    src = orbax_saves / SAVES["ocdbt"]
    assert ckpt("convert", src, tmp_path / "hf", "--to", "hf").code == 0
    hf = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(hf) == sorted(n for n in want if n.startswith("params."))
    res = ckpt("convert", src, tmp_path / "dcp", "--to", "dcp", "--world-size", "2")  # the training state (test_orbax_write.py)
    assert res.code == 0, res.err
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    dcp_names = {"opt_state.0.mu.": "optim.state.{}.exp_avg", "opt_state.0.nu.": "optim.state.{}.exp_avg_sq", "params.": "model.{}"}
    for name, raw in want.items():
        prefix = next((p for p in dcp_names if name.startswith(p)), None)
        if prefix is not None:
            assert np.array_equal(as_bytes(state[dcp_names[prefix].format(name[len(prefix) :])]), raw), name
        if name in hf:
            assert np.array_equal(as_bytes(hf[name]), raw), name


def damaged_copy(orbax_saves: Path, save: str, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(orbax_saves / save.split("/")[0], out, symlinks=True)
    return out / save.split("/")[1]


def largest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def ocdbt_value_file(step: Path) -> Path:
    return largest(step / "state" / "ocdbt.process_0" / "d")


def zarr3_chunk(step: Path) -> Path:
    return step / "state" / WQ / "c" / "1" / "1"


DAMAGE = [
    ("ocdbt truncated", "ocdbt/7", lambda s: truncate(ocdbt_value_file(s)), lambda s: ocdbt_value_file(s).name, []),
    ("ocdbt missing", "ocdbt/7", lambda s: ocdbt_value_file(s).unlink(), None, []),
    ("zarr3 truncated", "zarr3/7", lambda s: truncate(zarr3_chunk(s)), lambda s: str(zarr3_chunk(s)), []),
    ("zarr3 missing", "zarr3/7", lambda s: zarr3_chunk(s).unlink(), lambda s: WQ, []),
    ("zarr3 truncated, deep", "zarr3/7", lambda s: truncate(zarr3_chunk(s)), lambda s: WQ, ["--deep"]),
    ("zarr2 missing", "zarr2/7", lambda s: (s / "state" / WQ / "1.1").unlink(), lambda s: WQ, []),
    ("zarr2 truncated, deep", "zarr2/7", lambda s: truncate(s / "state" / WQ / "1.1"), lambda s: WQ, ["--deep"]),
    ("no commit marker", "ocdbt/7", lambda s: (s / "commit_success.txt").unlink(), lambda s: "commit_success.txt", []),
    ("no item marker", "zarr3/7", lambda s: (s / "state" / "commit_success.txt").unlink(), lambda s: "state/commit_success.txt", []),
]


@pytest.mark.parametrize("what,save,damage,named,flags", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged(orbax_saves, ckpt, tmp_path, what, save, damage, named, flags):
    step = damaged_copy(orbax_saves, save, tmp_path)
    needle = named(step) if named else None
    if what == "ocdbt missing":
        needle = ocdbt_value_file(step).name
    damage(step)
    res = ckpt("verify", step, *flags)
    assert_fails(res, *([needle] if needle else []))
    assert len((res.out + res.err).strip().splitlines()) <= 3, res.out + res.err
    assert ckpt("merge", step, tmp_path / "w.safetensors").code == 1
    assert not (tmp_path / "w.safetensors").exists()


def test_unfinished_save(orbax_saves, ckpt, tmp_path):
    step = damaged_copy(orbax_saves, "ocdbt/7", tmp_path)
    tmp = step.rename(step.parent / "8.orbax-checkpoint-tmp")
    assert_fails(ckpt("inspect", tmp), "8.orbax-checkpoint-tmp", "unfinished Orbax save")
    shutil.copytree(orbax_saves / "ocdbt/7", step)  # the root: the committed step is chosen, the unfinished one named
    res = ckpt("inspect", step.parent, "--json")
    assert res.code == 0 and json.loads(res.out)["step"] == 7
    assert "8.orbax-checkpoint-tmp" in res.out  # listed among the root's checkpoints, not read


@pytest.mark.parametrize("save", ["ocdbt/7", "zarr3/7", "zarr2/7"])
def test_manifest_catches_flipped_byte(orbax_saves, ckpt, tmp_path, save):
    step = damaged_copy(orbax_saves, save, tmp_path)
    manifest = tmp_path / "m.json"
    assert ckpt("verify", step, "--write-manifest", manifest).code == 0
    victim = {"ocdbt/7": ocdbt_value_file, "zarr3/7": zarr3_chunk, "zarr2/7": lambda s: s / "state" / WQ / "1.1"}[save](step)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01
    victim.write_bytes(bytes(data))
    assert_fails(ckpt("verify", step, "--manifest", manifest), victim.name)


@pytest.mark.parametrize("save", ["ocdbt", "zarr3", "multi"])
def test_orbax_saves_in_s3(orbax_saves, ckpt, s3, tmp_path, save):
    """A save in S3 (moto), read through tensorstore's s3 driver pointed where ckpt's S3 reads go: inspect says what
    it says of the local copy, verify --deep passes, and a merge is byte-equal to the local one; a chunk object
    deleted is exit 1 naming it."""
    local = orbax_saves / SAVES[save]
    url = s3.upload(local.parent, f"orbax/{save}") + "/7"
    on_s3, here = ckpt("inspect", url, "--json"), ckpt("inspect", local, "--json")
    assert on_s3.code == here.code == 0, on_s3.err
    assert on_s3.out.replace(url, "<root>") == here.out.replace(str(local), "<root>")
    res = ckpt("verify", "--deep", url)
    assert res.code == 0 and res.out.startswith(f"OK {url} "), res.out + res.err
    assert ckpt("merge", url, tmp_path / "s3.safetensors").code == 0
    assert ckpt("merge", local, tmp_path / "here.safetensors").code == 0
    assert (tmp_path / "s3.safetensors").read_bytes() == (tmp_path / "here.safetensors").read_bytes()
    if save == "zarr3":
        key = f"orbax/{save}/7/state/{WQ}/c/1/1"
        s3.delete(key)
        res = ckpt("verify", url)
        assert res.code == 1 and WQ in res.out + res.err, res.out + res.err
