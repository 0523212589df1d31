"""A LoRA (or DoRA) fine-tune under FSDP2 (fully_shard) on the CPU, saved by torch.distributed.checkpoint, as
recipes that train peft adapters under FSDP2 save it; and peft's own adapter folder of the same weights.

    torchrun --nproc-per-node W peft_fsdp2.py BASE_HF_DIR OUT VARIANT

OUT/dcp: dcp.save of {"model": get_model_state_dict, "optim": ...} (keys `model.base_model.model.<module>.lora_A.default
.weight`, the frozen base weights beside them, AdamW state for the trained LoRA weights). OUT/peft: peft's
save_pretrained of the same model after the step, from the full state dict gathered on rank 0 (the reference).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import LlamaForCausalLM

VARIANTS = {"lora": {"rank_pattern": {"layers.1.self_attn.q_proj": 2}}, "dora": {"use_dora": True}}


def main(base: str, out: str, variant: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **VARIANTS[variant])
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base), config)
    g = torch.Generator().manual_seed(7)  # B non-zero before training (peft starts it at zero); same on every rank
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{out}/dcp")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(f"{out}/peft", state_dict=full)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
