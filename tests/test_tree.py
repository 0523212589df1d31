"""`ckpt inspect --tree`: the module tree of a transformers model (save_pretrained) and of a DeepSpeed
checkpoint, repeated blocks folded, MoE experts summarised, blocks that differ kept apart and named,
dtype mix, tied weights, roles, --depth, --markdown and --json."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import PRODUCERS
from safetensors.torch import save_file
from torch import nn


def tree_json(ckpt, *args):
    res = ckpt("inspect", *args, "--tree", "--json")
    assert res.code == 0, res.err
    return json.loads(res.out)


def child(node, name):
    found = [c for c in node.get("children", []) if c["name"] == name]
    assert found, f"no child {name!r} under {node['path']!r}: {[c['name'] for c in node.get('children', [])]}"
    return found[0]


def leaves(node, prefix=""):
    """name -> (shape, dtype) of every tensor under a node, folds expanded back to their indices."""
    out = {}
    for c in node.get("children", []):
        names = [c["name"]]
        if c.get("repeat"):
            head, _, _ = c["name"].rpartition("{")
            names = [f"{head}{i}" for i in c["indices"]]
        for name in names:
            full = f"{prefix}{name}"
            if "shape" in c:
                out[full] = (tuple(c["shape"]), c["dtype"])
            out.update(leaves(c, full + "."))
    return out


def llama_layer_check(layers, hidden, inter, kv):
    assert layers["repeat"] == 2 and layers["indices"] == [0, 1]
    assert child(child(layers, "mlp"), "gate_proj.weight")["shape"] == [inter, hidden]
    assert child(child(layers, "self_attn"), "k_proj.weight")["shape"] == [kv, hidden]
    assert layers["params"] == 2 * layers["each"]["params"]


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_tree_of_a_transformers_model_folds_its_layers(ckpt, tiny_llama, layout):
    model, root = tiny_llama
    doc = tree_json(ckpt, root / layout)
    top = doc["roles"]["model"]
    assert list(doc["roles"]) == ["model"] and doc["format"] == "hf"
    # save_pretrained drops the tied lm_head: the tree counts what the model has, once
    assert top["params"] == model.num_parameters() == json.loads(ckpt("inspect", root / layout, "--json").out)["num_params"]
    assert top["bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    llama_layer_check(child(child(top, "model"), "layers.{0..1}"), cfg.hidden_size, cfg.intermediate_size, 16)
    # every tensor of the state dict is in the tree, with its shape and dtype
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert leaves(top) == {k: (tuple(v.shape), "float32") for k, v in sd.items()}

    text = ckpt("inspect", root / layout, "--tree").out
    assert "    layers.{0..1} ×2 " in text and "model.layers.1" not in text
    assert text.count("q_proj.weight") == 1 and "note:" not in text


def test_tree_depth_and_markdown(ckpt, tiny_llama):
    model, root = tiny_llama
    lines = ckpt("inspect", root / "sharded", "--tree", "--depth", "2").out.splitlines()
    assert [line.split()[0] for line in lines] == ["name", "model", "model", "embed_tokens.weight", "layers.{0..1}", "norm.weight"]
    doc = tree_json(ckpt, root / "sharded", "--depth", "2")
    assert doc["depth"] == 2 and "children" not in child(child(doc["roles"]["model"], "model"), "layers.{0..1}")
    assert child(child(doc["roles"]["model"], "model"), "layers.{0..1}")["params"] == 2 * 9_280  # still the whole subtree

    zero = ckpt("inspect", root / "sharded", "--tree", "--depth", "0").out.splitlines()
    assert len(zero) == 2 and zero[1].split()[:4] == ["model", "weights", f"{model.num_parameters():,}", "90.75"]

    md = ckpt("inspect", root / "sharded", "--markdown").out.splitlines()  # --markdown implies --tree
    assert md[:2] == ["| module | shape | parameters | bytes | dtype |", "|---|---|--:|--:|---|"]
    assert f"| **model weights** |  | {model.num_parameters():,} | 90.75 kB | float32 |" in md
    assert "| `model.layers.{0..1}` ×2 |  | 18,560 (9,280 each) | 74.24 kB | float32 |" in md
    assert "| `model.layers.{0..1}.self_attn.q_proj.weight` | 32 × 32 | 1,024 | 4.10 kB | float32 |" in md
    assert all(line.startswith("|") and line.endswith("|") for line in md)


@pytest.fixture(scope="module")
def ds_llama(ds_saves):
    return ds_saves[2] / "llama"


def test_tree_of_a_deepspeed_checkpoint(ckpt, ds_llama):
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(PRODUCERS))
    from tiny_llama import config

    cfg = config()
    model = LlamaForCausalLM(cfg)
    doc = tree_json(ckpt, ds_llama)
    assert doc["format"] == "deepspeed" and list(doc["roles"])[:2] == ["model", "optimizer"]
    top = doc["roles"]["model"]
    assert top["params"] == model.num_parameters()
    assert leaves(top) == {k: (tuple(v.shape), "float32") for k, v in model.state_dict().items() if "rotary" not in k}
    llama_layer_check(child(child(top, "model"), "layers.{0..1}"), cfg.hidden_size, cfg.intermediate_size, 16)

    text = ckpt("inspect", ds_llama, "--tree").out.splitlines()
    assert any(line.startswith("    layers.{0..1} ×2 ") for line in text)
    opt = doc["roles"]["optimizer"]
    assert [line for line in text if line.startswith("[optimizer]")] == [
        next(line for line in text if line.startswith(f"[optimizer] {opt['tensors']} tensors"))
    ]
    assert not any(line.startswith("  optimizer") for line in text)  # one line, unless --filter opens it

    # --filter opens the optimizer's tree: its per-parameter states fold as the weights do
    opened = ckpt("inspect", ds_llama, "--tree", "--filter", "optimizer.*").out
    assert "model weights" not in opened and "layers.{0..1} ×2" in opened and "exp_avg_sq" in opened


def test_tree_of_a_deepspeed_bf16_run_counts_every_dtype(ckpt, ds_saves):
    src = ds_saves[3] / "stage3-bf16"
    every = tree_json(ckpt, src, "--filter", "*")  # every role, opened
    assert list(every["roles"]) == ["model", "optimizer"]
    totals: dict[str, int] = {}
    for role in every["roles"].values():
        assert sum(role["dtypes"].values()) == role["bytes"]
        for dtype, n in role["dtypes"].items():
            totals[dtype] = totals.get(dtype, 0) + n
    summary = json.loads(ckpt("inspect", src, "--json").out)
    rows = {t["name"]: t for t in summary["tensors"]}
    for group in summary["details"]["tied"]:  # a tied alias counts once in the tree, at its first name
        for alias in group[1:]:
            t = rows[alias]
            totals[t["dtype"]] += torch.empty(t["shape"], dtype=getattr(torch, t["dtype"])).nbytes
    assert totals == summary["dtypes"]
    lines = ckpt("inspect", src, "--tree").out.splitlines()
    assert lines[1].startswith("model weights") and lines[1].endswith("float32 96%, bfloat16 4%")  # the frozen layer is bf16
    assert [line.split()[-1] for line in lines if line.split()[0] in ("frozen", "block")] == ["float32", "bfloat16"]


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, experts: int, hidden: int = 12) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))


class MoE(nn.Module):
    """Four MoE blocks of 8 experts, then one with a wider expert 5: its block is not folded with the others."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.layers = nn.ModuleList(MoEBlock(8, 8) for _ in range(5))
        self.layers[4].experts[5] = Expert(8, 16)
        self.head = nn.Linear(8, 50)


