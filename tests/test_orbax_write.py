"""A run's training state between JAX and PyTorch, proved by the real consumers: an Orbax adamw train state
(tests/producers/orbax_train_state.py) converted to DCP loads into FSDP2 + torch AdamW with set_state_dict, every
weight and moment bit-equal to what Orbax itself restores (tests/producers/orbax_restore.py); `--to orbax` writes a
save that Orbax's own checkpointers restore, bit-equal, from DCP, safetensors and after Orbax -> DCP -> Orbax."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import PRODUCERS, torchrun

pytest.importorskip("tensorstore")
pytest.importorskip("orbax.checkpoint")

SRC = "ocdbt/7"


def orbax_restore(src: Path, out: Path, how: str = "adamw", devices: int = 1) -> dict[str, np.ndarray]:
    """Orbax's own restore of `src` (an item folder): name -> the array's bytes; index.json beside them."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    cmd = [sys.executable, str(PRODUCERS / "orbax_restore.py"), str(src), str(out), "--how", how]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    index = json.loads((out / "index.json").read_text())
    return {name: np.load(out / f"{name}.npy") for name in index}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_orbax_to_dcp_loads_in_fsdp2(orbax_saves, ckpt, tmp_path, world):
    """exp_avg = mu, exp_avg_sq = nu, step = count, weights = params, by the save's own names (JAX shapes as they are)."""
    src = orbax_saves / SRC
    ref = tmp_path / "ref"
    want = orbax_restore(src / "state", ref)
    res = ckpt("convert", src, tmp_path / "dcp", "--to", "dcp", "--world-size", str(world))
    assert res.code == 0, res.err
    assert "optax.adamw's defaults" in res.err  # the hyper-parameters Orbax does not save, said
    assert int(want["opt_state.0.count"]) == 1 and int(want["step"]) == 7
    out = torchrun(world, "orbax_fsdp2.py", "load", tmp_path / "dcp", ref)
    assert "ORBAX-LOAD-OK 36" in out


@pytest.mark.parametrize(
    "rule",
    [
        "transpose: ['params\\.head\\.kernel']",
        "scale:\n  - {from: 'params\\.head\\.kernel', by: 2}",
        "unstack:\n  - {from: 'params\\.head\\.kernel', axis: 1, to: 'h{layer}'}",
        "reshape:\n  - {from: 'params\\.head\\.kernel', shape: [-1]}",
    ],
)
def test_orbax_to_dcp_refuses_layout_transforms(orbax_saves, ckpt, tmp_path, rule):
    """A training-state conversion renames only: a name map's transpose, scale, unstack or reshape would change a
    weight but not its moments."""
    (tmp_path / "map.yaml").write_text(rule + "\n")
    res = ckpt("convert", orbax_saves / SRC, tmp_path / "dcp", "--to", "dcp", "--world-size", "2", "--name-map", tmp_path / "map.yaml")
    assert res.code == 2 and "not to training-state conversions" in res.err, res.err
    assert not (tmp_path / "dcp").exists()


