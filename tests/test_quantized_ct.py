"""compressed-tensors checkpoints (FP8 block, packed INT4 symmetric and asymmetric, NVFP4) quantized and saved by
compressed-tensors' own code (tests/producers/compressed_save.py), read, checked and dequantized by ckpt; every
export loaded by `from_pretrained` and compared bit for bit with what transformers gives when it dequantizes the
same folder itself (`CompressedTensorsConfig(dequantize=True)`), weights and logits."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_tensors
from safetensors.torch import load_file, save_file

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent / "producers"))
import compressed_save  # noqa: E402

FORMATS = {"FP8_BLOCK": "ct-naive", "W4A16": "ct-pack", "W4A16_ASYM": "ct-pack", "NVFP4A16": "ct-nvfp4", "NVFP4": "ct-nvfp4"}


@pytest.fixture(scope="session")
def compressed(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    return {preset: compressed_save.save(preset, root / preset) for preset in compressed_save.PRESETS}


def load(folder: Path, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    with torch.no_grad():
        return model(compressed_save.token_ids()).logits, model.state_dict()


@pytest.mark.parametrize("preset", compressed_save.PRESETS)
def test_dequantized_export_equals_transformers_own_dequantization(ckpt, compressed, preset, tmp_path):
    folder = compressed[preset]
    doc = json.loads(ckpt("inspect", folder, "--json").out)
    q = doc["details"]["quantization"]
    assert (q["method"], q["formats"], q["quantized_tensors"]) == ("compressed-tensors", [FORMATS[preset]], 14)
    assert doc["num_params"] == sum(p.numel() for p in compressed_save.llama().parameters())  # packed values unpacked
    res = ckpt("convert", folder, tmp_path / "bf16", "--to", "hf", "--dtype", "bf16")
    assert res.code == 0, res.err
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config
    want_logits, want = load(folder, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    got_logits, got = load(tmp_path / "bf16")
    assert_same_tensors(got, want)
    assert torch.equal(got_logits, want_logits)
    assert ckpt("verify", folder, "--deep").code == 0


def test_fp32_output_is_the_bf16_result_cast(ckpt, compressed, tmp_path):
    """compressed-tensors computes in the scale's dtype (bf16 here): a float32 export is that result, widened, as
    transformers gives it when loading with dtype=float32."""
    folder = compressed["W4A16_ASYM"]
    assert ckpt("merge", folder, tmp_path / "m.safetensors", "--dtype", "fp32").code == 0
    got = load_file(str(tmp_path / "m.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
    )
    want = model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name])
    assert not [n for n in got if n.endswith(("weight_scale", "weight_zero_point", "weight_packed", "weight_shape"))]


def _damage(folder: Path, dest: Path, change) -> Path:
    shutil.copytree(folder, dest)
    shard = dest / "model.safetensors"
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dest


LAYER = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("preset", "change", "deep", "words"),
    [
        ("W4A16", lambda t: t.pop(f"{LAYER}.weight_shape"), False, "has no 2-element integer 'weight_shape'"),
        ("W4A16", lambda t: t.__setitem__(f"{LAYER}.weight_shape", torch.tensor([128, 256])), False, "says 128 rows"),
        ("W4A16", lambda t: t.__setitem__(f"{LAYER}.weight_shape", torch.tensor([256, 512])), False, "is [256, 2] for a 256 x 512"),
        (
            "W4A16",
            lambda t: t.__setitem__(f"{LAYER}.weight_scale", t[f"{LAYER}.weight_scale"][:, :1].contiguous()),
            False,
            "no config group",
        ),
        ("NVFP4A16", lambda t: t.pop(f"{LAYER}.weight_global_scale"), False, "weight_global_scale"),
        ("NVFP4A16", lambda t: t[f"{LAYER}.weight_global_scale"].fill_(float("inf")), True, "not finite or not positive"),
        ("FP8_BLOCK", lambda t: t[f"{LAYER}.weight_scale"].__setitem__((0, 0), 0.0), True, "not finite or not positive"),
    ],
    ids=["no-shape", "wrong-rows", "wrong-cols", "scale-shape", "no-global-scale", "inf-global-scale", "zero-scale"],
)
def test_damaged_compressed_checkpoints_are_caught(ckpt, compressed, tmp_path, preset, change, deep, words):
    bad = _damage(compressed[preset], tmp_path / "bad", change)
    res = ckpt("verify", bad, *(["--deep"] if deep else []))
    assert res.code == 1 and words in res.out + res.err, res.out + res.err
    if not deep:
        assert ckpt("convert", bad, tmp_path / "out", "--to", "hf", "--dtype", "bf16").code == 1
        assert not (tmp_path / "out").exists()


def test_activation_ordering_is_refused_by_name(ckpt, compressed, tmp_path):
    bad = _damage(
        compressed["W4A16"], tmp_path / "bad", lambda t: t.__setitem__(f"{LAYER}.weight_g_idx", torch.zeros(256, dtype=torch.int32))
    )
    res = ckpt("convert", bad, tmp_path / "out", "--to", "hf", "--dtype", "bf16")
    assert res.code == 1 and "weight_g_idx" in res.err


def test_zero_points_of_the_wrong_shape_are_refused(ckpt, compressed, tmp_path):
    bad = _damage(
        compressed["W4A16_ASYM"],
        tmp_path / "bad",
        lambda t: t.__setitem__(f"{LAYER}.weight_zero_point", torch.zeros(3, 2, dtype=torch.int32)),
    )
    res = ckpt("verify", bad)
    assert res.code == 1 and "zero points" in res.out and "need [32, 2]" in res.out, res.out