def test_moe_experts_fold_and_blocks_that_differ_are_named(ckpt, tmp_path):
    torch.manual_seed(0)
    model = MoE()
    sd = model.state_dict()
    sd["embed.weight"] = sd["embed.weight"].to(torch.bfloat16)
    save_file(sd, tmp_path / "moe.safetensors")
    doc = tree_json(ckpt, tmp_path / "moe.safetensors")
    top = doc["roles"]["model"]
    assert top["params"] == sum(p.numel() for p in model.parameters())
    folded = child(child(top, "layers"), "{0..3}")  # `layers` has two children: the fold and the odd block
    assert folded["repeat"] == 4 and child(folded, "experts.{0..7}")["repeat"] == 8
    last = child(child(top, "layers"), "4")
    assert [c["name"] for c in child(last, "experts")["children"]] == ["{0..4,6..7}", "5"]
    assert child(child(last, "experts"), "{0..4,6..7}")["repeat"] == 7
    assert top["dtypes"] == {"bfloat16": 800, "float32": sum(v.nbytes for k, v in sd.items() if k != "embed.weight")}
    assert leaves(top) == {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}

    text = ckpt("inspect", tmp_path / "moe.safetensors", "--tree").out
    assert "  {0..3} ×4 " in text and "experts.{0..7} ×8" in text and "{0..4,6..7} ×7" in text
    assert "float32 9" in text and "bfloat16 " in text  # the dtype mix of the top line, by bytes
    assert [line for line in text.splitlines() if line.startswith("note:")] == [
        "note: layers.4 differs from layers.{0..3}: experts.5.down.weight is float32 [8, 16], not float32 [8, 12]",
        "note: layers.4.experts.5 differs from layers.4.experts.{0..4,6..7}: down.weight is float32 [8, 16], not float32 [8, 12]",
    ]
    assert doc["notes"] == [line.removeprefix("note: ") for line in text.splitlines() if line.startswith("note:")]


