"""PEFT adapters: read (inspect, verify) and merged into a streaming base with --adapter, against peft itself.

Producer: peft's get_peft_model + save_pretrained over a tiny transformers Llama, with the adapter weights set at
random (peft starts B at zero, which would merge to the base). Reference: peft's merge_and_unload(); consumer:
transformers' from_pretrained of ckpt's merged release.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_fails
from safetensors.torch import load_file, save_file

import ckpt_cli

TARGETS = ["q_proj", "v_proj", "down_proj"]
VARIANTS = {
    # plain LoRA, with one module's rank and another's alpha of their own
    "lora": {"rank_pattern": {"layers.1.self_attn.q_proj": 2}, "alpha_pattern": {"down_proj": 16}},
    "rslora": {"use_rslora": True},
    "dora": {"use_dora": True},
}
TOKENS = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 127]])


def _peft_model(base: Path, variant: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(base), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **VARIANTS[variant])
    )
    g = torch.Generator().manual_seed(len(variant))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # B non-zero; DoRA's magnitudes near the norms' scale
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "magnitude" in name else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, dict]:
    """Each variant's adapter folder, peft's merged weights and the merged model's logits."""
    _, root = tiny_llama
    base = root / "sharded"  # an hf folder with an index
    out = tmp_path_factory.mktemp("adapters")
    made = {}
    for variant in VARIANTS:
        model = _peft_model(base, variant)
        model.save_pretrained(out / variant)
        merged = model.merge_and_unload()
        with torch.no_grad():
            logits = merged(TOKENS).logits
        made[variant] = {"dir": out / variant, "weights": {k: v.clone() for k, v in merged.state_dict().items()}, "logits": logits}
    made["bin"] = {"dir": out / "bin"}
    _peft_model(base, "lora").save_pretrained(out / "bin", safe_serialization=False)
    return {"base": base, "made": made, "root": out}


