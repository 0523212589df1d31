"""torchtitan -> Hugging Face with the `torchtitan-llama3` preset, against torchtitan itself: a real torchtitan 0.3.0
run (tests/producers/torchtitan_llama.py: FSDP2 on 2 CPU processes, saved by its own CheckpointManager) is exported
by ckpt and compared with torchtitan's own HF export (its state-dict adapter permutes q/k for Hugging Face's rotary
layout) bit for bit, and run by transformers against the torchtitan model's own logits (`ckpt parity`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file

pytest.importorskip("torchtitan", reason="torchtitan is installed by the README's test command (tests/requirements-nodeps.txt)")


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("torchtitan")
    torchrun(2, "torchtitan_llama.py", out, timeout=600)
    args = json.loads((out / "model_args.json").read_text())
    from transformers import LlamaConfig

    scaling = args["rope_scaling"]
    config = LlamaConfig(
        vocab_size=args["vocab_size"],
        hidden_size=args["dim"],
        intermediate_size=args["hidden_dim"],
        num_hidden_layers=args["n_layers"],
        num_attention_heads=args["n_heads"],
        num_key_value_heads=args["n_kv_heads"],
        head_dim=args["head_dim"],
        max_position_embeddings=args["max_seq_len"],
        rms_norm_eps=args["norm_eps"],
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": args["rope_theta"],
            "factor": scaling["factor"],
            "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_max_position_embeddings": scaling["original_max_position_embeddings"],
        },
    )
    config.save_pretrained(out / "hf_config")
    return out


def export(ckpt, titan: Path, dest: Path, *extra: str):
    return ckpt("convert", titan / "step-2", dest, "--to", "hf", "--hf-config", titan / "hf_config", *extra)


def test_preset_export_is_bit_equal_to_torchtitans_own(ckpt, titan, tmp_path):
    res = export(ckpt, titan, tmp_path / "release", "--preset", "torchtitan-llama3")
    assert res.code == 0, res.err
    assert "4 permuted to the other rotary layout" in res.err
    ours = load_file(tmp_path / "release" / "model-00001-of-00001.safetensors")
    theirs = load_file(titan / "hf_export" / "model-00001-of-00001.safetensors")
    assert ours.keys() == theirs.keys() and len(ours) == 21
    for name, tensor in theirs.items():
        assert tensor.dtype == ours[name].dtype and torch.equal(tensor, ours[name]), name
    config = json.loads((tmp_path / "release" / "config.json").read_text())
    assert config["num_attention_heads"] == 4 and config["tie_word_embeddings"] is False


def test_preset_export_gives_torchtitans_logits(ckpt, titan, tmp_path):
    """transformers runs the release; the logits equal the trained torchtitan model's (fp32, max |diff| <= 1e-5)."""
    assert export(ckpt, titan, tmp_path / "release", "--preset", "torchtitan-llama3").code == 0
    res = ckpt("parity", tmp_path / "release", "--logits", titan / "logits.pt", "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out)["ok"] and json.loads(res.out)["max_abs_diff"] <= 1e-5 and json.loads(res.out)["argmax_equal"] == 16
    assert json.loads(res.out)["tokens"] == list(range(1, 17))  # the ids torchtitan ran, from the logits file


def test_a_rename_only_export_is_caught_by_parity(ckpt, titan, tmp_path):
    """The silent bug the preset exists for: the same renames without the q/k permutation load without an error and
    compute something else; parity says so (exit 1)."""
    renames = [line for line in _preset_renames()]
    res = export(ckpt, titan, tmp_path / "wrong", *[x for r in renames for x in ("--rename", r)])
    assert res.code == 0, res.err
    assert "look like 'torchtitan-llama3'" not in res.err  # a name map was given: no hint
    res = ckpt("parity", tmp_path / "wrong", "--logits", titan / "logits.pt")
    assert res.code == 1 and "FAILED" in res.out and "Traceback" not in res.err


def test_without_a_preset_the_export_names_it(ckpt, titan, tmp_path):
    res = ckpt("convert", titan / "step-2", tmp_path / "plain", "--to", "hf")
    assert res.code == 0 and "--preset torchtitan-llama3" in res.err
    res = ckpt("convert", titan / "step-2", tmp_path / "no-config", "--to", "hf", "--preset", "torchtitan-llama3")
    assert res.code == 2 and "--hf-config" in res.err and not (tmp_path / "no-config").exists()


def _preset_renames() -> list[str]:
    from ckpt_cli import presets

    return [f"{pattern}={repl}" for pattern, repl in presets.load("torchtitan-llama3").renames]


# ---- torchtitan Qwen3 MoE (tests/producers/torchtitan_qwen3_moe.py) -------------------------------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict[str, Path]:
    """Two real torchtitan Qwen3-MoE runs: with its default load-balancing bias ("balanced") and without it ("plain")."""
    root = tmp_path_factory.mktemp("torchtitan_qwen3")
    torchrun(2, "torchtitan_qwen3_moe.py", root / "balanced", timeout=600)
    torchrun(2, "torchtitan_qwen3_moe.py", root / "plain", "--no-load-balance", timeout=600)
    args = json.loads((root / "plain" / "model_args.json").read_text())
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=args["vocab_size"], hidden_size=args["dim"], intermediate_size=args["moe_hidden_dim"],
        moe_intermediate_size=args["moe_hidden_dim"], num_hidden_layers=args["n_layers"], num_attention_heads=args["n_heads"],
        num_key_value_heads=args["n_kv_heads"], head_dim=args["head_dim"], max_position_embeddings=args["max_seq_len"],
        rms_norm_eps=args["norm_eps"], num_experts=args["num_experts"], num_experts_per_tok=args["top_k"],
        norm_topk_prob=args["route_norm"], decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": args["rope_theta"]},
    ).save_pretrained(root / "hf_config")  # fmt: skip
    return {"balanced": root / "balanced", "plain": root / "plain", "config": root / "hf_config"}


