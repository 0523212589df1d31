"""Megatron-Core torch_dist checkpoints saved by Megatron's own dist_checkpointing.save (tests/producers/megatron_save.py:
GPTModel with tensor parallel size 2 on the CPU, one torchrun launch). The reference is what Megatron's own
load_plain_tensors returns; the Hugging Face export is checked against the reference split by hand (as NVIDIA's
converters split linear_qkv) and loaded by transformers' LlamaForCausalLM, whose logits equal Megatron's."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_fails, v4_logits
from safetensors.torch import load_file

from ckpt_cli.core.model import FlatRange
from ckpt_cli.core.pickles import zipio
from ckpt_cli.core.training import NameMap
from ckpt_cli.ops.name_map import weights_view
from ckpt_cli.ops.source import open_checkpoint

HEADS, GROUPS, HEAD_DIM, HIDDEN, LAYERS = 4, 2, 16, 64, 2
QKV, FC1 = "decoder.layers.self_attention.linear_qkv.weight", "decoder.layers.mlp.linear_fc1.weight"

# Megatron GPT (Llama-style) -> Hugging Face Llama: layer-stacked keys (homogeneous layers, layer = dim 0).
STACKED_MAP = r"""
split:
  - from: 'decoder\.layers\.self_attention\.linear_qkv\.weight'
    layers: true
    groups: 2
    to: {'model.layers.{layer}.self_attn.q_proj.weight': 2, 'model.layers.{layer}.self_attn.k_proj.weight': 1,
         'model.layers.{layer}.self_attn.v_proj.weight': 1}
  - {from: 'decoder\.layers\.mlp\.linear_fc1\.weight', layers: true,
     to: ['model.layers.{layer}.mlp.gate_proj.weight', 'model.layers.{layer}.mlp.up_proj.weight']}
  - {from: 'decoder\.layers\.self_attention\.linear_proj\.weight', layers: true, to: 'model.layers.{layer}.self_attn.o_proj.weight'}
  - {from: 'decoder\.layers\.mlp\.linear_fc2\.weight', layers: true, to: 'model.layers.{layer}.mlp.down_proj.weight'}
  - {from: 'decoder\.layers\.self_attention\.linear_qkv\.layer_norm_weight', layers: true,
     to: 'model.layers.{layer}.input_layernorm.weight'}
  - {from: 'decoder\.layers\.mlp\.linear_fc1\.layer_norm_weight', layers: true,
     to: 'model.layers.{layer}.post_attention_layernorm.weight'}
rename:
  - {from: '^embedding\.word_embeddings\.weight$', to: 'model.embed_tokens.weight'}
  - {from: '^decoder\.final_layernorm\.weight$', to: 'model.norm.weight'}
  - {from: '^output_layer\.weight$', to: 'lm_head.weight'}
"""
# The same model saved with one key per layer (decoder.layers.N.*): regex groups carry the layer number.
PER_LAYER_MAP = r"""
split:
  - from: 'decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.weight'
    groups: 2
    to: {'model.layers.\1.self_attn.q_proj.weight': 2, 'model.layers.\1.self_attn.k_proj.weight': 1,
         'model.layers.\1.self_attn.v_proj.weight': 1}
  - {from: 'decoder\.layers\.(\d+)\.mlp\.linear_fc1\.weight',
     to: ['model.layers.\1.mlp.gate_proj.weight', 'model.layers.\1.mlp.up_proj.weight']}
rename:
  - {from: '^decoder\.layers\.(\d+)\.self_attention\.linear_proj\.weight$', to: 'model.layers.\1.self_attn.o_proj.weight'}
  - {from: '^decoder\.layers\.(\d+)\.mlp\.linear_fc2\.weight$', to: 'model.layers.\1.mlp.down_proj.weight'}
  - {from: '^decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.layer_norm_weight$', to: 'model.layers.\1.input_layernorm.weight'}
  - {from: '^decoder\.layers\.(\d+)\.mlp\.linear_fc1\.layer_norm_weight$', to: 'model.layers.\1.post_attention_layernorm.weight'}
  - {from: '^embedding\.word_embeddings\.weight$', to: 'model.embed_tokens.weight'}
  - {from: '^decoder\.final_layernorm\.weight$', to: 'model.norm.weight'}
  - {from: '^output_layer\.weight$', to: 'lm_head.weight'}