def test_orbax_to_dcp_renames(orbax_saves, ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp

    res = ckpt("convert", orbax_saves / SRC, tmp_path / "dcp", "--to", "dcp", "--world-size", "2", "--rename", "^decoder\\.=model.")
    assert res.code == 0, res.err
    keys = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    assert "model.model.layers_0.attn.wq" in keys and "optim.state.model.layers_0.attn.wq.exp_avg_sq" in keys
    assert "optim.state.head.bias.step" in keys and "step" in keys


def equal_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.slow
def test_to_orbax_round_trips(orbax_saves, ckpt, tmp_path):
    """Orbax -> Orbax and Orbax -> DCP -> Orbax: Orbax restores each into an optax adamw state, every leaf bit-equal
    to its restore of the original save."""
    src = orbax_saves / SRC
    want = orbax_restore(src / "state", tmp_path / "want")
    assert ckpt("convert", src, tmp_path / "same", "--to", "orbax").code == 0
    assert ckpt("convert", src, tmp_path / "dcp", "--to", "dcp", "--world-size", "3").code == 0
    res = ckpt("convert", tmp_path / "dcp", tmp_path / "back", "--to", "orbax")
    assert res.code == 0, res.err
    assert "optax.adamw's state" in res.err
    for out in ("same", "back"):
        assert sorted(p.name for p in (tmp_path / out).iterdir()) == [
            "_CHECKPOINT_METADATA",
            "_METADATA",
            "commit_success.txt",
            "d",
            "manifest.ocdbt",
        ]
        got = orbax_restore(tmp_path / out, tmp_path / f"got-{out}")
        assert sorted(got) == sorted(want)
        for name, array in want.items():
            assert equal_bytes(got[name], array), (out, name)
    res = ckpt("verify", tmp_path / "back", "--deep")
    assert res.code == 0, res.out + res.err


@pytest.mark.slow
def test_fsdp2_dcp_to_orbax(ckpt, tmp_path):
    """A real FSDP2 run's DCP (torch AdamW, two steps, 2 ranks) -> Orbax: restored by Orbax into optax.adamw's state,
    params = weights, mu = exp_avg, nu = exp_avg_sq, count = step, step = the run's step, bit for bit."""
    import torch

    torchrun(2, "orbax_fsdp2.py", "save", tmp_path / "run")
    res = ckpt("convert", tmp_path / "run", tmp_path / "orbax", "--to", "orbax")
    assert res.code == 0, res.err
    got = orbax_restore(tmp_path / "orbax", tmp_path / "got")
    ref = torch.load(tmp_path / "run_ref" / "state.pt", weights_only=True)
    arrays = [n for n in ref if not n.startswith("step:")]
    assert len(arrays) == 27 and set(arrays) <= set(got)
    for name in arrays:
        raw = ref[name].contiguous().reshape(-1).view(torch.uint8).numpy()
        assert got[name].reshape(-1).view(np.uint8).tobytes() == raw.tobytes(), name
    assert int(got["opt_state.0.count"]) == 2 and got["opt_state.0.count"].dtype == np.int32 and int(got["step"]) == 2


def test_deepspeed_to_orbax(ds_saves, ckpt, tmp_path):
    """A transformers Llama trained under DeepSpeed ZeRO-2 on 2 ranks -> Orbax: Orbax's restore holds, for every
    parameter, DeepSpeed's own extraction (ds_to_universal) bit for bit: params = fp32 masters, mu = exp_avg,
    nu = exp_avg_sq; count and step = the 2 steps taken."""
    import torch
    from conftest import ds_to_universal

    tag = ds_saves[2] / "llama"
    res = ckpt("convert", tag, tmp_path / "orbax", "--to", "orbax", "--orbax-storage", "ocdbt-zarr3")
    assert res.code == 0, res.err
    got = orbax_restore(tmp_path / "orbax", tmp_path / "got", "pytree")
    want = ds_to_universal(tag / "global_step2", tmp_path / "universal")
    assert len(want) == 21
    for name, state in want.items():
        for key, leaf in (("fp32", "params"), ("exp_avg", "opt_state.0.mu"), ("exp_avg_sq", "opt_state.0.nu")):
            raw = state[key].contiguous().reshape(-1).view(torch.uint8).numpy()
            assert got[f"{leaf}.{name}"].reshape(-1).view(np.uint8).tobytes() == raw.tobytes(), (name, key)
    assert int(got["opt_state.0.count"]) == 2 and int(got["step"]) == 2


@pytest.mark.parametrize("stage", [2, 3])
def test_orbax_to_deepspeed(maxtext_saves, ckpt, tmp_path, stage):
    """A MaxText-layout optax adamw train state (float32, scanned) -> DeepSpeed ZeRO-2 and 3 on 2 ranks: DeepSpeed's own
    extraction (ds_to_universal) gives, for every parameter, Orbax's own restore of the source bit for bit: fp32 master
    = params, exp_avg = mu, exp_avg_sq = nu."""
    import torch
    from conftest import ds_to_universal

    out = tmp_path / "ds"
    res = ckpt("convert", maxtext_saves / "scanned" / "10", out, "--to", "deepspeed", "--world-size", "2", "--zero-stage", str(stage))
    assert res.code == 0, res.err
    got = ds_to_universal(out / "global_step10", tmp_path / "universal")
    want = orbax_restore(maxtext_saves / "scanned" / "10" / "items", tmp_path / "orbax", "pytree", devices=8)
    assert len(got) == 12
    for name, state in got.items():
        for key, leaf in (("fp32", "params"), ("exp_avg", "opt_state.0.mu"), ("exp_avg_sq", "opt_state.0.nu")):
            raw = state[key].contiguous().reshape(-1).view(torch.uint8).numpy()
            assert want[f"{leaf}.{name}"].reshape(-1).view(np.uint8).tobytes() == raw.tobytes(), (name, key)


@pytest.mark.parametrize("storage", [None, "ocdbt-zarr3", "zarr3"])
def test_safetensors_to_orbax(ckpt, tmp_path, storage):
    """Weights (a safetensors file saved by safetensors itself) -> an Orbax tree from their dotted names, restored by
    PyTreeCheckpointer and StandardCheckpointer without a target; ckpt reads its own output back. In each storage:
    OCDBT of zarr v2 arrays (Orbax's defaults), OCDBT of zarr3 arrays (MaxText's), zarr3 folders without OCDBT."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {
        "model.embed.weight": torch.randn(50, 16).to(torch.bfloat16),
        "model.layers.0.w": torch.randn(16, 16),
        "model.layers.1.w": torch.randn(16, 16),
        "model.norm": torch.arange(16, dtype=torch.float16),
        "count": torch.tensor(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    res = ckpt(
        "convert", tmp_path / "w.safetensors", tmp_path / "orbax", "--to", "orbax", *(["--orbax-storage", storage] if storage else [])
    )
    assert res.code == 0, res.err
    meta = json.loads((tmp_path / "orbax" / "_METADATA").read_text())
    assert (meta["use_ocdbt"], meta["use_zarr3"]) == {None: (True, False), "ocdbt-zarr3": (True, True), "zarr3": (False, True)}[storage]
    assert (tmp_path / "orbax" / "manifest.ocdbt").exists() == (storage != "zarr3")
    for how in ("pytree", "standard"):
        got = orbax_restore(tmp_path / "orbax", tmp_path / how, how)
        assert sorted(got) == sorted(tensors)
        for name, tensor in tensors.items():
            assert got[name].shape == tuple(tensor.shape), name
            assert got[name].reshape(-1).view(np.uint8).tobytes() == tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), name
    doc = json.loads(ckpt("inspect", tmp_path / "orbax", "--json").out)
    assert doc["format"] == "orbax" and doc["num_tensors"] == 6
    assert {t["name"]: t["dtype"] for t in doc["tensors"]}["model.embed.weight"] == "bfloat16"


def test_unfinished_write_not_committed(orbax_saves, ckpt, tmp_path):
    """A source chunk that fails to decode half way through the write: exit 1 naming it, and no destination (nor its
    temporary sibling) left behind."""
    import shutil

    shutil.copytree(orbax_saves / "zarr3", tmp_path / "run")
    chunk = tmp_path / "run" / "7" / "state" / "params.decoder.layers_0.mlp.wi" / "c" / "1" / "1"
    data = bytearray(chunk.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)  # the chunk's zstd frames zeroed: its index still fits the file
    chunk.write_bytes(bytes(data))
    res = ckpt("convert", tmp_path / "run" / "7", tmp_path / "out", "--to", "orbax")
    assert res.code == 1 and "params.decoder.layers_0.mlp.wi" in res.err, res.err
    assert "Traceback" not in res.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_to_orbax_refusals(orbax_saves, ckpt, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    save_file({"a.b": torch.zeros(2), "a.b.c": torch.zeros(2)}, tmp_path / "w.safetensors")
    res = ckpt("convert", tmp_path / "w.safetensors", tmp_path / "out", "--to", "orbax")
    assert res.code == 2 and "'a.b' and 'a.b.c' cannot both be leaves" in res.err
    assert not (tmp_path / "out").exists()
    res = ckpt("convert", orbax_saves / SRC, tmp_path / "out", "--to", "orbax", "--world-size", "2")
    assert res.code == 2 and "--world-size" in res.err
    res = ckpt("convert", orbax_saves / SRC, tmp_path / "out", "--to", "hf", "--orbax-storage", "zarr3")
    assert res.code == 2 and "--orbax-storage applies to orbax targets" in res.err
    res = ckpt("convert", orbax_saves / SRC, tmp_path / "out", "--to", "orbax", "--orbax-storage", "zarr2")
    assert res.code == 2 and "--orbax-storage" in res.err
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: one OCDBT database has one writer
    res = ckpt("convert", orbax_saves / SRC, tmp_path / "out", "--to", "orbax")
    assert res.code == 2 and "without torchrun" in res.err
    assert not (tmp_path / "out").exists()


def test_transpose_of_orbax_kernels(orbax_saves, ckpt, tmp_path):
    """A name map's transpose of a JAX kernel ([in, out] -> a torch Linear's [out, in]): an Orbax array read by boxes
    of its columns, into safetensors and into DCP at 3 ranks, bit-equal to the producer's array transposed."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    (tmp_path / "map.yaml").write_text("transpose: ['params\\.(head\\.kernel|decoder\\.layers_0\\.mlp\\.wi)']\n")
    src = orbax_saves / SRC
    res = ckpt("convert", src, tmp_path / "w.safetensors", "--to", "safetensors", "--name-map", tmp_path / "map.yaml")
    assert res.code == 0, res.err
    res = ckpt("convert", src, tmp_path / "dcp", "--to", "dcp", "--world-size", "3", "--weights-only", "--name-map", tmp_path / "map.yaml")
    assert res.code == 0, res.err
    flat = load_file(tmp_path / "w.safetensors")
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    names = ["params.head.kernel", "params.decoder.layers_0.mlp.wi"]
    state = {n: torch.empty(meta.state_dict_metadata[n].size) for n in names}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    for name in names:
        want = np.load(orbax_saves / "arrays" / f"{name}.npy").T
        assert np.array_equal(flat[name].numpy(), want) and np.array_equal(state[name].numpy(), want), name