def test_qwen3_moe_preset_export_has_every_expert_and_torchtitans_logits(ckpt, qwen3, tmp_path):
    """Every expert of the grouped [E, F, D] tensors split out, bit-equal to torchtitan's own export (Qwen3StateDictAdapter);
    transformers' Qwen3-MoE gives the torchtitan model's logits (its experts' GEMMs in float32, as the fp32 release)."""
    run = qwen3["plain"]
    res = ckpt(
        "convert", run / "step-2", tmp_path / "release", "--to", "hf", "--preset", "torchtitan-qwen3", "--hf-config", qwen3["config"]
    )
    assert res.code == 0, res.err
    ours = load_file(tmp_path / "release" / "model-00001-of-00001.safetensors")
    theirs = load_file(run / "hf_export" / "model-00001-of-00001.safetensors")
    assert ours.keys() == theirs.keys() and sum(".mlp.experts." in k for k in ours) == 2 * 4 * 3
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    res = ckpt("parity", tmp_path / "release", "--logits", run / "logits_fp32.pt", "--json")
    assert res.code == 0 and json.loads(res.out)["max_abs_diff"] <= 1e-5, res.out + res.err
    hint = ckpt("convert", run / "step-2", tmp_path / "plain", "--to", "hf")
    assert "--preset torchtitan-qwen3" in hint.err and "torchtitan-llama3" not in hint.err


def test_qwen3_moe_with_a_load_balancing_bias_is_refused(ckpt, qwen3, tmp_path):
    """torchtitan routes with its trained expert_bias_E; Hugging Face's Qwen3-MoE router has none, so a release would
    send some tokens to other experts: refused by name (exit 2), nothing written."""
    run = qwen3["balanced"]
    res = ckpt(
        "convert", run / "step-2", tmp_path / "release", "--to", "hf", "--preset", "torchtitan-qwen3", "--hf-config", qwen3["config"]
    )
    assert res.code == 2 and "expert_bias_E is not all zeros" in res.err and not (tmp_path / "release").exists()


