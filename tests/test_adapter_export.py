"""`--to adapter`: a LoRA / DoRA fine-tune trained under FSDP2 and saved by DCP, exported as the PEFT adapter folder.

Producer: tests/producers/peft_fsdp2.py (peft's get_peft_model on a tiny transformers Llama, fully_shard, one AdamW
step, dcp.save of get_state_dict). Reference: peft's own save_pretrained of the same weights, gathered on rank 0.
Consumer: peft's PeftModel.from_pretrained of ckpt's folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_fails, built_once, tiny_llama_config, torchrun
from safetensors.torch import load_file, save_file

VARIANTS = ("lora", "dora")
TOKENS = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 127]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    def build(root: Path) -> None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(root / "base")
        for variant in VARIANTS:
            torchrun(2, "peft_fsdp2.py", root / "base", root / variant, variant)

    return built_once(tmp_path_factory, "peft_fsdp2", build)


def _logits(base: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_dcp_fine_tune_becomes_the_folder_peft_saves(ckpt, trained, tmp_path, variant):
    ref = trained / variant / "peft"
    res = ckpt("convert", trained / variant / "dcp", tmp_path / "out", "--to", "adapter", "--hf-config", ref)
    assert res.code == 0, res.err
    assert "left out" in res.err and "optimizer state" in res.err
    # the same bytes as peft's own save of the same weights: names, order, header, data
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (ref / name).read_bytes(), name
    assert torch.equal(_logits(trained / "base", tmp_path / "out"), _logits(trained / "base", ref))
    if variant == "dora":
        assert any(k.endswith("lora_magnitude_vector") for k in load_file(tmp_path / "out" / "adapter_model.safetensors"))
    # and ckpt reads it back as an adapter
    doc = json.loads(ckpt("inspect", tmp_path / "out", "--json").out)
    assert doc["format"] == "adapter" and len(doc["details"]["adapter"]["modules"]) == 6
    assert ckpt("verify", tmp_path / "out").code == 0


def test_the_adapter_config_is_required_and_checked(ckpt, trained, tmp_path):
    src = trained / "lora" / "dcp"
    res = ckpt("convert", src, tmp_path / "a", "--to", "adapter")
    assert res.code == 2 and "adapter_config.json" in res.err and "--hf-config" in res.err and "Traceback" not in res.err
    # a config whose rank is not the weights': one line naming the module, nothing written
    config = json.loads((trained / "lora" / "peft" / "adapter_config.json").read_text())
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {}}))
    res = ckpt("convert", src, tmp_path / "b", "--to", "adapter", "--hf-config", tmp_path / "wrong")
    assert_fails(res, "model.layers.1.self_attn.q_proj", "rank 2", "r=4")
    assert not (tmp_path / "b").exists()
    # a DoRA checkpoint under a config without use_dora
    res = ckpt("convert", trained / "dora" / "dcp", tmp_path / "c", "--to", "adapter", "--hf-config", trained / "lora" / "peft")
    assert_fails(res, "DoRA magnitude", "use_dora")


def test_no_lora_weight_and_two_adapters_are_refused(ckpt, trained, tmp_path):
    peft_dir = trained / "lora" / "peft"
    plain = tmp_path / "plain.safetensors"
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)}, plain)
    assert_fails(ckpt("convert", plain, tmp_path / "a", "--to", "adapter", "--hf-config", peft_dir), "holds no LoRA weight")
    two = tmp_path / "two.safetensors"
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 32),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight": torch.zeros(4, 32),
        },
        two,
    )
    res = ckpt("convert", two, tmp_path / "b", "--to", "adapter", "--hf-config", peft_dir)
    assert res.code == 2 and "2 adapters (default, other)" in res.err and "--select" in res.err
