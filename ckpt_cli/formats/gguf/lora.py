"""A PEFT LoRA adapter as the GGUF LoRA llama.cpp's `convert_lora_to_gguf.py` writes (`ckpt convert ADAPTER OUT.gguf
--to gguf --hf-config BASE`): the base model's architecture, `general.type` adapter, `adapter.type` lora,
`adapter.lora.alpha`, and per targeted weight `blk.N.<name>.weight.lora_a` (A, [r, in]) and `.lora_b` (B, [out, r]),
B's rows permuted where the architecture permutes the weight's (Llama's q/k), each tensor's type as for any GGUF tensor
(formats/gguf/writer.py lays the file out).

llama.cpp scales each pair by `alpha / r`, r the rank of its own lora_a (src/llama-adapter.cpp): rank_pattern holds, a
module's own alpha does not (one alpha per file), nor rsLoRA's `alpha / sqrt(r)` or DoRA's magnitudes, which the
converter writes anyway and llama.cpp then applies wrongly: ckpt refuses those.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.gguf import arch as archs
from ckpt_cli.formats.gguf.constants import ValueType
from ckpt_cli.formats.gguf.encode import KV


def lora_tensors(ckpt: Checkpoint, config: dict[str, Any], arch: archs.Arch) -> list[tuple[str, TensorEntry]]:
    """(GGUF name, tensor) of each module's A and B in the converter's order (the adapter file's: by module name)."""
    adapter = ckpt.source
    refused = _refused(adapter.config)
    if refused:
        raise UsageError(f"{ckpt.path}: {refused}; llama.cpp applies a LoRA as alpha / r, r each module's own rank")
    adapter.refuse_problems()  # a broken adapter is data (exit 1), as for --adapter
    out = []
    for module in sorted(adapter.modules.values(), key=lambda m: m.name):
        weight = module.weight
        gname = archs.gguf_name(weight)
        lora_b = ckpt.tensors[module.b]
        if arch.permute_qk and weight.endswith(("q_proj.weight", "k_proj.weight")):
            lora_b = archs.permuted_qk(lora_b, weight, config)  # B's rows are the weight's rows (LoraTorchTensor.permute)
        out += [(gname + ".lora_a", ckpt.tensors[module.a]), (gname + ".lora_b", lora_b)]
    return out


def lora_kvs(ckpt: Checkpoint, arch: archs.Arch) -> list[KV]:
    """The converter's keys for a LoRA (its model-card keys aside: general.base_model.*, general.tags, guessed from a
    README.md; general.name is the adapter folder's name)."""
    return [
        KV("general.architecture", ValueType.STRING, arch.name),
        KV("general.type", ValueType.STRING, "adapter"),
        KV("adapter.type", ValueType.STRING, "lora"),
        KV("general.name", ValueType.STRING, Path(ckpt.path).name),
        KV("adapter.lora.alpha", ValueType.FLOAT32, float(ckpt.source.config["lora_alpha"])),
    ]


def _refused(config: dict[str, Any]) -> str | None:
    if config.get("use_rslora"):
        return "an rsLoRA adapter (scale alpha / sqrt(r))"
    if config.get("use_dora"):
        return "a DoRA adapter (its magnitudes have no place in a GGUF LoRA)"
    if any(alpha != config["lora_alpha"] for alpha in (config.get("alpha_pattern") or {}).values()):
        return "an adapter whose modules have alphas of their own (alpha_pattern; a GGUF LoRA holds one alpha)"
    return None
