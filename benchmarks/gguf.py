"""A Hugging Face Llama folder to GGUF q8_0: ckpt against llama.cpp's own convert_hf_to_gguf.py.

    python benchmarks/gguf.py [--size 2] [--repeat 1] [--outtype q8_0] [--workdir /tmp/ckpt-gguf]

The source (built once and reused) is a Llama of about SIZE GB of bf16 weights (hidden 2048, intermediate 5632, 16
heads, 4 key-value heads: TinyLlama's shapes, layers added until the size is reached), saved as `save_pretrained` does
(shards of ~1 GB + index), with a SentencePiece tokenizer trained on the spot (tests/producers/gguf_models.py), the
vocabulary padded to 32,000 as the converter pads it. The converter is the one the tests use (llama-cpp-python
0.3.36's llama.cpp, fetched into ~/.cache/ckpt-tests by tests/gguf_reference.py).

Timed, each with its peak RSS (common.measure):
- `ckpt convert SRC OUT.gguf --to gguf --quantize q8_0` (streamed: a band of rows at a time);
- `convert_hf_to_gguf.py SRC --outtype q8_0 --outfile OUT.gguf --model-name NAME` (same general.name);
- `cp` of the source's weights (the floor for reading them once).
Then the two files are compared byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
from pathlib import Path

from common import du, measure, remove

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "producers"))

PY = sys.executable
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 5632, 16, 4, 32000

BUILD = """\
import json, sys, torch
from pathlib import Path
from transformers import LlamaConfig
from huggingface_hub import save_torch_state_dict
sys.path.insert(0, sys.argv[4])
from gguf_models import train_spm

root, size, hidden, inter, heads, kv, vocab = Path(sys.argv[1]), float(sys.argv[2]), *map(int, sys.argv[3].split(","))
layer = (2 * hidden * hidden + 2 * hidden * hidden * kv // heads + 3 * hidden * inter + 2 * hidden) * 2
layers = max(1, round((size * 1e9 - 2 * vocab * hidden * 2) / layer))
config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048, tie_word_embeddings=False,
                     torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
train_spm(root)
config.save_pretrained(root)
torch.manual_seed(0)
def rand(*shape):
    return (torch.randn(*shape) * 0.02).to(torch.bfloat16)
sd = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
      "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
for i in range(layers):
    p = f"model.layers.{i}."
    sd.update({p + "self_attn.q_proj.weight": rand(hidden, hidden), p + "self_attn.k_proj.weight": rand(hidden * kv // heads, hidden),
               p + "self_attn.v_proj.weight": rand(hidden * kv // heads, hidden), p + "self_attn.o_proj.weight": rand(hidden, hidden),
               p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
               p + "mlp.down_proj.weight": rand(hidden, inter), p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
save_torch_state_dict(sd, root, max_shard_size="1GB")
print(layers)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=2.0, help="GB of bf16 weights (10^9 bytes)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--outtype", default="q8_0", choices=("q8_0", "f32", "bf16", "f16"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-gguf"))
    args = parser.parse_args()
    import gguf_reference

    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / f"{args.size:g}gb" / "llama"  # a plain name: the converter's name heuristics add no keys
    if not (src / "model.safetensors.index.json").exists():
        remove(src)
        src.parent.mkdir(exist_ok=True)
        print(f"building {src} ...", file=sys.stderr, flush=True)
        shapes = ",".join(map(str, (HIDDEN, INTER, HEADS, KV_HEADS, VOCAB)))
        subprocess.run([PY, "-c", BUILD, str(src), str(args.size), shapes, str(ROOT / "tests" / "producers")], check=True)
    script = gguf_reference.converter_dir() / "convert_hf_to_gguf.py"
    ours, theirs, copied = args.workdir / "ckpt.gguf", args.workdir / "converter.gguf", args.workdir / "cp"
    option = (
        ["--quantize", args.outtype]
        if args.outtype.startswith("q")
        else ["--dtype", {"f32": "fp32", "f16": "fp16"}.get(args.outtype, args.outtype)]
    )
    runs = [
        ("ckpt convert --to gguf", [PY, "-m", "ckpt_cli", "convert", str(src), str(ours), "--to", "gguf", *option, "--quiet"], ours),
        (
            "convert_hf_to_gguf.py",
            [PY, str(script), str(src), "--outtype", args.outtype, "--outfile", str(theirs), "--model-name", src.name],
            theirs,
        ),
        ("cp (the weights)", ["cp", "-r", str(src), str(copied)], copied),
    ]
    print(f"source: {src} ({du(src) / 1e9:.2f} GB), --outtype {args.outtype}")
    results = {}
    for label, cmd, out in runs:
        m = measure(cmd, args.repeat, lambda out=out: remove(out))
        results[label] = m
        print(f"  {label:26s} {m.wall:7.1f} s  peak RSS {m.peak_rss / 1e6:7.0f} MB  out {du(out) / 1e9:.2f} GB", flush=True)
    base, ref = results["ckpt convert --to gguf"], results["convert_hf_to_gguf.py"]
    print(f"  ckpt / converter: time {base.wall / ref.wall:.2f}x, peak RSS {base.peak_rss / ref.peak_rss:.2f}x")
    print("  files byte-equal:", filecmp.cmp(ours, theirs, shallow=False))
    for out in (ours, theirs, copied):
        remove(out)


if __name__ == "__main__":
    main()