def test_split_permute_and_stack_of_orbax_arrays(orbax_saves, ckpt, tmp_path):
    """A name map's split, permute and stack of computed tensors (Orbax arrays read through tensorstore) read their
    element ranges through them: bit-equal to the producer's arrays cut, permuted (torchtitan's _permute) and stacked;
    two outputs of one source are two tensors, not one tied."""
    from safetensors.torch import load_file

    (tmp_path / "map.yaml").write_text(
        "split:\n  - {from: 'params\\.decoder\\.layers_0\\.mlp\\.wo', to: ['top', 'bottom']}\n"
        "permute:\n  - {from: 'params\\.decoder\\.layers_0\\.attn\\.wq', heads: 4, rope: halves}\n"
        "stack:\n  - {from: 'params\\.decoder\\.layers_(?P<index>\\d+)\\.attn\\.wo', to: 'stacked'}\n"
    )
    out, name_map = tmp_path / "w.safetensors", tmp_path / "map.yaml"
    res = ckpt("convert", orbax_saves / SRC, out, "--to", "safetensors", "--weights-only", "--name-map", name_map)
    assert res.code == 0, res.err
    got = {k: v.numpy() for k, v in load_file(out).items() if k in ("top", "bottom", "stacked") or k.endswith("attn.wq")}

    def array(name: str) -> np.ndarray:
        return np.load(orbax_saves / "arrays" / f"{name}.npy")

    wo = array("params.decoder.layers_0.mlp.wo")
    assert np.array_equal(got["top"], wo[: len(wo) // 2]) and np.array_equal(got["bottom"], wo[len(wo) // 2 :])
    wq = array("params.decoder.layers_0.attn.wq")
    rows, cols = wq.shape
    want = wq.reshape(4, rows // 8, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)
    assert np.array_equal(got["params.decoder.layers_0.attn.wq"], want)
    assert np.array_equal(got["stacked"], array("params.decoder.layers_0.attn.wo")[None])


def test_reshape_of_orbax_arrays(orbax_saves, ckpt, tmp_path):
    """A name map's reshape of Orbax arrays (a kernel viewed as [embed, heads, head_dim], the layout JAX attention keeps)
    reads them through tensorstore as they are: into safetensors and into DCP at 3 ranks, bit-equal to numpy's reshape."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    (tmp_path / "map.yaml").write_text(
        "reshape:\n  - {from: 'params\\.head\\.kernel', shape: [0, 4, -1]}\n"
        "  - {from: 'params\\.decoder\\.layers_0\\.mlp\\.wi', shape: [4, 8, 128]}\n"
    )
    src = orbax_saves / SRC
    res = ckpt("convert", src, tmp_path / "w.safetensors", "--to", "safetensors", "--weights-only", "--name-map", tmp_path / "map.yaml")
    assert res.code == 0 and "2 reshaped" in res.err, res.err
    res = ckpt("convert", src, tmp_path / "dcp", "--to", "dcp", "--world-size", "3", "--weights-only", "--name-map", tmp_path / "map.yaml")
    assert res.code == 0, res.err
    flat = load_file(tmp_path / "w.safetensors")
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    wanted = {"params.head.kernel": (32, 4, 24), "params.decoder.layers_0.mlp.wi": (4, 8, 128)}
    state = {n: torch.empty(meta.state_dict_metadata[n].size) for n in wanted}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    for name, shape in wanted.items():
        want = np.load(orbax_saves / "arrays" / f"{name}.npy").reshape(shape)
        assert np.array_equal(flat[name].numpy(), want) and np.array_equal(state[name].numpy(), want), name


def test_a_damaged_torch_source_is_not_written_to_orbax(ckpt, tmp_path):
    """A torch.save file whose record fails its CRC32: the write to Orbax reads it without torch, by byte range, and
    still checks each record it reads (exit 1, no destination), as every other write does."""
    import torch

    torch.manual_seed(0)
    torch.save({"w": torch.randn(256, 256), "b": torch.randn(256)}, tmp_path / "m.pt")
    data = bytearray((tmp_path / "m.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / "bad.pt").write_bytes(bytes(data))
    assert ckpt("convert", tmp_path / "m.pt", tmp_path / "good", "--to", "orbax").code == 0
    res = ckpt("convert", tmp_path / "bad.pt", tmp_path / "out", "--to", "orbax")
    assert res.code == 1 and "fails its CRC32 check" in res.err, res.err
    assert not (tmp_path / "out").exists()
