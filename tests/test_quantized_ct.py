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
        ("W4A16", lambda t: t.pop(f"{LAYER}.weight_shape"), False, f"has no '{LAYER}.weight_shape'"),
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


@pytest.fixture(scope="session")
def compressed_more(tmp_path_factory):
    """Layouts the tests above do not dequantize (int8 per channel, int8 packed, FP8 per tensor and per channel),
    saved by compressed-tensors the same way."""
    root = tmp_path_factory.mktemp("compressed_more")
    return {preset: compressed_save.save(preset, root / preset) for preset in compressed_save.MORE_PRESETS}


def _companions(folder: Path) -> list[str]:
    """What compressed-tensors' own compressor stores for each quantized Linear of the folder, values included: its
    `compression_param_names` for the folder's scheme and format."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qconfig = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = qconfig["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or qconfig["format"])
    return list(compressor.compression_param_names(scheme))


LAYERS = (LAYER, "model.layers.1.mlp.down_proj")


@pytest.mark.parametrize("preset", [*compressed_save.PRESETS, *compressed_save.MORE_PRESETS])
def test_a_quantized_weight_without_a_stored_companion_fails_wherever_it_is_read(ckpt, compressed, compressed_more, tmp_path, preset):
    """Each tensor a layout stores for a quantized weight (its values, weight_scale, weight_shape, weight_global_scale,
    weight_zero_point when asymmetric), taken away in turn: verify, with and without --deep, fails (exit 1) on one line
    naming the tensor and its file; inspect and every conversion stop as well, writing nothing."""
    folder = {**compressed, **compressed_more}[preset]
    assert ckpt("verify", folder, "--deep").code == 0
    stored = load_file(str(folder / "model.safetensors"))
    names = _companions(folder)
    assert "weight_scale" in names and all(f"{layer}.{n}" in stored for layer in LAYERS for n in names), names
    for k, companion in enumerate(names):
        tensor = f"{LAYERS[k % 2]}.{companion}"
        bad = _damage(folder, tmp_path / companion, lambda t, tensor=tensor: t.pop(tensor))
        for deep in ([], ["--deep"]):
            res = ckpt("verify", bad, *deep)
            lines = [line for line in (res.out + res.err).splitlines() if f"'{tensor}'" in line]
            assert res.code == 1 and len(lines) == 1 and f"{bad / 'model.safetensors'}:" in lines[0], (companion, res.out + res.err)
        res = ckpt("inspect", bad, "--json")
        assert res.code == 1 and f"'{tensor}'" in res.err and len(res.err.strip().splitlines()) == 1, (companion, res.err)
        for dtype in ("bf16", "keep"):
            res = ckpt("convert", bad, tmp_path / "out", "--to", "hf", "--dtype", dtype)
            assert res.code == 1 and f"'{tensor}'" in res.err and not (tmp_path / "out").exists(), (companion, dtype, res.err)


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
def test_activation_order_group_without_g_idx_fails_for_every_weight(ckpt, compressed, tmp_path, preset):
    """A config whose weights were quantized in activation order 'group' promises a `weight_g_idx` for each weight:
    without them every weight's columns would land in the wrong groups."""
    bad = shutil.copytree(compressed[preset], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (bad / "config.json").write_text(json.dumps(config))
    res = ckpt("verify", bad)
    lines = [line for line in res.out.splitlines() if line.strip().endswith("it cannot be dequantized")]
    assert res.code == 1 and len(lines) == 14 and all(".weight_g_idx'" in line for line in lines), res.out
    assert ckpt("convert", bad, tmp_path / "out", "--to", "hf", "--dtype", "bf16").code == 1
