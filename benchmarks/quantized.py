"""Dequantizing an FP8 block-scaled folder to bf16: ckpt against the reference path and against `cp` of the same bytes.

    python benchmarks/quantized.py [--size 1] [--repeat 1] [--workdir /tmp/ckpt-quant]

The source (built once and reused) is a Hugging Face folder of SIZE GB of FP8 weights laid out as DeepSeek-V3 ships
them: `X.weight` float8_e4m3fn in 128 x 128 blocks, `X.weight_scale_inv` float32 beside it, shards of ~500 MB, and
one weight whose scales sit in the next shard; config.json says `quant_method: fp8`. Values and scales are made by
transformers' own `Fp8Quantize` from random bf16 weights.

Timed, each with its peak RSS (common.measure):
- `ckpt convert SRC OUT --to hf --dtype bf16` (streamed: one block row of a weight at a time);
- the reference path: every shard loaded with safetensors, each weight dequantized by transformers'
  `Fp8Dequantize._dequantize_one` (its scale found through the index, in whichever shard), the bf16 tensors saved
  shard by shard with safetensors' `save_file` (what users' conversion scripts do);
- `cp -r SRC` (the floor: the same bytes copied, half of what the bf16 output writes).
Then the two outputs are compared tensor by tensor (bit-equal or not).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import du, measure_rows, print_ratios, same_tensors

PY = sys.executable
CKPT = [PY, "-m", "ckpt_cli"]
SHARD_BYTES = 500 * 10**6
HIDDEN, INTER = 4096, 11008  # Llama-7B-sized matrices: q/k/v/o 4096 x 4096, gate/up 11008 x 4096, down 4096 x 11008

REFERENCE = """\
import json, sys, torch
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

class Q:
    quantization_config = FineGrainedFP8Config(weight_block_size=[128, 128])

src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
op, new_map = Fp8Dequantize(Q()), {}
for shard in dict.fromkeys(weight_map.values()):
    tensors = {}
    with safe_open(str(src / shard), "pt") as f:
        for name in f.keys():
            if name.endswith("_scale_inv"):
                continue
            value = f.get_tensor(name)
            if name + "_scale_inv" in weight_map:
                with safe_open(str(src / weight_map[name + "_scale_inv"]), "pt") as g:
                    scale = g.get_tensor(name + "_scale_inv")
                value = op._dequantize_one(value, scale, output_dtype=torch.bfloat16)
            tensors[name] = value
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    new_map.update(dict.fromkeys(tensors, shard))
(out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": new_map}))
"""

BUILD = """\
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

class Q:
    quantization_config = FineGrainedFP8Config(weight_block_size=[128, 128])

root, size, shard_bytes, hidden, inter = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
root.mkdir()
op = Fp8Quantize(Q())
shapes = [("self_attn.q_proj", hidden, hidden), ("self_attn.k_proj", hidden, hidden), ("self_attn.v_proj", hidden, hidden),
          ("self_attn.o_proj", hidden, hidden), ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden),
          ("mlp.down_proj", hidden, inter)]
per_layer = sum(r * c for _, r, c in shapes)
layers = max(1, round(size * 1e9 / per_layer))
gen = torch.Generator().manual_seed(0)
shard, shard_size, shards, weight_map = {}, 0, 0, {}
def flush():
    global shard, shard_size, shards
    shards += 1
    name = f"model-{shards:05d}.safetensors"
    save_file(shard, str(root / name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, name))
    shard, shard_size = {}, 0
carried = None
for layer in range(layers):
    for module, rows, cols in shapes:
        name = f"model.layers.{layer}.{module}.weight"
        out = op._quantize_one(name, (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16))
        shard[name] = out[name]
        if carried is None and layer == 0:  # one weight's scales go to the next shard, as releases have it
            carried = {name + "_scale_inv": out[name + "_scale_inv"]}
        else:
            shard[name + "_scale_inv"] = out[name + "_scale_inv"]
        shard_size += rows * cols
        if shard_size >= shard_bytes:
            flush()
            if carried:
                shard.update(carried)
                carried = {}
if shard:
    flush()
(root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
          "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
(root / "config.json").write_text(json.dumps(config, indent=2))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="GB of FP8 weights in the source")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-quant"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / f"fp8-{args.size:g}GB"
    if not src.exists():
        print(f"building {src} ...", file=sys.stderr, flush=True)
        subprocess.run([PY, "-c", BUILD, src, str(args.size), str(SHARD_BYTES), str(HIDDEN), str(INTER)], check=True)
    ours, theirs, copy = args.workdir / "out-ckpt", args.workdir / "out-reference", args.workdir / "out-cp"
    rows = [
        ("ckpt convert --to hf --dtype bf16", [*CKPT, "convert", src, ours, "--to", "hf", "--dtype", "bf16", "-q"], ours),
        ("reference: load + Fp8Dequantize + save_file", [PY, "-c", REFERENCE, src, theirs], theirs),
        ("cp -r (the source's bytes)", ["cp", "-r", src, copy], copy),
    ]
    source_bytes = du(src)
    print(f"source: {src} ({source_bytes / 1e9:.2f} GB, {len(list(src.glob('*.safetensors')))} shards)")
    print_ratios(measure_rows(rows, args.repeat, sizes=True))
    print("  outputs:", same_tensors(ours, theirs))
    config = json.loads((ours / "config.json").read_text())
    print("  written config.json has quantization_config:", "quantization_config" in config)


if __name__ == "__main__":
    main()
