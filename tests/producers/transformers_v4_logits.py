"""Logits of a Hugging Face release as transformers v4 computes them (run with the python of a venv holding v4).

    python transformers_v4_logits.py RELEASE OUT.pt ID...

Loads RELEASE with AutoModelForCausalLM.from_pretrained (float32, no remote code) and saves
{"logits": [1, len(ids), vocab] float32, "version": transformers.__version__, "missing": [...], "unexpected": [...]}.
v4 reads one tensor per expert (Mixtral's block_sparse_moe.experts.E.w1, Qwen3-MoE's mlp.experts.E.gate_proj); a key
it does not know is reported, not ignored.
"""

from __future__ import annotations

import sys

import torch
import transformers
from transformers import AutoModelForCausalLM


def main(release: str, out: str, ids: list[int]) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(release, torch_dtype=torch.float32, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    torch.save(
        {"logits": logits, "version": transformers.__version__, "missing": info["missing_keys"], "unexpected": info["unexpected_keys"]},
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3:]])
