"""Tiny Llama checkpoints in compressed-tensors formats, quantized and saved by compressed-tensors' own code on the CPU.

    save(preset, out)   preset: FP8_BLOCK, W4A16, W4A16_ASYM, NVFP4A16 or NVFP4 (PRESETS), or one of MORE_PRESETS

A bf16 LlamaForCausalLM (hidden 256, intermediate 512, 2 layers, GQA 4/2 heads, vocab 384, untied) gets the preset's
scheme on every Linear but lm_head (`apply_quantization_config`); its weight scales (zero points, NVFP4 global
scales) are computed by compressed-tensors' own qparam functions from each weight's min and max (what
llm-compressor's default min-max observer gives; the observers themselves live in llm-compressor, which is not
installed); then `ModelCompressor.compress_model` packs the weights, `save_pretrained` writes the folder and
`update_config` writes its quantization_config. NVFP4 (W4A4) also calibrates an input global scale on one batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PRESETS = ("FP8_BLOCK", "W4A16", "W4A16_ASYM", "NVFP4A16", "NVFP4")
MORE_PRESETS = ("W8A8", "W8A16", "FP8", "FP8_DYNAMIC")  # other layouts: int8 per channel, int8 packed, FP8 per tensor/channel


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=384, tie_word_embeddings=False, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    return model


def token_ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _input_ranges(model: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """min and max of every Linear's input over one batch (NVFP4's static input global scale)."""
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def hook(_: Any, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                lo, hi = args[0].amin(), args[0].amax()
                if name in ranges:
                    lo, hi = torch.minimum(lo, ranges[name][0]), torch.maximum(hi, ranges[name][1])
                ranges[name] = (lo, hi)

            hooks.append(module.register_forward_pre_hook(hook))
    model(token_ids())
    for h in hooks:
        h.remove()
    return ranges


@torch.no_grad()
def _weight_qparams(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp, generate_gparam

    global_scale = None
    if args.strategy == QuantizationStrategy.TENSOR_GROUP:
        global_scale = generate_gparam(weight.amin(), weight.amax())
    if args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP, QuantizationStrategy.TENSOR):
        scale, zero = compute_dynamic_scales_and_zp(weight, args, module=None, global_scale=global_scale)
    elif args.strategy == QuantizationStrategy.CHANNEL:  # per output row, as the min-max observer reduces it
        scale, zero = calculate_qparams(weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True), args)
    else:  # BLOCK: compute_dynamic_scales_and_zp refuses it; per block min/max as the observer computes them
        bh, bw = args.block_structure
        rows, cols = weight.shape
        blocks = weight.reshape(rows // bh, bh, cols // bw, bw)
        scale, zero = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
    return scale, zero, global_scale


@torch.no_grad()
def save(preset: str, out: Path) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import generate_gparam

    model = llama()
    ranges = _input_ranges(model) if preset == "NVFP4" else None
    scheme = preset_name_to_scheme(preset, targets=["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config, show_progress=False)
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        scale, zero, global_scale = _weight_qparams(module.weight.data, module.quantization_scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if global_scale is not None:
            module.weight_global_scale.data.copy_(global_scale)
        if hasattr(module, "input_global_scale") and ranges is not None:
            module.input_global_scale.data.copy_(generate_gparam(*ranges[name]))
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out
