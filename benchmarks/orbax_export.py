"""An Orbax save of SIZE GB to safetensors (and to DCP): ckpt against Orbax's own restore + safetensors' save_file.

    python benchmarks/orbax_export.py [--size 1] [--repeat 1] [--workdir /tmp/ckpt-orbax-bench]

The source (built once and reused) is what a JAX run saves with Orbax's defaults: `StandardCheckpointer().save` of a
float32 params tree of Llama-like layers (attention [D, D] x 4, MLP [D, F] x 2 and [F, D], D = 2048, F = 5632) on one
CPU device: one OCDBT database of zarr v2 arrays, one chunk per array.

Timed, each with its peak RSS (common.measure):
- `ckpt convert SRC OUT.safetensors --to safetensors` (streamed through tensorstore, a window of chunk rows at a time);
- the reference path: `StandardCheckpointer().restore(SRC)` (every array in memory, as jax arrays on the CPU), then
  safetensors' `save_file` of them as numpy arrays by their dotted names (what users' export scripts do);
- `ckpt convert SRC OUT --to dcp --world-size 2` (the same tree as an FSDP2 layout).
The two safetensors outputs are compared tensor by tensor (bit-equal or not).

What bounds ckpt's peak RSS here (docs/formats.md §14.3): the imports (Python, numpy and tensorstore: ~70 MB with the
save's metadata; torch is not imported, the arrays' bytes go to the sinks as numpy windows), plus one 4 MiB window per
writer thread: Orbax's default chunks (zarr v2, zstd) are decoded as zstd streams a window at a time, so the 46 MB
chunks here (one per MLP array) are never held whole. About 100-130 MB, whatever the size.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from common import du, measure_rows, same_tensors

PY = sys.executable
CKPT = [PY, "-m", "ckpt_cli"]
JAX_ENV = {"JAX_PLATFORMS": "cpu"}

BUILD = """\
import sys, jax, jax.numpy as jnp, orbax.checkpoint as ocp
from pathlib import Path
root, size = Path(sys.argv[1]), float(sys.argv[2])
D, F = 2048, 5632
shapes = {"attn.wq": (D, D), "attn.wk": (D, D), "attn.wv": (D, D), "attn.wo": (D, D),
          "mlp.wi_0": (D, F), "mlp.wi_1": (D, F), "mlp.wo": (F, D)}
per_layer = sum(r * c * 4 for r, c in shapes.values())
layers = max(1, round(size * 1e9 / per_layer))
key = jax.random.PRNGKey(0)
params = {"decoder": {}}
for i in range(layers):
    layer = params["decoder"][f"layers_{i}"] = {}
    for name, shape in shapes.items():
        key, sub = jax.random.split(key)
        mod, leaf = name.split(".")
        layer.setdefault(mod, {})[leaf] = jax.random.normal(sub, shape, jnp.float32) * 0.02
params["decoder"]["final_norm"] = {"scale": jnp.ones((D,), jnp.float32)}
with ocp.StandardCheckpointer() as ck:
    ck.save(root.resolve(), {"params": params})
    ck.wait_until_finished()
"""

REFERENCE = """\
import sys, jax, numpy as np, orbax.checkpoint as ocp
from pathlib import Path
from safetensors.numpy import save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2])
with ocp.StandardCheckpointer() as ck:
    tree = ck.restore(src.resolve())
flat = {}
for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    flat[".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = np.asarray(leaf)
out.parent.mkdir(parents=True, exist_ok=True)
save_file(flat, str(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="GB of float32 params in the source")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-orbax-bench"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / f"orbax-{args.size:g}GB"
    env = {**__import__("os").environ, **JAX_ENV}
    if not src.exists():
        print(f"building {src} ...", file=sys.stderr, flush=True)
        subprocess.run([PY, "-c", BUILD, src, str(args.size)], check=True, env=env)
    ours, theirs, dcp = args.workdir / "ckpt" / "model.safetensors", args.workdir / "reference" / "model.safetensors", args.workdir / "dcp"
    rows = [
        ("ckpt convert --to safetensors", [*CKPT, "convert", src, ours, "--to", "safetensors", "-q"], ours),
        ("reference: Orbax restore + save_file", [PY, "-c", REFERENCE, src, theirs], theirs),
        ("ckpt convert --to dcp --world-size 2", [*CKPT, "convert", src, dcp, "--to", "dcp", "--world-size", "2", "-q"], dcp),
    ]
    ours.parent.mkdir(parents=True, exist_ok=True)
    source_bytes = du(src)
    print(f"source: {src} ({source_bytes / 1e9:.2f} GB on disk, Orbax OCDBT + zarr v2, zstd)")
    results = measure_rows(rows, args.repeat, env=env, sizes=True)
    base, ref = results[rows[0][0]], results[rows[1][0]]
    print(f"  ckpt / reference: time {base.wall / ref.wall:.2f}x, peak RSS {base.peak_rss / ref.peak_rss:.2f}x")
    print("  outputs:", same_tensors(ours.parent, theirs.parent))


if __name__ == "__main__":
    main()
