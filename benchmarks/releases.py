"""A release with a preset: torchtitan Llama weights to Hugging Face with the q/k rotary permutation, against the same
export without it, against torchtitan's own way (its state-dict adapter on the whole state dict), and `cp`.

    python benchmarks/releases.py [--size 1] [--repeat 1] [--workdir /tmp/ckpt-releases]

The source (built once and reused) is a safetensors file of SIZE GB of float32 weights in torchtitan's names
(tok_embeddings, layers.N.attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, the norms, output), Llama-shaped with
grouped-query attention (hidden 2048, 16 heads over 4 kv heads), plus a config folder for --hf-config.

Timed, each with its peak RSS (common.measure):
- `ckpt convert SRC OUT --to hf --preset torchtitan-llama3 --hf-config CFG` (the permutation computed per head as read);
- the same renames without the permutation (`--rename ...`: what the export costs without it; the issue's bound is
  peak RSS within 1.1x of this);
- torchtitan's way: every tensor loaded, `Llama3StateDictAdapter._permute`'s view/transpose/reshape applied to q and
  k, saved with safetensors' `save_file` (what its `to_hf` + a save do, in memory);
- `cp` of the source file (the floor).
Then the preset's output and the reference are compared tensor by tensor (bit-equal or not).
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
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 5632, 16, 4, 32000

BUILD = """\
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
root, size, hidden, inter, heads, kv, vocab = Path(sys.argv[1]), float(sys.argv[2]), *map(int, sys.argv[3:8])
root.mkdir()
kv_rows = hidden // heads * kv
per_layer = 4 * (2 * hidden * hidden + 2 * kv_rows * hidden + 3 * inter * hidden)
layers = max(1, round((size * 1e9 - 8 * vocab * hidden) / per_layer))
gen = torch.Generator().manual_seed(0)
def w(*shape):
    return torch.randn(*shape, generator=gen) * 0.02
sd = {"tok_embeddings.weight": w(vocab, hidden), "norm.weight": torch.ones(hidden), "output.weight": w(vocab, hidden)}
for i in range(layers):
    p = f"layers.{i}."
    sd.update({p + "attention.wq.weight": w(hidden, hidden), p + "attention.wk.weight": w(kv_rows, hidden),
               p + "attention.wv.weight": w(kv_rows, hidden), p + "attention.wo.weight": w(hidden, hidden),
               p + "feed_forward.w1.weight": w(inter, hidden), p + "feed_forward.w2.weight": w(hidden, inter),
               p + "feed_forward.w3.weight": w(inter, hidden), p + "attention_norm.weight": torch.ones(hidden),
               p + "ffn_norm.weight": torch.ones(hidden)})
save_file(sd, str(root / "titan.safetensors"))
(root / "config").mkdir()
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
          "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers, "vocab_size": vocab,
          "tie_word_embeddings": False, "torch_dtype": "float32"}
(root / "config" / "config.json").write_text(json.dumps(config, indent=2))
"""

REFERENCE = """\
import re, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, out, heads, kv = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def permute(w, n):  # torchtitan/models/llama3/model/state_dict_adapter.py Llama3StateDictAdapter._permute
    d1, d2 = w.shape
    return w.view(n, d1 // n // 2, 2, d2).transpose(1, 2).reshape(d1, d2).clone()
names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
         "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
         "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
hf = {}
for key, value in load_file(str(src)).items():
    m = re.fullmatch(r"layers\\.(\\d+)\\.(.+)\\.weight", key)
    if m:
        if m.group(2) == "attention.wq":
            value = permute(value, heads)
        elif m.group(2) == "attention.wk":
            value = permute(value, kv)
        hf[f"model.layers.{m.group(1)}.{names[m.group(2)]}.weight"] = value
    else:
        hf[{"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}[key]] = value
out.mkdir()
save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
"""


def renames() -> list[str]:
    """The preset's renames alone, as --rename options (the export without the permutation)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ckpt_cli import presets

    return [x for pattern, repl in presets.load("torchtitan-llama3").renames for x in ("--rename", f"{pattern}={repl}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="GB of float32 weights in the source")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-releases"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    root = args.workdir / f"titan-{args.size:g}GB"
    if not root.exists():
        print(f"building {root} ...", file=sys.stderr, flush=True)
        subprocess.run([PY, "-c", BUILD, root, str(args.size), *map(str, (HIDDEN, INTER, HEADS, KV_HEADS, VOCAB))], check=True)
    src, config = root / "titan.safetensors", root / "config"
    preset, plain, theirs, copy = (args.workdir / n for n in ("out-preset", "out-renames", "out-reference", "out-cp"))
    export, titan = [*CKPT, "convert", src], ["--preset", "torchtitan-llama3"]
    rows = [
        ("ckpt convert --preset torchtitan-llama3", [*export, preset, "--to", "hf", *titan, "--hf-config", config], preset),
        ("ckpt convert, same renames, no permute", [*export, plain, "--to", "hf", *renames(), "--hf-config", config], plain),
        ("torchtitan's way: load, _permute, save_file", [PY, "-c", REFERENCE, src, theirs, str(HEADS), str(KV_HEADS)], theirs),
        ("cp (the source's bytes)", ["cp", src, copy], copy),
    ]
    print(f"source: {src} ({du(src) / 1e9:.2f} GB)")
    print_ratios(measure_rows(rows, args.repeat), "preset")
    print(
        "  preset vs torchtitan's way:",
        same_tensors(preset, theirs),
    )
    print("  config.json written:", json.loads((preset / "config.json").read_text())["num_attention_heads"] == HEADS)


if __name__ == "__main__":
    main()
