"""The real consumer of released weights: transformers' from_pretrained."""

from __future__ import annotations

import shutil

import torch
from conftest import assert_same_tensors, tiny_llama_config
from safetensors.torch import load_file


def test_split_loads_with_from_pretrained(ckpt, tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    model, root = tiny_llama
    out = tmp_path / "split"
    res = ckpt("split", root / "single" / "model.safetensors", out, "--max-shard-size", "30KB", "-q")
    assert res.code == 0, res.err
    assert len(list(out.glob("model-*.safetensors"))) > 2
    shutil.copy(root / "single" / "config.json", out / "config.json")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same_tensors(loaded.state_dict(), model.state_dict())
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_merge_of_save_pretrained_shards_equals_the_state_dict(ckpt, tiny_llama, tmp_path):
    model, root = tiny_llama
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    res = ckpt("merge", root / "sharded", tmp_path / "merged.safetensors", "-q")
    assert res.code == 0, res.err
    merged = load_file(tmp_path / "merged.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    assert_same_tensors(merged, expected)


def test_tied_weights_are_written_once_and_reload_tied(ckpt, tiny_llama, tmp_path):
    """A torch state dict with lm_head tied to the embedding: one copy in safetensors, as transformers expects."""
    from transformers import LlamaForCausalLM

    model, _ = tiny_llama
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    out = tmp_path / "hf"
    res = ckpt("split", tmp_path / "pytorch_model.bin", out)
    assert res.code == 0 and "tied" in res.err and "lm_head.weight" in res.err
    tiny_llama_config().save_pretrained(out)
    loaded, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same_tensors(loaded.state_dict(), model.state_dict())


def test_an_hf_release_carries_its_config_and_the_config_says_the_dtype_written(ckpt, tiny_llama, tmp_path):
    """reshard and convert of a save_pretrained folder keep config.json and generation_config.json beside the
    weights (from_pretrained needs no copy by hand); a --dtype cast rewrites the config's dtype to match."""
    import json

    from transformers import AutoModelForCausalLM

    model, root = tiny_llama
    same = tmp_path / "same"
    res = ckpt("reshard", root / "sharded", same, "--num-shards", "2")
    assert res.code == 0 and "rope_theta added for transformers v4" in res.err, res.err
    saved, kept = json.loads((root / "sharded" / "config.json").read_text()), json.loads((same / "config.json").read_text())
    assert "rope_theta" not in saved and kept == {**saved, "rope_theta": saved["rope_parameters"]["rope_theta"]}  # v5 keeps it nested
    again = tmp_path / "again"
    assert ckpt("reshard", same, again, "--num-shards", "1").code == 0
    assert (again / "config.json").read_bytes() == (same / "config.json").read_bytes()  # nothing to change: the bytes as they are
    assert (same / "generation_config.json").is_file()
    assert_same_tensors(AutoModelForCausalLM.from_pretrained(same).state_dict(), model.state_dict())
    half = tmp_path / "half"
    assert ckpt("convert", root / "sharded", half, "--to", "hf", "--dtype", "bf16").code == 0
    config = json.loads((half / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(half).model.embed_tokens.weight.dtype == torch.bfloat16
