"""Quantized checkpoints end to end: tiny models saved by transformers, quantized by the reference implementations
(transformers' `Fp8Quantize` for FP8 block-scaled; gpt-oss MXFP4 blocks as its loader reads them), then read,
checked, dequantized and quantized by ckpt; every output loaded by `from_pretrained` and compared bit for bit with
what transformers itself gives from the quantized folder (it dequantizes on the CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_same_tensors
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
fp8_ops = pytest.importorskip("transformers.integrations.finegrained_fp8")

BLOCK = [128, 128]
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}


class _Quantizer:
    def __init__(self) -> None:
        self.quantization_config = transformers.FineGrainedFP8Config(weight_block_size=BLOCK)


def _llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip


def _write_hf(folder: Path, shards: list[dict[str, torch.Tensor]], config: dict) -> None:
    folder.mkdir(parents=True)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="session")
def llama_fp8(tmp_path_factory):
    """A bf16 Llama saved by save_pretrained, and the same weights FP8 block-scaled by transformers' Fp8Quantize in
    two shards, one scale stored in the other shard than its weight."""
    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    state = load_file(str(root / "bf16" / "model.safetensors"))
    op = fp8_ops.Fp8Quantize(_Quantizer())
    quantized: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        linear = name.endswith("_proj.weight")
        quantized.update(op._quantize_one(name, value) if linear else {name: value})
    names = list(quantized)
    moved = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    first = {n: quantized[n] for n in names[: len(names) // 2] if n != moved}
    second = {n: quantized[n] for n in names[len(names) // 2 :]} | {moved: quantized[moved]}
    config = json.loads((root / "bf16" / "config.json").read_text())
    config["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": ["lm_head"]}
    _write_hf(root / "fp8", [first, second], config)
    for name in ("generation_config.json",):
        shutil.copy(root / "bf16" / name, root / "fp8" / name)
    return root, quantized


def logits(folder: Path, **kwargs) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    ids = torch.arange(24).reshape(2, 12) * 7 % 384
    with torch.no_grad():
        return model(ids).logits, model.state_dict()


def test_inspect_names_the_method_and_counts_true_parameters(ckpt, llama_fp8):
    root, quantized = llama_fp8
    res = ckpt("inspect", root / "fp8", "--json")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    q = doc["details"]["quantization"]
    assert (q["method"], q["block_size"], q["from"], q["quantized_tensors"]) == ("fp8", BLOCK, "config.json", 14)
    params = sum(p.numel() for p in transformers.LlamaForCausalLM(_llama_config()).parameters())
    assert doc["num_params"] == params  # the scales are not parameters
    text = ckpt("inspect", root / "fp8").out
    assert "quantized    fp8 in blocks of 128x128: 14 weights (e.g. model.layers.0." in text and "), from config.json" in text


def test_dequantized_export_loads_with_the_references_weights_and_logits(ckpt, llama_fp8, tmp_path):
    root, _ = llama_fp8
    res = ckpt("convert", root / "fp8", tmp_path / "bf16", "--to", "hf", "--dtype", "bf16")
    assert res.code == 0, res.err
    assert "dequantized 14 fp8 weights to bfloat16" in res.err
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert (tmp_path / "bf16" / "generation_config.json").is_file()
    want_logits, want_state = logits(root / "fp8")  # transformers dequantizes on the CPU
    got_logits, got_state = logits(tmp_path / "bf16")
    assert_same_tensors(got_state, want_state)
    assert torch.equal(got_logits, want_logits)
    # verify and inspect see a plain bf16 model
    assert ckpt("verify", tmp_path / "bf16", "--deep").code == 0
    assert "quantization" not in json.loads(ckpt("inspect", tmp_path / "bf16", "--json").out)["details"]


def test_fp32_dequantization_and_merge(ckpt, llama_fp8, tmp_path):
    root, quantized = llama_fp8
    res = ckpt("merge", root / "fp8", tmp_path / "m.safetensors", "--dtype", "fp32")
    assert res.code == 0, res.err
    got = load_file(str(tmp_path / "m.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    op = fp8_ops.Fp8Dequantize(_Quantizer())
    want = op._dequantize_one(quantized[name], quantized[name + "_scale_inv"], output_dtype=torch.float32)
    assert torch.equal(got[name], want) and name + "_scale_inv" not in got


def test_keep_copies_the_quantized_tensors_as_stored(ckpt, llama_fp8, tmp_path):
    root, quantized = llama_fp8
    assert ckpt("convert", root / "fp8", tmp_path / "same", "--to", "hf").code == 0
    got = {}
    for shard in (tmp_path / "same").glob("*.safetensors"):
        got.update(load_file(str(shard)))
    assert_same_tensors(got, quantized)
    assert "quantization_config" in json.loads((tmp_path / "same" / "config.json").read_text())


def test_quantize_equals_the_reference_and_loads(ckpt, llama_fp8, tmp_path):
    root, quantized = llama_fp8
    res = ckpt("convert", root / "bf16", tmp_path / "q", "--to", "hf", "--quantize", "fp8")
    assert res.code == 0, res.err
    got = {}
    for shard in (tmp_path / "q").glob("*.safetensors"):
        got.update(load_file(str(shard)))
    assert_same_tensors(got, quantized)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == BLOCK and "lm_head" in qc["modules_to_not_convert"]
    assert torch.equal(logits(tmp_path / "q")[0], logits(root / "fp8")[0])
    assert ckpt("verify", tmp_path / "q", "--deep").code == 0


def _damaged(root: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(root / "fp8", copy)
    shard = copy / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n in tensors or f != shard.name}
    index["weight_map"].update(dict.fromkeys(tensors, shard.name))
    index["metadata"]["total_size"] = sum(
        t.numel() * t.element_size() for f in copy.glob("*.safetensors") for t in load_file(str(f)).values()
    )
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    return copy


SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("change", "deep", "words"),
    [
        (lambda t: t[SCALE].__setitem__((0, 0), float("nan")), True, "not finite or not positive"),
        (lambda t: t[SCALE].__setitem__((1, 1), 0.0), True, "not finite or not positive"),
        (lambda t: t.pop(SCALE), False, "has no 'model.layers.0.self_attn.q_proj.weight_scale_inv'"),
        (lambda t: t.__setitem__(SCALE, torch.ones(1, 2)), False, "needs [2, 2]"),
    ],
    ids=["nan-scale", "zero-scale", "missing-scale", "scale-shape"],
)
def test_verify_catches_what_a_quantized_checkpoint_promises(ckpt, llama_fp8, tmp_path, change, deep, words):
    root, _ = llama_fp8
    bad = _damaged(root, tmp_path, change)
    res = ckpt("verify", bad, *(["--deep"] if deep else []))
    assert res.code == 1 and words in res.out + res.err, res.out + res.err
    assert "model-00002-of-00002.safetensors" in res.out + res.err or not deep
    out = ckpt("convert", bad, tmp_path / "out", "--to", "hf", "--dtype", "bf16")
    assert out.code != 0 or deep  # structural damage refuses the conversion; bad scale values are verify --deep's
    assert ckpt("verify", root / "fp8", "--deep").code == 0


def test_only_weight_targets_and_known_methods(ckpt, llama_fp8, tmp_path):
    root, _ = llama_fp8
    res = ckpt("convert", root / "fp8", tmp_path / "d", "--to", "dcp", "--world-size", "1", "--dtype", "bf16")
    assert res.code == 2 and "hf, safetensors or torch" in res.err
    res = ckpt("convert", root / "bf16", tmp_path / "x", "--to", "hf", "--quantize", "int4")
    assert res.code == 2 and "fp8" in res.err
    res = ckpt("convert", root / "fp8", tmp_path / "y", "--to", "hf", "--quantize", "fp8")
    assert res.code == 2 and "quantized already" in res.err
    assert ckpt("convert", root / "fp8", tmp_path / "z", "--to", "hf", "--dtype", "int8").code == 2
    assert not (tmp_path / "d").exists() and not (tmp_path / "x").exists()


# --- MXFP4 (gpt-oss) ------------------------------------------------------------------------------------------------


def _gpt_oss_config() -> transformers.GptOssConfig:
    return transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, torch_dtype="bfloat16",
    )  # fmt: skip


@pytest.fixture(scope="session")
def gpt_oss_mxfp4(tmp_path_factory):
    """A tiny gpt-oss saved by save_pretrained, its experts then stored as MXFP4 (random nibbles, E8M0 exponents
    around 1 with one expert's at the extremes 0 and 254) under the names and shapes gpt-oss ships."""
    root = tmp_path_factory.mktemp("mxfp4")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_gpt_oss_config()).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    state = load_file(str(root / "bf16" / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    stored: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = value.shape  # the loader's (E, in, out) is the blocks' (E, out, in / 32, 16)
            stored[name + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(122, 130, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen)
            stored[name + "_scales"] = scales
        else:
            stored[name] = value
    extremes = stored["model.layers.1.mlp.experts.down_proj_scales"]
    extremes[3, 0, 0], extremes[3, 1, 1] = 0, 254
    config = json.loads((root / "bf16" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    _write_hf(root / "mxfp4", [stored], config)
    return root, stored


def test_mxfp4_export_equals_transformers_dequantization(ckpt, gpt_oss_mxfp4, tmp_path):
    root, stored = gpt_oss_mxfp4
    doc = json.loads(ckpt("inspect", root / "mxfp4", "--json").out)
    assert doc["details"]["quantization"]["method"] == "mxfp4"
    params = sum(p.numel() for p in transformers.GptOssForCausalLM(_gpt_oss_config()).parameters())
    assert doc["num_params"] == params  # two values a byte, scales not counted
    tree = json.loads(ckpt("inspect", root / "mxfp4", "--tree", "--json").out)
    assert tree["roles"]["model"]["params"] == params  # the tree counts the same way
    res = ckpt("convert", root / "mxfp4", tmp_path / "bf16", "--to", "hf", "--dtype", "bf16")
    assert res.code == 0, res.err
    want_logits, want_state = logits(root / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True))
    got_logits, got_state = logits(tmp_path / "bf16")
    assert_same_tensors(got_state, want_state)  # the extreme exponents included (one reaches inf, as the reference)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0, equal_nan=True)
    assert ckpt("verify", root / "mxfp4", "--deep").code == 0


def test_mxfp4_nan_exponent_is_caught(ckpt, gpt_oss_mxfp4, tmp_path):
    root, stored = gpt_oss_mxfp4
    bad = dict(stored)
    scales = bad["model.layers.0.mlp.experts.gate_up_proj_scales"].clone()
    scales[0, 0, 0] = 255
    bad["model.layers.0.mlp.experts.gate_up_proj_scales"] = scales
    config = json.loads((root / "mxfp4" / "config.json").read_text())
    _write_hf(tmp_path / "bad", [bad], config)
    assert ckpt("verify", tmp_path / "bad").code == 0  # structure is whole
    res = ckpt("verify", tmp_path / "bad", "--deep")
    assert res.code == 1 and "E8M0 NaN (255)" in res.out + res.err


def test_a_companion_linked_outside_the_checkpoint_is_not_carried(ckpt, llama_fp8, tmp_path):
    root, _ = llama_fp8
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    folder = tmp_path / "release"
    shutil.copytree(root / "bf16", folder)
    (folder / "tokenizer.json").symlink_to(secret)
    res = ckpt("convert", folder, tmp_path / "out", "--to", "hf")
    assert res.code == 0, res.err
    assert "links outside the checkpoint" in res.err
    assert not (tmp_path / "out" / "tokenizer.json").exists() and (tmp_path / "out" / "config.json").is_file()


def test_a_hostile_block_size_is_refused_or_harmless(ckpt, llama_fp8, tmp_path):
    root, _ = llama_fp8
    for block, code in (([0, 128], 1), ([1 << 20, 1 << 20], 1), ("big", 1)):
        folder = tmp_path / f"b{code}{block!s:.3}"
        shutil.copytree(root / "fp8", folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"]["weight_block_size"] = block
        (folder / "config.json").write_text(json.dumps(config))
        res = ckpt("verify", folder)
        text = res.out + res.err
        assert res.code == code and ("weight_block_size" in text or "needs [1, 1]" in text), text


# --- partial blocks (DeepSeek's ceil-divided scale grid) -----------------------------------------------------------

# The reference is transformers' `Fp8Quantize` (as above), run on each weight padded with zeros to whole 128 x 128
# blocks and cropped: it passes a weight the block does not tile through unquantized, and zeros change no block's
# amax, so each edge block's scale is DeepSeek's, over the elements it has (DeepSeek-V3's own repository has no weight
# quantizer: inference/kernel.py dequantizes weights with a ceil(rows / 128) x ceil(cols / 128) grid).
PARTIAL = {
    "kv_a_proj_with_mqa": (200, 320),  # V3's [576, 7168] scaled down: neither dim a multiple of 128
    "rows_only": (200, 256),
    "cols_only": (128, 300),
    "small": (64, 100),  # under one block
    "stacked": (2, 130, 140),
}


def _reference_fp8(value: torch.Tensor) -> dict[str, torch.Tensor]:
    *lead, rows, cols = value.shape
    padded = torch.zeros(*lead, -(-rows // 128) * 128, -(-cols // 128) * 128, dtype=value.dtype)
    padded[..., :rows, :cols] = value
    ref = fp8_ops.Fp8Quantize(_Quantizer())._quantize_one("w.weight", padded)
    return {"weight": ref["w.weight"][..., :rows, :cols].contiguous(), "weight_scale_inv": ref["w.weight_scale_inv"]}


@pytest.fixture(scope="module")
def partial_blocks(tmp_path_factory):
    """bf16 weights none of which 128 x 128 blocks tile (a 1-d norm beside them), and the FP8 release the reference
    makes of them in DeepSeek's layout."""
    root = tmp_path_factory.mktemp("partial")
    gen = torch.Generator().manual_seed(11)
    plain = {
        f"layers.{k}.{name}.weight": (torch.randn(*shape, generator=gen) * 2).to(torch.bfloat16)
        for k, (name, shape) in enumerate(PARTIAL.items())
    }
    plain["layers.0.kv_a_proj_with_mqa.weight"][128:, 256:] = 0  # an all-zero edge block: scale 1
    plain["layers.0.norm.weight"] = torch.ones(200, dtype=torch.bfloat16)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16"}
    _write_hf(root / "bf16", [plain], config)
    release = {}
    for name, value in plain.items():
        ref = _reference_fp8(value) if value.dim() >= 2 else {"weight": value}
        release.update({name.removesuffix("weight") + key: tensor for key, tensor in ref.items()})
    _write_hf(root / "fp8", [release], {**config, "quantization_config": FP8_CONFIG})
    return root, plain, release


@pytest.mark.parametrize("name", [f"layers.{k}.{n}.weight" for k, n in enumerate(PARTIAL)], ids=list(PARTIAL))
def test_quantize_partial_blocks_equals_the_reference(ckpt, partial_blocks, tmp_path, name):
    root, plain, release = partial_blocks
    res = ckpt("convert", root / "bf16", tmp_path / "q", "--to", "hf", "--quantize", "fp8")
    assert res.code == 0, res.err
    got = load_file(str(next((tmp_path / "q").glob("*.safetensors"))))
    *lead, rows, cols = plain[name].shape
    assert list(got[name + "_scale_inv"].shape) == [*lead, -(-rows // 128), -(-cols // 128)]
    for key in (name, name + "_scale_inv"):
        assert got[key].dtype == release[key].dtype and torch.equal(got[key].view(torch.uint8), release[key].view(torch.uint8)), key
    assert torch.equal(got["layers.0.norm.weight"], plain["layers.0.norm.weight"])  # 1-d: kept
    assert ckpt("verify", tmp_path / "q", "--deep").code == 0


@pytest.mark.parametrize("config", [True, False], ids=["block-in-config", "no-config"])
def test_deepseek_layout_release_dequantizes_as_the_reference(ckpt, partial_blocks, tmp_path, config):
    """A release with scale grids ceil(rows / 128) x ceil(cols / 128): read (the block from its config, else from the
    grid), verified and dequantized as transformers' `_dequantize_fp8_weight` gives it (float32, the grid as it is)."""
    root, plain, release = partial_blocks
    folder = tmp_path / "release"
    shutil.copytree(root / "fp8", folder)
    names = [n for n in plain if plain[n].dim() >= 2]
    if not config:  # a grid that also reads as whole blocks of another size ([200, 256] in [2, 2]) is refused, not guessed
        (folder / "config.json").unlink()
        res = ckpt("verify", folder)
        assert res.code == 1 and "and of [128, 128] with partial edge blocks" in res.out + res.err, res.out + res.err
        assert ckpt("convert", folder, tmp_path / "refused", "--to", "hf", "--dtype", "bf16").code == 1
        shutil.rmtree(folder)
        names = ["layers.0.kv_a_proj_with_mqa.weight", "layers.3.small.weight"]  # [2, 3] for [200, 320]: one reading
        folder.mkdir()
        keep = {n: release[n] for n in release if n.removesuffix("_scale_inv") in names or n.endswith("norm.weight")}
        save_file(keep, str(folder / "model.safetensors"), metadata={"format": "pt"})
    res = ckpt("inspect", folder, "--json")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    assert doc["details"]["quantization"]["quantized_tensors"] == len(names)
    assert doc["details"]["quantization"]["block_size"] == (BLOCK if config else None)
    assert ckpt("verify", folder, "--deep").code == 0
    res = ckpt("merge", folder, tmp_path / "m.safetensors", "--dtype", "fp32")
    assert res.code == 0, res.err
    got = load_file(str(tmp_path / "m.safetensors"))
    for name in names:
        want = fp8_ops._dequantize_fp8_weight(release[name], release[name + "_scale_inv"], BLOCK, torch.float32)
        assert torch.equal(got[name], want), name
