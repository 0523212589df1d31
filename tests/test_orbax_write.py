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


def test_orbax_to_dcp_refuses_layout_transforms(orbax_saves, ckpt, tmp_path):
    """A training-state conversion renames only: a name map's transpose would change weights but not their moments."""
    (tmp_path / "map.yaml").write_text("transpose: ['head\\\\.kernel']\n")
    res = ckpt("convert", orbax_saves / SRC, tmp_path / "dcp", "--to", "dcp", "--world-size", "2", "--name-map", tmp_path / "map.yaml")
    assert res.code == 2 and "not to training-state conversions" in res.err
    assert not (tmp_path / "dcp").exists()


def test_orbax_to_dcp_renames(orbax_saves, ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp

    res = ckpt("convert", orbax_saves / SRC, tmp_path / "dcp", "--to", "dcp", "--world-size", "2", "--rename", "^decoder\\.=model.")
    assert res.code == 0, res.err
    keys = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    assert "model.model.layers_0.attn.wq" in keys and "optim.state.model.layers_0.attn.wq.exp_avg_sq" in keys
    assert "optim.state.head.bias.step" in keys and "step" in keys