"""
MAPS = {"stacked": STACKED_MAP, "per_layer": PER_LAYER_MAP}


@pytest.fixture(scope="module")
def reference(mcore):
    return torch.load(mcore / "reference.pt", weights_only=False)


def plain(reference, name):
    return {k: v for k, v in reference[name]["plain"].items() if isinstance(v, torch.Tensor)}


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def equal_trees(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(equal_trees(x, y) for x, y in zip(a, b))
    return a == b


def split_by_hand(ref: dict[str, torch.Tensor], stacked: bool) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names from Megatron's full tensors, as NVIDIA's converters split them (split_qkv_llama)."""

    def key(layer, name):
        return name.replace("decoder.layers.", "decoder.layers." if stacked else f"decoder.layers.{layer}.")

    def get(layer, name):
        return ref[key(layer, name)][layer] if stacked else ref[key(layer, name)]

    per = HEADS // GROUPS
    q_heads = torch.cat([torch.arange((per + 2) * g, (per + 2) * g + per) for g in range(GROUPS)])
    k_heads = torch.arange(per, HEADS + 2 * GROUPS, per + 2)
    out = {"model.embed_tokens.weight": ref["embedding.word_embeddings.weight"], "lm_head.weight": ref["output_layer.weight"]}
    out["model.norm.weight"] = ref["decoder.final_layernorm.weight"]
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        qkv = get(i, QKV).reshape(HEADS + 2 * GROUPS, HEAD_DIM, HIDDEN)
        out[hf + "self_attn.q_proj.weight"] = qkv[q_heads].reshape(-1, HIDDEN)
        out[hf + "self_attn.k_proj.weight"] = qkv[k_heads].reshape(-1, HIDDEN)
        out[hf + "self_attn.v_proj.weight"] = qkv[k_heads + 1].reshape(-1, HIDDEN)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = torch.chunk(get(i, FC1), 2, dim=0)
        out[hf + "self_attn.o_proj.weight"] = get(i, "decoder.layers.self_attention.linear_proj.weight")
        out[hf + "mlp.down_proj.weight"] = get(i, "decoder.layers.mlp.linear_fc2.weight")
        out[hf + "input_layernorm.weight"] = get(i, "decoder.layers.self_attention.linear_qkv.layer_norm_weight")
        out[hf + "post_attention_layernorm.weight"] = get(i, "decoder.layers.mlp.linear_fc1.layer_norm_weight")
    return {k: v.contiguous() for k, v in out.items()}


def hf_export(ckpt, mcore, tmp_path, name):
    (tmp_path / "map.yaml").write_text(MAPS[name])
    res = ckpt("convert", mcore / name, tmp_path / "hf", "--to", "hf", "--name-map", tmp_path / "map.yaml")
    assert res.code == 0, res.err
    return tmp_path / "hf"


@pytest.mark.parametrize("name", ["stacked", "per_layer"])
def test_inspect_lists_every_tensor_by_logical_name_and_global_shape(ckpt, mcore, reference, name):
    res = ckpt("inspect", mcore / name, "--json")
    assert res.code == 0, res.err
    info = json.loads(res.out)
    assert info["format"] == "megatron" and info["world_size"] == 2
    shapes = {t["name"]: t["shape"] for t in info["tensors"]}
    want = {k: list(v.shape) for k, v in plain(reference, name).items()}
    assert {k: v for k, v in shapes.items() if k in want} == want
    if name == "stacked":  # common.pt: the optimizer's common step, iteration, args (through the allow list)
        rng = {f"rng_state/shard_0.{r}_1.2.0.0.torch_rng_state" for r in range(2)}  # the RNG tensors inside the ShardedObjects
        assert set(shapes) - set(want) == {"optimizer.state.common_step", *rng} and info["step"] == 7
        assert shapes[QKV] == [LAYERS, (HEADS + 2 * GROUPS) * HEAD_DIM, HIDDEN] and shapes[FC1] == [LAYERS, 2 * 96, HIDDEN]
        assert info["details"]["num_attention_heads"] == HEADS and info["details"]["num_query_groups"] == GROUPS
        assert info["training_state"]["optimizer"]["kind"] == "Adam/AdamW" and info["training_state"]["rng"]
    else:
        assert set(shapes) == set(want) and info["details"]["layer_stacked_tensors"] == 0


