"""Orbax's own restore of a save, for tests/test_orbax.py and tests/test_orbax_write.py:

    python orbax_restore.py SRC OUT [--how pytree|standard|adamw]

pytree: `PyTreeCheckpointer().restore(SRC)` with no target (the tree as its metadata records it); standard:
`StandardCheckpointer().restore(SRC)`; adamw: `StandardCheckpointer().restore(SRC, target)` with the abstract train state
of tests/producers/orbax_train_state.py ({params, opt_state: optax.adamw(1e-3).init(params), step}) on one CPU device,
so a save restores into an optax adamw state. Every leaf goes to OUT/<name>.npy as the arrays of orbax_train_state.py
do (name: the pytree path joined with '.'; bfloat16 as its uint16 bits), listed in OUT/index.json with its type.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from orbax_train_state import leaf_name, params  # noqa: E402


def adamw_target() -> dict:
    p = params()
    state = {"params": p, "opt_state": optax.adamw(1e-3).init(p), "step": jax.numpy.asarray(0, jax.numpy.int32)}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--how", choices=("pytree", "standard", "adamw"), default="pytree")
    args = ap.parse_args()
    src = args.src.resolve()
    if args.how == "pytree":
        with ocp.PyTreeCheckpointer() as ck:
            tree = ck.restore(src)
    elif args.how == "standard":
        with ocp.StandardCheckpointer() as ck:
            tree = ck.restore(src)
    else:
        with ocp.StandardCheckpointer() as ck:
            tree = ck.restore(src, adamw_target())
        adam = tree["opt_state"][0]
        assert type(adam).__name__ == "ScaleByAdamState", type(adam)
    args.out.mkdir(parents=True, exist_ok=True)
    index = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = leaf_name(path)
        value = np.asarray(jax.device_get(leaf))
        raw = value.view(np.uint16) if value.dtype.name == "bfloat16" else value
        np.save(args.out / f"{name}.npy", raw)
        index[name] = {"dtype": value.dtype.name, "shape": list(value.shape), "type": type(leaf).__name__}
    (args.out / "index.json").write_text(json.dumps(index, indent=1))


if __name__ == "__main__":
    main()