# ---- torchtitan DeepSeek-V3 (tests/producers/torchtitan_deepseek_v3.py) ----------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> dict[str, Path]:
    """A real torchtitan DeepSeek-V3 run (MLA, a dense layer then two MoE layers with a shared expert, sigmoid routing,
    a trained load-balancing bias) and the Hugging Face config its sizes give."""
    root = tmp_path_factory.mktemp("torchtitan_deepseek_v3")
    torchrun(2, "torchtitan_deepseek_v3.py", root / "run", timeout=600)
    a = json.loads((root / "run" / "model_args.json").read_text())
    from transformers import DeepseekV3Config

    assert a["score_func"] == "sigmoid" and a["rope_format"] == "complex" and a["rope_scaling"] == "yarn"
    rope = {"rope_type": "yarn", "rope_theta": a["rope_theta"], "factor": a["rope_factor"], "truncate": a["rope_truncate"]}
    rope |= {"original_max_position_embeddings": a["original_seq_len"], "beta_fast": a["beta_fast"], "beta_slow": a["beta_slow"]}
    rope |= {"mscale": a["mscale"], "mscale_all_dim": a["mscale"]}  # equal: torchtitan applies no extra attention factor
    DeepseekV3Config(
        vocab_size=a["vocab_size"], hidden_size=a["dim"], intermediate_size=a["dense_hidden_dim"],
        moe_intermediate_size=a["moe_hidden_dim"], num_hidden_layers=a["n_layers"], num_attention_heads=a["n_heads"],
        num_key_value_heads=a["n_heads"], n_shared_experts=a["num_shared_experts"], n_routed_experts=a["num_experts"],
        routed_scaling_factor=a["route_scale"], kv_lora_rank=a["kv_lora_rank"], q_lora_rank=a["q_lora_rank"] or None,
        qk_rope_head_dim=a["qk_rope_head_dim"], v_head_dim=a["v_head_dim"], qk_nope_head_dim=a["qk_nope_head_dim"],
        n_group=1, topk_group=1, num_experts_per_tok=a["top_k"], first_k_dense_replace=a["n_dense_layers"],
        norm_topk_prob=a["route_norm"], max_position_embeddings=int(a["original_seq_len"] * a["rope_factor"]),
        rms_norm_eps=a["norm_eps"], tie_word_embeddings=False, rope_parameters=rope, rope_interleave=True, num_mtp_layers=0,
    ).save_pretrained(root / "hf_config")  # fmt: skip
    return {"run": root / "run", "config": root / "hf_config"}


def test_deepseek_v3_preset_export_equals_torchtitans_own_and_its_logits(ckpt, deepseek, tmp_path):
    """MLA, the dense and MoE layers, shared experts and the router's bias (as e_score_correction_bias) bit-equal to
    torchtitan's own export; transformers' DeepseekV3 gives its logits to 1e-4: transformers builds kv_a_layernorm with
    eps 1e-6 in code where torchtitan's kv_norm has 1e-5 (about 3e-5 in the logits; docs/formats.md §12)."""
    run = deepseek["run"]
    preset = ("--preset", "torchtitan-deepseek-v3", "--hf-config", deepseek["config"])
    res = ckpt("convert", run / "step-2", tmp_path / "release", "--to", "hf", *preset)
    assert res.code == 0, res.err
    ours = load_file(tmp_path / "release" / "model-00001-of-00001.safetensors")
    theirs = load_file(run / "hf_export" / "model-00001-of-00001.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert sum(".mlp.experts." in k for k in ours) == 2 * 4 * 3 and "model.layers.1.mlp.gate.e_score_correction_bias" in ours
    assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0  # a trained bias, carried
    res = ckpt("parity", tmp_path / "release", "--logits", run / "logits_fp32.pt", "--atol", "1e-4", "--json")
    assert res.code == 0 and json.loads(res.out)["argmax_equal"] == 16, res.out + res.err
