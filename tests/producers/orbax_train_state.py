"""Orbax saves of a small JAX train state, for tests/test_orbax.py: `python orbax_train_state.py OUT`.

Run with JAX on the CPU and XLA_FLAGS=--xla_force_host_platform_device_count=8: the params of a tiny
transformer-ish tree (2-D kernels of up to 16 KiB, so chunks above and below OCDBT's 1 KiB inline limit, a bf16
embedding, a scalar) and optax adamw's state, sharded over a 4 x 2 mesh of 8 simulated devices, saved by a
CheckpointManager with Orbax's defaults (OCDBT holding zarr v2 arrays; OUT/ocdbt/<step>/state), with OCDBT off and
zarr3 (OUT/zarr3/<step>/state), and with OCDBT off and zarr v2 (OUT/zarr2/<step>/state, older saves' layout). Every
leaf is saved too as OUT/arrays/<name>.npy (name: the pytree path joined with '.'; bfloat16 as its uint16 bits), bit
for bit what the producer held; OUT/arrays/index.json lists them.

With `--process I --processes N --port P` (N local processes, gloo collectives, 4 devices each): one save from N JAX
processes, Orbax's defaults, OUT/multi/<step>/state (each process writes its ocdbt.process_I/), and OUT/multi_arrays.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

STEP = 7


def params() -> dict:
    key = jax.random.PRNGKey(0)
    k = jax.random.split(key, 8)
    return {
        "embed": {"embedding": jax.random.normal(k[0], (64, 32), jnp.float32).astype(jnp.bfloat16)},
        "decoder": {
            "layers_0": {
                "attn": {"wq": jax.random.normal(k[1], (32, 32)), "wo": jax.random.normal(k[2], (32, 32))},
                "mlp": {"wi": jax.random.normal(k[3], (32, 128)), "wo": jax.random.normal(k[4], (128, 32))},
                "norm": {"scale": jnp.ones((32,), jnp.float32) + 0.5},
            },
            "final_norm": {"scale": jax.random.normal(k[5], (32,))},
        },
        "head": {"kernel": jax.random.normal(k[6], (32, 96)), "bias": jnp.arange(96, dtype=jnp.float32)},
    }


def spec_for(x: jax.Array) -> P:
    if x.ndim == 2:
        rows, cols = x.shape
        return P("data" if rows % 4 == 0 else None, "model" if cols % 2 == 0 else None)
    if x.ndim == 1 and x.shape[0] % 2 == 0:
        return P("model")
    return P()


def train_state() -> dict:
    """The state on this process's first device (every process computes the same values)."""
    p = params()
    opt = optax.adamw(1e-3)
    opt_state = opt.init(p)
    grads = jax.tree_util.tree_map(lambda x: jnp.full(x.shape, 0.01, x.dtype), p)
    updates, opt_state = opt.update(grads, opt_state, p)  # nonzero moments and a count of 1
    p = optax.apply_updates(p, updates)
    return {"params": p, "opt_state": opt_state, "step": jnp.asarray(STEP, jnp.int32)}


def sharded(state: dict, mesh: Mesh) -> dict:
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, NamedSharding(mesh, spec_for(x))), state)


def leaf_name(path: tuple) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def save_arrays(state: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = leaf_name(path)
        value = np.asarray(jax.device_get(leaf))
        raw = value.view(np.uint16) if value.dtype.name == "bfloat16" else value  # .npy has no bfloat16
        np.save(out / f"{name}.npy", raw)
        index[name] = {"dtype": value.dtype.name, "shape": list(value.shape)}
    (out / "index.json").write_text(json.dumps(index, indent=1))


def save(state: dict, root: Path, ocdbt: bool, zarr3: bool = True) -> None:
    """A CheckpointManager save of item `state`: Orbax's defaults (OCDBT, zarr v2 arrays inside it), or with OCDBT
    off, zarr3 or zarr v2 (one folder of chunk files per array: older Orbax's layout)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=3)
    handlers = {} if ocdbt else {"item_handlers": {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=zarr3)}}
    with ocp.CheckpointManager(root, options=options, **handlers) as mgr:
        item = ocp.args.StandardSave(state) if ocdbt else ocp.args.PyTreeSave(state)
        mgr.save(STEP, args=ocp.args.Composite(state=item))
        mgr.wait_until_finished()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--process", type=int)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.process is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process)
    devices = np.array(jax.devices()).reshape(4, -1)
    mesh = Mesh(devices, ("data", "model"))
    host = train_state()
    state = sharded(host, mesh)
    if args.process is not None:
        save(state, args.out / "multi", ocdbt=True)
        if args.process == 0:
            save_arrays(host, args.out / "multi_arrays")
        return
    save_arrays(host, args.out / "arrays")
    save(state, args.out / "ocdbt", ocdbt=True)
    save(state, args.out / "zarr3", ocdbt=False)
    save(state, args.out / "zarr2", ocdbt=False, zarr3=False)


if __name__ == "__main__":
    main()