@pytest.mark.parametrize("name", ["stacked", "per_layer"])
def test_raw_export_equals_megatrons_own_full_load(ckpt, mcore, reference, tmp_path, name):
    """Weights under Megatron's names (merge, convert --to hf) and everything (merge --all: optimizer state, common.pt)."""
    ref = plain(reference, name)
    assert ckpt("merge", mcore / name, tmp_path / "w.safetensors").code == 0
    assert ckpt("convert", mcore / name, tmp_path / "hf", "--to", "hf").code == 0
    assert ckpt("merge", mcore / name, tmp_path / "all.pt", "--all").code == 0
    model = {k: v for k, v in ref.items() if not k.startswith("optimizer.")}
    for got in (load_file(tmp_path / "w.safetensors"), load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")):
        assert sorted(got) == sorted(model) and all(same(got[k], v) for k, v in model.items())
    everything = torch.load(tmp_path / "all.pt", weights_only=False)
    assert all(same(everything[k], v) for k, v in ref.items())
    if name == "stacked":
        full = reference[name]["plain"]
        assert everything["iteration"] == full["iteration"] and everything["args"] == full["args"]
        assert str(everything["args"].attention_backend) == "AttnBackend.auto"  # the enum, written back as Megatron's
        assert torch.equal(everything["optimizer"]["state"]["common_step"], full["optimizer"]["state"]["common_step"])
        for rank, loaded in enumerate(reference[name]["rng_state"]):  # a ShardedObject holding tensors, as Megatron's load returns it
            assert equal_trees(everything[f"rng_state/shard_0.{rank}_1.2"], [loaded])


@pytest.mark.parametrize("name", ["stacked", "per_layer"])
def test_hf_export_equals_the_reference_split_by_hand(ckpt, mcore, reference, tmp_path, name):
    got = load_file(hf_export(ckpt, mcore, tmp_path, name) / "model-00001-of-00001.safetensors")
    want = split_by_hand(plain(reference, name), stacked=name == "stacked")
    assert sorted(got) == sorted(want)
    assert all(same(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("name,atol", [("stacked", 1e-5), ("per_layer", 0.05)])
def test_hf_export_loads_in_transformers_with_megatrons_logits(ckpt, mcore, reference, tmp_path, name, atol):
    """LlamaForCausalLM.from_pretrained on the export computes the logits Megatron's GPTModel computed (bf16: to bf16 rounding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = hf_export(ckpt, mcore, tmp_path, name)
    LlamaConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ).save_pretrained(folder)  # fmt: skip
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(reference[name]["ids"]).logits
    assert torch.allclose(logits, reference[name]["logits"], atol=atol, rtol=0)


def test_split_outputs_are_byte_ranges_of_the_distcp_files(mcore):
    """Each q/k/v and gate/up tensor is a list of element ranges of the .distcp chunks: nothing is loaded to split it."""
    source = open_checkpoint(mcore / "stacked")
    view = weights_view(source, NameMap.from_yaml(_write(mcore / "map.yaml", STACKED_MAP)))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        t = view.tensors[name]
        assert all(isinstance(p.region, FlatRange) and p.data.path.endswith(".distcp") for p in t.pieces)
        assert sum(p.region.length for p in t.pieces) == t.numel and t.tiling_problem() is None
    q = view.tensors["model.layers.1.self_attn.q_proj.weight"]
    assert len(q.pieces) == GROUPS  # one range per query group: each group's query rows lie in one tensor-parallel chunk


def _write(path, text):
    path.write_text(text)
    return path


def test_verify_deep_ok_and_damage_exits_1(ckpt, mcore, tmp_path):
    res = ckpt("verify", mcore / "stacked", "--deep")
    assert res.code == 0 and "OK" in res.out, res.out + res.err
    broken = {k: shutil.copytree(mcore / "stacked", tmp_path / k) for k in ("truncated", "json", "no_json", "crc", "common")}
    with open(broken["truncated"] / "__1_0.distcp", "r+b") as f:
        f.truncate(1000)
    assert_fails(ckpt("verify", broken["truncated"]), "__1_0.distcp", "truncated")
    (broken["json"] / "metadata.json").write_text('{"sharded_backend": "torch_di')
    assert_fails(ckpt("verify", broken["json"]), "metadata.json", "not valid JSON")
    (broken["no_json"] / "metadata.json").unlink()
    assert_fails(ckpt("verify", broken["no_json"]), "metadata.json", "missing")
    res = ckpt("inspect", broken["no_json"])  # still read, with a note: the save may not have finished
    assert res.code == 0 and "may not have finished" in res.out + res.err
    (broken["no_json"] / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    res = ckpt("inspect", broken["no_json"])
    assert res.code == 2 and "sharded_backend 'zarr'" in res.err and "torch_dist" in res.err, res.err
    chunk = open_checkpoint(broken["crc"]).tensors[QKV].pieces[-1].data  # a byte of a weight chunk flipped
    _flip(chunk.path, chunk.offset + 5)
    assert ckpt("verify", broken["crc"]).code == 0  # structure intact: only the CRCs see it
    assert_fails(ckpt("verify", broken["crc"], "--deep"), Path(chunk.path).name, "CRC")
    with open(broken["common"] / "common.pt", "rb") as f:  # the optimizer's common step: a tensor record of common.pt
        _flip(broken["common"] / "common.pt", zipio.read_records(f, "common.pt")["data/0"].data_offset)
    assert_fails(ckpt("verify", broken["common"], "--deep"), "common.pt")


def _flip(path, offset):
    """Bit rot: one byte changed, the file's times kept."""
    times = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


def test_read_never_imports_megatron(mcore):
    """Megatron's classes in .metadata (SavePlan plans, MCoreMetadata) and common.pt (args, enums) go through stand-ins."""
    code = (
        "import sys; from ckpt_cli.ops.source import open_checkpoint; "
        f"c = open_checkpoint({str(mcore / 'stacked')!r}); assert c.format == 'megatron' and len(c.tensors) == 30; "
        "assert not [m for m in sys.modules if m.startswith('megatron')], 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plain_dcp_reader_refuses_megatrons_metadata_by_name(ckpt, mcore):
    res = ckpt("inspect", mcore / "stacked", "--format", "dcp")
    assert_fails(res, "torch.distributed.checkpoint.planner.SavePlan", "not on the allow list")


def test_reformulated_tensors_are_left_out_with_a_note(ckpt, mcore, tmp_path):
    """Megatron < 0.14 recorded N-D reformulated tensors in Metadata.mcore_data; their stored shape is not the logical one."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = shutil.copytree(mcore / "per_layer", tmp_path / "old")
    meta = FileSystemReader(str(folder)).read_metadata()
    meta.mcore_data = {"output_layer.weight": {"nd_reformulated_orig_global_shape": (128, 64)}}
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    res = ckpt("inspect", folder, "--json")
    info = json.loads(res.out)
    assert "output_layer.weight" not in {t["name"] for t in info["tensors"]}
    assert any("reformulated" in n and "output_layer.weight [128, 64]" in n for n in info["notes"])


def test_name_map_mistakes_are_usage_errors(ckpt, mcore, tmp_path):
    cases = {
        "split: [{from: 'x', to: {a: 0}}]": "shares >= 1",
        "split: [{from: 'decoder\\.layers\\.self_attention\\.linear_qkv\\.weight', layers: true, to: [a, b]}]": "{layer}",
        "split: [{from: 'decoder\\.layers\\.self_attention\\.linear_qkv\\.weight', groups: 3, layers: true, to: ['{layer}a']}]": "3 groups",
        "split: [{from: '(', to: a}]": "bad regular expression",
    }
    for text, needle in cases.items():
        res = ckpt("convert", mcore / "stacked", tmp_path / "out", "--to", "hf", "--name-map", _write(tmp_path / "m.yaml", text))
        assert res.code == 2 and needle in res.err and "Traceback" not in res.err, (text, res.err)
    _write(tmp_path / "m.yaml", STACKED_MAP)
    res = ckpt("convert", mcore / "stacked", tmp_path / "out", "--to", "dcp", "--world-size", "1", "--name-map", tmp_path / "m.yaml")
    assert res.code == 2 and "weight exports" in res.err, res.err


def test_a_payload_in_common_pt_is_named_by_inspect_and_refused(ckpt, mcore, tmp_path):
    from conftest import Evil

    folder = shutil.copytree(mcore / "stacked", tmp_path / "evil")
    marker = tmp_path / "pwned"
    common = torch.load(folder / "common.pt", weights_only=False)
    torch.save({**common, "payload": Evil(marker)}, folder / "common.pt")
    res = ckpt("inspect", folder)
    assert res.code == 0 and "refused: 'common.pt' is a pickle that needs global 'posix.system'" in res.out, res.out + res.err
    assert_fails(ckpt("verify", folder), "posix.system")
    assert ckpt("merge", folder, tmp_path / "out.pt", "--all").code == 1
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_reshard_says_megatron_reshards_at_load(ckpt, mcore, tmp_path):
    res = ckpt("reshard", mcore / "stacked", tmp_path / "out", "--world-size", 1)
    assert res.code == 2 and "Megatron-Core reshards a torch_dist checkpoint itself" in res.err and "one file" not in res.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,atol", [("stacked", 1e-5), ("per_layer", 0.05)])
def test_megatron_gpt_preset_export_equals_the_hand_split_and_gives_megatrons_logits(ckpt, mcore, reference, tmp_path, name, atol):
    """--preset megatron-gpt takes its query groups and heads from --hf-config's config.json: the same export as the
    hand-written map, and `ckpt parity` against Megatron's own logits passes (bf16 saves: to bf16 rounding)."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "config")  # fmt: skip
    out = tmp_path / "release"
    res = ckpt("convert", mcore / name, out, "--to", "hf", "--preset", "megatron-gpt", "--hf-config", tmp_path / "config")
    assert res.code == 0, res.err
    got = load_file(out / "model-00001-of-00001.safetensors")
    want = split_by_hand(plain(reference, name), stacked=name == "stacked")
    assert sorted(got) == sorted(want) and all(same(got[k], v) for k, v in want.items())
    torch.save({"logits": reference[name]["logits"], "tokens": reference[name]["ids"]}, tmp_path / "logits.pt")
    res = ckpt("parity", out, "--logits", tmp_path / "logits.pt", "--atol", str(atol), "--json")
    assert res.code == 0 and json.loads(res.out)["ok"], res.out + res.err
    hint = ckpt("convert", mcore / name, tmp_path / "plain", "--to", "hf")
    assert hint.code == 0 and "--preset megatron-gpt" in hint.err


def test_megatron_moe_preset_gives_every_expert_and_megatrons_logits(ckpt, mcore, reference, tmp_path):
    """A Mixtral-style Megatron MoE (4 SequentialMLP experts per layer, top-2, TP=2): the expert keys are read as
    Megatron's load_plain_tensors has them ([layer, expert, ...]), --preset megatron-gpt writes every expert under
    MixtralForCausalLM's per-expert names (linear_fc1 split into w1 gate and w3 up, linear_fc2 as w2, the router as
    block_sparse_moe.gate) bit for bit, and transformers computes Megatron's logits from the release."""
    from transformers import MixtralConfig

    MixtralConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,  # Megatron's rotary_base (Mixtral's default: 1e6)
    ).save_pretrained(tmp_path / "config")  # fmt: skip
    ref = plain(reference, "moe")
    source = open_checkpoint(mcore / "moe")
    for key in ("decoder.layers.mlp.experts.experts.linear_fc1.weight", "decoder.layers.mlp.router.weight"):
        t = source.tensors[key]
        assert list(t.shape) == list(ref[key].shape)
    out = tmp_path / "release"
    res = ckpt("convert", mcore / "moe", out, "--to", "hf", "--preset", "megatron-gpt", "--hf-config", tmp_path / "config")
    assert res.code == 0, res.err
    got = load_file(out / "model-00001-of-00001.safetensors")
    fc1, fc2 = ref["decoder.layers.mlp.experts.experts.linear_fc1.weight"], ref["decoder.layers.mlp.experts.experts.linear_fc2.weight"]
    for layer in range(LAYERS):
        moe = f"model.layers.{layer}.block_sparse_moe."
        assert same(got[moe + "gate.weight"], ref["decoder.layers.mlp.router.weight"][layer].contiguous())
        for e in range(4):
            gate, up = torch.chunk(fc1[layer, e], 2, dim=0)
            assert same(got[f"{moe}experts.{e}.w1.weight"], gate.contiguous()) and same(got[f"{moe}experts.{e}.w3.weight"], up.contiguous())
            assert same(got[f"{moe}experts.{e}.w2.weight"], fc2[layer, e].contiguous())
    assert len([k for k in got if ".experts." in k]) == LAYERS * 4 * 3
    torch.save({"logits": reference["moe"]["logits"], "tokens": reference["moe"]["ids"]}, tmp_path / "logits.pt")
    res = ckpt("parity", out, "--logits", tmp_path / "logits.pt", "--atol", "1e-5", "--json")
    assert res.code == 0 and json.loads(res.out)["ok"], res.out + res.err
    config = json.loads((out / "config.json").read_text())  # v5 wrote rope_parameters only; v4 reads rope_theta
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0


def test_megatron_qwen_preset_splits_the_qkv_bias_and_gives_megatrons_logits(ckpt, mcore, reference, tmp_path):
    """Qwen2-style (add_qkv_bias): --preset megatron-gpt splits linear_qkv.bias per query group as the weight, and
    Qwen2ForCausalLM.from_pretrained on the release computes Megatron's logits."""
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
    ).save_pretrained(tmp_path / "config")  # fmt: skip
    out = tmp_path / "release"
    res = ckpt("convert", mcore / "qwen", out, "--to", "hf", "--preset", "megatron-gpt", "--hf-config", tmp_path / "config")
    assert res.code == 0, res.err
    got = load_file(out / "model-00001-of-00001.safetensors")
    bias = plain(reference, "qwen")["decoder.layers.self_attention.linear_qkv.bias"]
    per = HEADS // GROUPS
    for layer in range(LAYERS):
        heads = bias[layer].reshape(HEADS + 2 * GROUPS, HEAD_DIM)
        q = torch.cat([heads[(per + 2) * g : (per + 2) * g + per] for g in range(GROUPS)]).flatten()
        k, v = heads[per :: per + 2].flatten(), heads[per + 1 :: per + 2].flatten()
        for proj, want in (("q", q), ("k", k), ("v", v)):
            assert same(got[f"model.layers.{layer}.self_attn.{proj}_proj.bias"], want.contiguous())
    torch.save({"logits": reference["qwen"]["logits"], "tokens": reference["qwen"]["ids"]}, tmp_path / "logits.pt")
    res = ckpt("parity", out, "--logits", tmp_path / "logits.pt", "--atol", "1e-5", "--json")
    assert res.code == 0 and json.loads(res.out)["ok"], res.out + res.err


def test_megatron_moe_release_loads_in_transformers_v4(ckpt, mcore, reference, tmp_path):
    """transformers v4 (one tensor per expert, rope_theta at the top level) loads the Mixtral release with no missing or
    unexpected key and computes Megatron's logits."""
    test_megatron_moe_preset_gives_every_expert_and_megatrons_logits(ckpt, mcore, reference, tmp_path)
    got = v4_logits(tmp_path / "release", reference["moe"]["ids"][0].tolist())
    assert got["version"].startswith("4.") and not got["missing"] and not got["unexpected"], got
    assert torch.allclose(got["logits"], reference["moe"]["logits"], atol=1e-5, rtol=0)