@pytest.mark.parametrize("variant", VARIANTS)
def test_merge_is_bit_equal_to_peft_merge_and_unload(ckpt, adapters, tmp_path, variant):
    made = adapters["made"][variant]
    res = ckpt("merge", adapters["base"], tmp_path / "m.safetensors", "--adapter", made["dir"])
    assert res.code == 0, res.err
    assert "merged the" in res.err and "into 6 weights" in res.err
    got = load_file(tmp_path / "m.safetensors")
    ref = made["weights"]
    assert set(got) <= set(ref) and "model.layers.0.self_attn.q_proj.weight" in got
    for name, value in got.items():  # float32 throughout: bit-equal, not only within 1e-6
        assert value.dtype == ref[name].dtype and torch.equal(value, ref[name]), (name, (value - ref[name]).abs().max())
    base = {k: v for f in adapters["base"].glob("*.safetensors") for k, v in load_file(f).items()}
    assert not torch.equal(got["model.layers.1.mlp.down_proj.weight"], base["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_release_loads_and_gives_peft_logits(ckpt, adapters, tmp_path, variant):
    from transformers import LlamaForCausalLM

    made = adapters["made"][variant]
    res = ckpt("convert", adapters["base"], tmp_path / "release", "--to", "hf", "--adapter", made["dir"])
    assert res.code == 0, res.err
    assert (tmp_path / "release" / "config.json").is_file() and (tmp_path / "release" / "generation_config.json").is_file()
    model = LlamaForCausalLM.from_pretrained(tmp_path / "release").eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
    assert (logits - made["logits"]).abs().max().item() <= 1e-5


def test_adapter_applied_to_a_dcp_base_equals_the_hf_route(ckpt, adapters, tmp_path):
    dcp = tmp_path / "dcp"
    assert ckpt("convert", adapters["base"], dcp, "--to", "dcp", "--world-size", "2").code == 0
    made = adapters["made"]["dora"]
    res = ckpt("merge", dcp, tmp_path / "m.safetensors", "--adapter", made["dir"])
    assert res.code == 0, res.err
    got = load_file(tmp_path / "m.safetensors")
    for name, value in got.items():
        assert torch.equal(value, made["weights"][name]), name
    # reshard of that (weights-only) DCP with the adapter: a merged DCP, whose merge is the same again
    res = ckpt("reshard", dcp, tmp_path / "re", "--world-size", "1", "--adapter", made["dir"])
    assert res.code == 0, res.err
    assert ckpt("merge", tmp_path / "re", tmp_path / "re.safetensors").code == 0
    for name, value in load_file(tmp_path / "re.safetensors").items():
        assert torch.equal(value, made["weights"][name]), name
    # a write that carries a training state (DeepSpeed from a state dict) is refused in one line
    res = ckpt("convert", adapters["base"], tmp_path / "ds", "--to", "deepspeed", "--world-size", "1", "--adapter", made["dir"])
    assert res.code == 2 and "merges into model weights" in res.err and "Traceback" not in res.err


def test_a_bin_adapter_and_the_api_keyword(adapters, tmp_path):
    """adapter_model.bin (read by the allow-listed torch reader), the same weights as the 'lora' variant's, through
    the API's keyword."""
    report = ckpt_cli.merge(adapters["base"], tmp_path / "m.safetensors", adapter=adapters["made"]["bin"]["dir"])
    assert report.written and any("merged the LoRA adapter" in n for n in report.notes)
    got, ref = load_file(tmp_path / "m.safetensors"), adapters["made"]["lora"]["weights"]
    for name, value in got.items():
        assert torch.equal(value, ref[name]), name


def test_inspect_and_verify_an_adapter(ckpt, adapters):
    folder = adapters["made"]["lora"]["dir"]
    res = ckpt("inspect", folder, "--json")
    doc = json.loads(res.out)
    assert doc["format"] == "adapter"
    a = doc["details"]["adapter"]
    assert (a["r"], a["lora_alpha"], a["use_rslora"], a["use_dora"]) == (4, 8, False, False)
    assert sorted(a["target_modules"]) == sorted(TARGETS) and len(a["modules"]) == 6
    by_module = {m["module"]: m for m in a["modules"]}
    assert by_module["model.layers.1.self_attn.q_proj"]["r"] == 2 and by_module["model.layers.0.mlp.down_proj"]["lora_alpha"] == 16
    assert by_module["model.layers.0.self_attn.q_proj"]["scale"] == 2.0
    assert by_module["model.layers.0.self_attn.q_proj"]["lora_A"] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    text = ckpt("inspect", folder).out
    assert "adapter      LoRA of base" in text and "model.layers.1.self_attn.q_proj" in text and "r=2" in text
    assert "DoRA" in ckpt("inspect", adapters["made"]["dora"]["dir"]).out
    assert "lora_alpha / sqrt(r)" in ckpt("inspect", adapters["made"]["rslora"]["dir"]).out
    for variant in VARIANTS:
        res = ckpt("verify", adapters["made"][variant]["dir"])
        assert res.code == 0 and "OK" in res.out, res.out + res.err


def _damaged(adapters: dict, tmp_path: Path, how: str) -> Path:
    import shutil

    folder = tmp_path / how
    shutil.copytree(adapters["made"]["dora" if how == "no magnitude" else "lora"]["dir"], folder)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(weights)
    config = json.loads((folder / "adapter_config.json").read_text())
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    if how == "missing lora_B":
        del tensors[f"{q}.lora_B.weight"]
    elif how == "wrong shape":
        tensors[f"{q}.lora_B.weight"] = torch.zeros(32, 3)
    elif how == "no magnitude":
        del tensors[f"{q}.lora_magnitude_vector"]
    elif how == "bad json":
        (folder / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    elif how == "bad r":
        config["r"] = -4
    elif how == "not applicable":
        config["fan_in_fan_out"] = True
    elif how == "not in base":
        tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 32)
        tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(32, 4)
    elif how == "base shape":
        tensors[f"{q}.lora_A.weight"] = torch.zeros(4, 48)
    elif how == "bad pattern":
        config["rank_pattern"] = {"(": 3, "q_proj": 4}
    save_file(tensors, weights)
    if how in ("bad r", "not applicable", "bad pattern"):
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


DAMAGED = [  # how, what verify and --adapter name, the exit code of a merge with it (2: the adapter does not fit the base)
    ("missing lora_B", "has no lora_B weight", 1),
    ("wrong shape", "have different ranks", 1),
    ("no magnitude", "has no lora_magnitude_vector", 1),
    ("bad json", "adapter_config.json: not valid JSON", 1),
    ("bad r", "r must be a positive integer", 1),
    ("not applicable", "fan_in_fan_out", 1),
    ("not in base", "'model.layers.7.self_attn.q_proj.weight', which", 2),
    ("base shape", "is [32, 32] in the base", 2),
    ("bad pattern", "rank_pattern key '(' is not a regular expression", 1),
]


@pytest.mark.parametrize("how,needle,code", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_damaged_adapter_fails_in_one_line(ckpt, adapters, tmp_path, how, needle, code):
    folder = _damaged(adapters, tmp_path, how)
    res = ckpt("merge", adapters["base"], tmp_path / "m.safetensors", "--adapter", folder)
    assert res.code == code and needle in res.err and len(res.err.strip().splitlines()) == 1, res.err
    assert "Traceback" not in res.err and not (tmp_path / "m.safetensors").exists()
    if code == 1:
        assert_fails(ckpt("verify", folder), needle)


def test_adapter_usage_errors(ckpt, adapters, tmp_path):
    res = ckpt("merge", adapters["base"], tmp_path / "m.safetensors", "--adapter", adapters["base"])
    assert res.code == 2 and "not a PEFT adapter folder" in res.err
    lora = adapters["made"]["lora"]["dir"]
    res = ckpt("convert", adapters["base"], tmp_path / "m.safetensors", "--to", "safetensors", "--adapter", lora, "--rename", "a=b")
    assert res.code == 2 and "--name-map, --preset and --rename do not apply" in res.err


def test_keys_with_an_adapter_name_and_bands_of_rows():
    """Keys of a live model's state dict (an FSDP/DCP save) keep the adapter name; a merged weight's bands of rows
    are never under MIN_ROWS (a matmul of a few rows rounds otherwise than peft's whole one)."""
    from ckpt_cli.core.dtypes import BY_NAME
    from ckpt_cli.core.model import TensorEntry
    from ckpt_cli.formats.hf.adapter import split_key
    from ckpt_cli.ops.adapters import MIN_ROWS, LoraMerged

    m = "model.layers.0.self_attn.q_proj"
    assert split_key(f"base_model.model.{m}.lora_A.weight") == (m, "lora_A")
    assert split_key(f"base_model.model.{m}.lora_B.default.weight") == (m, "lora_B")
    assert split_key(f"base_model.model.{m}.lora_magnitude_vector") == (m, "lora_magnitude_vector")
    assert split_key(f"base_model.model.{m}.lora_magnitude_vector.default.weight") == (m, "lora_magnitude_vector")
    assert split_key(f"base_model.model.{m}.lora_A.bias") is None and split_key("model.embed_tokens.weight") is None
    f32 = BY_NAME["float32"]
    for rows, cols in ((2048, 5632), (70, 10**6), (5, 8)):
        entry = TensorEntry("w", f32, (rows, cols), "model", [])
        bands = [count // cols for _, count in LoraMerged(entry, entry, entry, None, 1.0, f32).windows()]
        assert sum(bands) == rows and (len(bands) == 1 or min(bands) >= MIN_ROWS), bands


def test_an_adapter_is_refused_where_a_write_keeps_the_optimizer_partitions(ckpt, adapters, tmp_path):
    """A DeepSpeed reshard keeps its ZeRO partitions: merged weights cannot go there. Refused when planned (exit 2,
    nothing written), not partway through the write; --weights-only writes them."""
    base = tmp_path / "ds"
    assert ckpt("demo", tmp_path / "demo", "--quiet").code == 0
    demo_ds = tmp_path / "demo" / "deepspeed"
    res = ckpt("reshard", demo_ds, base, "--world-size", "1", "--adapter", adapters["made"]["lora"]["dir"])
    assert res.code == 2 and "not a training state" in res.err and len(res.err.strip().splitlines()) == 1, res.err
    assert not base.exists()


def test_an_empty_base_weight_stays_empty(tmp_path):
    """A weight with no columns merges to itself (nothing to add), not a division by zero."""
    import ckpt_cli

    save_file({"m.weight": torch.zeros(4, 0)}, str(tmp_path / "b.safetensors"))
    folder = tmp_path / "a"
    folder.mkdir()
    save_file(
        {"base_model.model.m.lora_A.weight": torch.zeros(2, 0), "base_model.model.m.lora_B.weight": torch.ones(4, 2)},
        str(folder / "adapter_model.safetensors"),
    )
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["m"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    ckpt_cli.convert(tmp_path / "b.safetensors", tmp_path / "o.safetensors", to="safetensors", adapter=folder)
    assert load_file(tmp_path / "o.safetensors")["m.weight"].shape == (4, 0)
