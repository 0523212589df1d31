"""Build one safetensors file and the same tensors as a Hugging Face sharded folder, of about SIZE_GB.

    python benchmarks/hf_build.py OUT.safetensors OUT_DIR SIZE_GB SHARD_SIZE

fp32 tensors from 64 KB to 256 MB, cycling, until SIZE_GB (10^9 bytes); the folder is written by
`huggingface_hub.save_torch_state_dict` with SHARD_SIZE shards (`model-0000k-of-0000n.safetensors`
+ `model.safetensors.index.json`), as `save_pretrained` does.
"""

from __future__ import annotations

import os
import sys

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file

ELEMENTS = [2**14, 2**18, 2**20, 3 * 2**20, 2**22, 2**24, 2**26, 5 * 2**22]


def state_dict(size_bytes: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd, total, i = {}, 0, 0
    while total < size_bytes:
        n = min(ELEMENTS[i % len(ELEMENTS)], max((size_bytes - total) // 4, 1))
        sd[f"layers.{i}.weight"] = torch.randn(n)
        total += n * 4
        i += 1
    return sd


def main(file: str, folder: str, size_gb: float, shard: str) -> None:
    sd = state_dict(int(size_gb * 1e9))
    os.makedirs(folder)
    save_file(sd, file, metadata={"format": "pt"})
    save_torch_state_dict(sd, folder, max_shard_size=shard)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4])
