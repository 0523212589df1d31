"""A LoRA merge into a release: `ckpt convert BASE OUT --to hf --adapter DIR` against peft's way (the whole base loaded
by transformers, `PeftModel.from_pretrained`, `merge_and_unload`, `save_pretrained`), and `cp` of the base.

    python benchmarks/adapters.py [--size 2] [--repeat 1] [--workdir /tmp/ckpt-adapters]

The base (built once and reused) is a Hugging Face folder of SIZE GB of float32 weights, Llama-shaped (hidden 2048,
16 heads over 4 kv heads), one safetensors shard per 1 GB with its index; the adapter is LoRA r=16 on every
projection (q, k, v, o, gate, up, down), its config written by peft's LoraConfig.save_pretrained and its weights under
peft's saved names, B non-zero. Timed, each with its peak RSS (common.measure); then ckpt's release and peft's are
compared tensor by tensor (bit-equal or not).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from common import du, measure_rows, print_ratios, same_tensors

PY = sys.executable
CKPT = [PY, "-m", "ckpt_cli"]
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, RANK = 2048, 5632, 16, 4, 32000, 16

BUILD = """\
import json, sys, torch
from pathlib import Path
from peft import LoraConfig
from safetensors.torch import save_file
root, size, hidden, inter, heads, kv, vocab, rank = Path(sys.argv[1]), float(sys.argv[2]), *map(int, sys.argv[3:9])
kv_rows = hidden // heads * kv
per_layer = 4 * (2 * hidden * hidden + 2 * kv_rows * hidden + 3 * inter * hidden)
layers = max(1, round((size * 1e9 - 8 * vocab * hidden) / per_layer))
gen = torch.Generator().manual_seed(0)
def w(*shape):
    return torch.randn(*shape, generator=gen) * 0.02
shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv_rows, hidden), "self_attn.v_proj": (kv_rows, hidden),
          "self_attn.o_proj": (hidden, hidden), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
          "mlp.down_proj": (hidden, inter)}
base, shard, shards, weight_map, lora = root / "base", {}, [], {}, {}
base.mkdir(parents=True)
def flush():
    global shard
    if shard:
        shards.append(shard)
        shard = {}
shard.update({"model.embed_tokens.weight": w(vocab, hidden)})
for i in range(layers):
    p = f"model.layers.{i}."
    for name, (rows, cols) in shapes.items():
        shard[p + name + ".weight"] = w(rows, cols)
        key = f"base_model.model.{p}{name}"
        lora[key + ".lora_A.weight"] = w(rank, cols)
        lora[key + ".lora_B.weight"] = w(rows, rank)
    shard[p + "input_layernorm.weight"] = torch.ones(hidden)
    shard[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    if sum(t.numel() * 4 for t in shard.values()) > 1e9:
        flush()
shard.update({"model.norm.weight": torch.ones(hidden), "lm_head.weight": w(vocab, hidden)})
flush()
total = 0
for k, tensors in enumerate(shards, start=1):
    name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
    save_file(tensors, str(base / name), metadata={"format": "pt"})
    weight_map.update({n: name for n in tensors})
    total += sum(t.numel() * 4 for t in tensors.values())
(base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
          "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers, "vocab_size": vocab,
          "tie_word_embeddings": False, "torch_dtype": "float32", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096}
(base / "config.json").write_text(json.dumps(config, indent=2))
LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[n.split(".")[1] for n in shapes]).save_pretrained(str(root / "adapter"))
save_file(lora, str(root / "adapter" / "adapter_model.safetensors"), metadata={"format": "pt"})
"""

PEFT_WAY = """\
import sys, torch
from peft import PeftModel
from transformers import LlamaForCausalLM
base, adapter, out = sys.argv[1:4]
model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
model.merge_and_unload().save_pretrained(out)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=2.0, help="GB of float32 weights in the base")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-adapters"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    root = args.workdir / f"llama-{args.size:g}GB"
    if not root.exists():
        print(f"building {root} ...", file=sys.stderr, flush=True)
        params = (HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, RANK)
        subprocess.run([PY, "-c", BUILD, root, str(args.size), *map(str, params)], check=True)
    base, adapter = root / "base", root / "adapter"
    ours, theirs, copy = (args.workdir / n for n in ("out-ckpt", "out-peft", "out-cp"))
    rows = [
        ("ckpt convert --to hf --adapter", [*CKPT, "convert", base, ours, "--to", "hf", "--adapter", adapter], ours),
        ("peft: load, merge_and_unload, save", [PY, "-c", PEFT_WAY, base, adapter, theirs], theirs),
        ("cp -r (the base's bytes)", ["cp", "-r", base, copy], copy),
    ]
    print(f"base: {base} ({du(base) / 1e9:.2f} GB), adapter r={RANK} on 7 projections per layer")
    print_ratios(measure_rows(rows, args.repeat))
    print("  ckpt's release vs peft's:", same_tensors(ours, theirs))


if __name__ == "__main__":
    main()