def test_tied_weights_count_once(ckpt, tmp_path):
    emb = torch.randn(10, 4)
    torch.save({"model": {"embed.weight": emb, "head.weight": emb, "norm.weight": torch.ones(4)}}, tmp_path / "tied.pt")
    doc = tree_json(ckpt, tmp_path / "tied.pt")
    top = child(doc["roles"]["model"], "model")
    assert top["params"] == 44 and child(top, "head.weight")["tied_to"] == "model.embed.weight"
    text = ckpt("inspect", tmp_path / "tied.pt", "--tree").out
    assert "tied to model.embed.weight" in text


def test_tree_of_a_run_root_names_the_checkpoint_it_chose(ckpt, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200):
        save_file(
            {"layers.0.w": torch.zeros(2, 3), "layers.1.w": torch.ones(2, 3), "layers.10.w": torch.ones(2, 3)},
            run / f"step_{step}.safetensors",
        )
    shown = ckpt("inspect", run, "--tree")
    lines = shown.out.splitlines()
    assert lines[2].split()[:2] == ["layers.{0..1,10}", "×3"]
    assert f"note: {run}: 2 checkpoints (ckpt ls lists them); using 'step_200.safetensors', the newest" in shown.err
    assert "note:" not in shown.out  # notes go to stderr: stdout holds the tree alone
    assert "Note:" not in ckpt("inspect", run, "--markdown").out  # a model card carries no local paths


def test_odd_names_stay_apart(ckpt, tmp_path):
    """Names that are also prefixes, zero-padded and non-ASCII digits, and a very deep name."""
    sd = {"a": torch.ones(1), "a.b": torch.ones(2), "c.01": torch.ones(3), "c.1": torch.ones(3), "d.²": torch.ones(4)}
    sd[".".join(["deep"] * 300)] = torch.ones(5)
    save_file(sd, tmp_path / "odd.safetensors")
    doc = tree_json(ckpt, tmp_path / "odd.safetensors")
    top = doc["roles"]["model"]
    assert sorted(c["name"] for c in child(top, "a")["children"]) == ["(tensor)", "b"]
    assert [c["name"] for c in child(top, "c")["children"]] == ["01", "1"]  # '01' is no index: nothing folds
    assert top["params"] == 1 + 2 + 3 + 3 + 4 + 5 and leaves(top)["a.(tensor)"] == ((1,), "float32")
