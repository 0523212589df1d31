"""Name-map transforms and presets on numbers: the rotary permutation against the formula torchtitan's adapter and
Hugging Face's convert_llama_weights_to_hf.py use, its inverse, casts and windows; presets listed, loaded, suggested;
--hf-config carried into a release with its dtype and tie_word_embeddings set to what is written; parity's refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import v4_logits
from safetensors.torch import load_file, save_file

from ckpt_cli import presets
from ckpt_cli.core.dtypes import by_name
from ckpt_cli.core.model import Box, Piece, StoredArray, TensorEntry
from ckpt_cli.core.names import rope
from ckpt_cli.core.reading import SourceFiles, read_elements


def to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan Llama3StateDictAdapter._permute / Hugging Face's permute (convert_llama_weights_to_hf.py)."""
    rows, cols = w.shape[0], w[0].numel()
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(w.shape)


def entry_of(tmp_path, name: str, tensor: torch.Tensor) -> TensorEntry:
    path = tmp_path / f"{name}.bin"
    path.write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    dtype = by_name(str(tensor.dtype).removeprefix("torch."))
    shape = tuple(tensor.shape)
    array = StoredArray(str(path), 0, dtype, shape, tuple(tensor.contiguous().stride()))
    return TensorEntry(name, dtype, shape, "model", [Piece(Box((0,) * len(shape), shape), array)])


def read_all(entry: TensorEntry) -> torch.Tensor:
    return read_elements(entry, 0, entry.numel, SourceFiles()).reshape(entry.shape)


@pytest.mark.parametrize("heads,head_dim,cols", [(4, 8, 16), (2, 16, 3), (8, 2, 1), (1, 64, 5)])
def test_permute_equals_the_reference_formula_and_round_trips(tmp_path, heads, head_dim, cols):
    w = torch.randn(heads * head_dim, cols).squeeze(-1) if cols == 1 else torch.randn(heads * head_dim, cols)
    src = entry_of(tmp_path, "w", w)
    halves = rope.permuted(src, "q", heads, "halves")
    assert torch.equal(read_all(halves), to_halves(w, heads))
    saved = entry_of(tmp_path, "h", read_all(halves))
    assert torch.equal(read_all(rope.permuted(saved, "q", heads, "interleaved")), w)  # the inverse: from_hf


def test_split_of_layers_of_stacked_experts(tmp_path):
    """`layers: 2`: a [layers, experts, 2F, H] tensor (Megatron's stacked SequentialMLP linear_fc1) to one gate and one up
    tensor per layer and expert, each a byte range of the source; names need {layer} and {expert}."""
    from ckpt_cli.core.names.row_split import RowSplit
    from ckpt_cli.errors import UsageError

    w = torch.randn(3, 4, 10, 6)
    split = RowSplit.parse({"from": "fc1", "layers": 2, "to": ["l{layer}.e{expert}.gate", "l{layer}.e{expert}.up"]}, "map")
    out = {t.name: t for t in split.apply(entry_of(tmp_path, "fc1", w), "fc1")}
    assert len(out) == 3 * 4 * 2 and split.describe().endswith(
        "per layer and expert: rows -> l{layer}.e{expert}.gate, l{layer}.e{expert}.up"
    )
    for layer in range(3):
        for e in range(4):
            gate, up = torch.chunk(w[layer, e], 2)
            assert torch.equal(read_all(out[f"l{layer}.e{e}.gate"]), gate) and torch.equal(read_all(out[f"l{layer}.e{e}.up"]), up)
    with pytest.raises(UsageError, match=r"needs \{layer\} and \{expert\}"):
        RowSplit.parse({"from": "fc1", "layers": 2, "to": "l{layer}.gate"}, "map")
    with pytest.raises(UsageError, match="layers true, false or 2"):
        RowSplit.parse({"from": "fc1", "layers": 3, "to": "l{layer}"}, "map")


def test_permute_is_row_ranges_of_the_source_read_anywhere(tmp_path):
    """Each output row is one stored source row (the export copies bytes, no torch); any element range reads right."""
    w = torch.randn(32 * 4, 6, dtype=torch.bfloat16)
    src = entry_of(tmp_path, "w", w)
    perm = rope.permuted(src, "q", 32, "halves")
    assert perm.derived is None and {p.data.path for p in perm.pieces} == {str(tmp_path / "w.bin")}  # made when read
    assert len(perm.pieces) == 32 * 4 and all(p.region.length == 6 for p in perm.pieces)
    expected = to_halves(w, 32).flatten()
    for start, count in [(5, 7), (23, 100), (0, 1), (w.numel() - 3, 3), (0, w.numel())]:
        assert torch.equal(read_elements(perm, start, count, SourceFiles()), expected[start : start + count])


def test_permute_refuses_shapes_that_are_not_heads(tmp_path):
    from ckpt_cli.errors import UsageError

    src = entry_of(tmp_path, "w", torch.randn(12, 4))
    for heads in (5, 4, 0):  # 12 rows are not 5 heads; 4 heads of 3 rows have no pairs; no heads at all
        with pytest.raises(UsageError, match="heads"):
            rope.permuted(src, "q", heads, "halves")
    with pytest.raises(UsageError, match="rope layout"):
        rope.permuted(src, "q", 2, "sideways")


def test_presets_are_listed_loaded_and_described():
    assert "torchtitan-llama3" in presets.names()
    names = presets.load("torchtitan-llama3")
    assert len(names.permutes) == 2 and names.renames
    assert "torchtitan" in presets.describe("torchtitan-llama3")
    from ckpt_cli.errors import UsageError

    with pytest.raises(UsageError, match="presets: .*torchtitan-llama3"):
        presets.load("llama-from-mars")


@pytest.fixture
def titan_like(tmp_path):
    """A state dict in torchtitan's names (older torchtitan: wq, output), and a config folder for it."""
    torch.manual_seed(0)
    sd = {
        "tok_embeddings.weight": torch.randn(10, 16),
        "layers.0.attention.wq.weight": torch.randn(16, 16),
        "layers.0.attention.wk.weight": torch.randn(8, 16),
        "layers.0.attention.wv.weight": torch.randn(8, 16),
        "output.weight": torch.randn(10, 16),
    }
    save_file(sd, tmp_path / "titan.safetensors")
    (tmp_path / "cfg").mkdir()
    config = {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "torch_dtype": "float32",
        "tie_word_embeddings": True,
    }
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    (tmp_path / "cfg" / "tokenizer.json").write_text("{}")
    return sd, tmp_path


def test_preset_export_with_hf_config(ckpt, titan_like):
    sd, root = titan_like
    res = ckpt(
        "convert",
        root / "titan.safetensors",
        root / "rel",
        "--to",
        "hf",
        "--preset",
        "torchtitan-llama3",
        "--hf-config",
        root / "cfg",
        "--dtype",
        "bf16",
    )
    assert res.code == 0, res.err
    out = load_file(root / "rel" / "model-00001-of-00001.safetensors")
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], to_halves(sd["layers.0.attention.wq.weight"], 4).bfloat16())
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], to_halves(sd["layers.0.attention.wk.weight"], 2).bfloat16())
    assert torch.equal(out["model.layers.0.self_attn.v_proj.weight"], sd["layers.0.attention.wv.weight"].bfloat16())
    assert torch.equal(out["lm_head.weight"], sd["output.weight"].bfloat16())
    config = json.loads((root / "rel" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"  # the dtype written
    assert config["tie_word_embeddings"] is False and "tie_word_embeddings set to false" in res.err  # lm_head differs
    assert (root / "rel" / "tokenizer.json").read_text() == "{}"


def test_tied_head_not_written_sets_tie_true(ckpt, titan_like):
    sd, root = titan_like
    (root / "cfg" / "config.json").write_text(
        json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False})
    )
    res = ckpt(
        "convert", root / "titan.safetensors", root / "rel", "--to", "hf", "--preset", "torchtitan-llama3",
        "--hf-config", root / "cfg", "--filter", "model.*",
    )  # fmt: skip
    assert res.code == 0, res.err
    assert json.loads((root / "rel" / "config.json").read_text())["tie_word_embeddings"] is True
    assert "tie_word_embeddings set to true" in res.err


def test_preset_refusals(ckpt, titan_like):
    _, root = titan_like
    res = ckpt("convert", root / "titan.safetensors", root / "a", "--to", "hf", "--preset", "nope")
    assert res.code == 2 and "torchtitan-llama3" in res.err
    res = ckpt("convert", root / "titan.safetensors", root / "b", "--to", "hf", "--preset", "torchtitan-llama3", "--hf-config", root)
    assert res.code == 2 and "config.json" in res.err
    (root / "map.yaml").write_text("rename: []\n")
    res = ckpt(
        "convert", root / "titan.safetensors", root / "c", "--to", "hf", "--preset", "torchtitan-llama3", "--name-map", root / "map.yaml"
    )
    assert res.code == 2 and "not both" in res.err
    (root / "map.yaml").write_text("permute: [{from: 'x', rope: diagonal, heads: 2}]\n")
    res = ckpt("convert", root / "titan.safetensors", root / "d", "--to", "hf", "--name-map", root / "map.yaml")
    assert res.code == 2 and "rope is interleaved or halves" in res.err
    assert not any((root / n).exists() for n in "abcd")


def test_parity_refusals(ckpt, tmp_path):
    res = ckpt("parity", tmp_path)
    assert res.code == 2 and "--against DIR" in res.err
    res = ckpt("parity", tmp_path, "--against", tmp_path)
    assert res.code == 2 and "no config.json" in res.err
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    res = ckpt("parity", tmp_path, "--against", tmp_path)
    assert res.code == 1 and "transformers cannot load it" in res.err and "Traceback" not in res.err


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE saved by transformers' own save_pretrained (one tensor per expert on disk), and the model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("qwen3moe") / "hf"
    model.save_pretrained(folder)
    return folder, model


def test_experts_pack_equals_transformers_v5_packed_tensors_and_unpacks_bit_equal(ckpt, qwen3_moe, tmp_path):
    """Per-expert (v4 names, what save_pretrained writes) -> packed: equal to the packed tensors the v5 model holds,
    loaded by transformers with the same logits; packed -> per-expert: the original files bit for bit."""
    folder, model = qwen3_moe
    res = ckpt("convert", folder, tmp_path / "packed", "--to", "hf", "--preset", "hf-experts-pack")
    assert res.code == 0 and "24 stacked into 4" in res.err, res.err
    packed = load_file(tmp_path / "packed" / "model-00001-of-00001.safetensors")
    state = model.state_dict()
    experts = [k for k in state if ".experts." in k]
    assert len(experts) == 4 and all(torch.equal(packed[k], state[k]) for k in experts)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed").eval()
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    res = ckpt("convert", tmp_path / "packed", tmp_path / "unpacked", "--to", "hf", "--preset", "hf-experts-unpack")
    assert res.code == 0, res.err
    assert ckpt("diff", folder, tmp_path / "unpacked").code == 0  # bit-exact, every tensor by name


def test_unpacked_experts_load_in_transformers_v4(ckpt, qwen3_moe, tmp_path):
    """packed (v5) -> per-expert: transformers v4, which reads only per-expert keys, loads the release with no missing or
    unexpected key and computes the v5 model's logits."""
    folder, model = qwen3_moe
    assert ckpt("convert", folder, tmp_path / "packed", "--to", "hf", "--preset", "hf-experts-pack").code == 0
    assert ckpt("convert", tmp_path / "packed", tmp_path / "unpacked", "--to", "hf", "--preset", "hf-experts-unpack").code == 0
    ids = list(range(1, 17))
    got = v4_logits(tmp_path / "unpacked", ids)
    assert got["version"].startswith("4.") and not got["missing"] and not got["unexpected"], got
    with torch.no_grad():
        assert torch.allclose(got["logits"], model(torch.tensor([ids])).logits, atol=1e-5, rtol=0)


def test_experts_pack_refuses_a_missing_expert(ckpt, qwen3_moe, tmp_path):
    folder, _ = qwen3_moe
    res = ckpt("convert", folder, tmp_path / "p", "--to", "hf", "--preset", "hf-experts-pack", "--filter", "*")
    assert res.code == 0
    dropped = tmp_path / "dropped.safetensors"
    full = load_file(next(folder.glob("*.safetensors")))
    save_file({k: v for k, v in full.items() if ".experts.2.up_proj" not in k}, dropped)
    res = ckpt("convert", dropped, tmp_path / "q", "--to", "hf", "--preset", "hf-experts-pack")
    assert res.code == 2 and "index 2 part 'up'" in res.err and not (tmp_path / "q").exists()


def test_transpose_of_gpt2_conv1d_weights(ckpt, tmp_path):
    """GPT-2 keeps Linear weights as Conv1D [in, out]: a name map's transpose writes them [out, in] (from a real
    transformers save, and from a DCP save whose pieces are row chunks), bit-equal to .t()."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=16))
    model.save_pretrained(tmp_path / "gpt2")
    (tmp_path / "map.yaml").write_text(r"transpose: ['.*\.(c_attn|c_proj|c_fc)\.weight']" + "\n")
    res = ckpt("convert", tmp_path / "gpt2", tmp_path / "out.safetensors", "--to", "safetensors", "--name-map", tmp_path / "map.yaml")
    assert res.code == 0 and "4 transposed" in res.err, res.err
    out, state = load_file(tmp_path / "out.safetensors"), model.state_dict()
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"):
        assert torch.equal(out[name], state[name].t()), name
    assert torch.equal(out["transformer.wte.weight"], state["transformer.wte.weight"])
    w = torch.randn(6, 4)
    src = entry_of(tmp_path, "w", w)
    assert torch.equal(read_all(rope.transposed(src, "t")), w.t())


@pytest.mark.parametrize(
    "names,preset",
    [
        (["tok_embeddings.weight", "layers.0.attention.wq.weight", "output.weight"], "torchtitan-llama3"),
        (["layers.0.attention.qkv_linear.wq.weight", "layers.0.attention.q_norm.weight"], "torchtitan-qwen3"),
        (["layers.0.attention.wkv_a.weight", "layers.0.attention.q_norm.weight", "layers.1.moe.expert_bias_E"], "torchtitan-deepseek-v3"),
        (["decoder.layers.self_attention.linear_qkv.weight"], "megatron-gpt"),
        (["decoder.layers.3.self_attention.linear_qkv.weight"], "megatron-gpt"),
        (["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"], "hf-experts-unpack"),
        (["model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight"], None),  # a release: no hint
    ],
)
def test_each_layout_suggests_exactly_its_preset(names, preset):
    from ckpt_cli.core.model import Checkpoint

    tensors = {n: TensorEntry(n, by_name("float32"), (2, 2), "model", []) for n in names}
    assert presets.suggest(Checkpoint("safetensors", "x", tensors)) == preset


def test_reshape_of_stored_tensors(ckpt, tmp_path):
    """A name map's reshape views a tensor in another shape of the same elements (a JAX attention kernel
    [embed, heads, head_dim] as [embed, heads * head_dim]); with a transpose after it, the torch Linear's [out, in].
    From a real safetensors file: bit-equal to torch's reshape; a shape its elements do not fill is refused (exit 2)."""
    torch.manual_seed(0)
    q, k = torch.randn(8, 4, 6), torch.randn(8, 2, 6)
    save_file({"attn.q.kernel": q, "attn.k.kernel": k, "norm": torch.randn(8)}, tmp_path / "src.safetensors")
    (tmp_path / "map.yaml").write_text(
        "reshape:\n  - {from: 'attn\\.q\\.kernel', shape: [0, -1]}\n  - {from: 'attn\\.k\\.kernel', shape: [4, 2, 12]}\n"
        "transpose: ['attn\\.q\\.kernel']\n"
    )
    src = tmp_path / "src.safetensors"
    res = ckpt("convert", src, tmp_path / "out.safetensors", "--to", "safetensors", "--name-map", tmp_path / "map.yaml")
    assert res.code == 0 and "2 reshaped" in res.err and "1 transposed" in res.err, res.err
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["attn.q.kernel"], q.reshape(8, 24).t()) and torch.equal(out["attn.k.kernel"], k.reshape(4, 2, 12))
    (tmp_path / "bad.yaml").write_text("reshape:\n  - {from: 'norm', shape: [3, -1]}\n")
    res = ckpt("convert", src, tmp_path / "bad.safetensors", "--to", "safetensors", "--name-map", tmp_path / "bad.yaml")
    assert res.code == 2 and "'norm' [8]: 8 elements are not [3, -1]" in res.err and not (tmp_path / "bad.safetensors").exists(), res.err
    (tmp_path / "bad.yaml").write_text("reshape:\n  - {from: 'norm', shape: [-1, -1]}\n")
    res = ckpt("convert", src, tmp_path / "bad.safetensors", "--to", "safetensors", "--name-map", tmp_path / "bad.yaml")
    assert res.code == 2 and "each reshape is" in res.err, res.err


class Boxes:
    """A stand-in for formats/orbax/arrays.OrbaxArray over a tensor `w`: flat windows and N-d boxes."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def windows(self):
        yield 0, self.w.numel()

    def read(self, start, count, sources):
        return self.w.reshape(-1)[start : start + count].clone()

    def read_box(self, offsets, sizes):
        return self.w[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].contiguous().reshape(-1)


def test_reshaped_boxes_of_a_computed_tensor():
    """A computed tensor with boxes (an Orbax array) reshaped [A, H, D] -> [A, H * D] reads boxes of its columns
    through the source's boxes (what a transpose after the reshape asks), also across heads and from row ranges."""
    from ckpt_cli.core.names.reshape import reshaped

    w = torch.arange(5 * 3 * 4, dtype=torch.float32).reshape(5, 3, 4)
    entry = TensorEntry("w", by_name("float32"), (5, 3, 4), "model", [], derived=Boxes(w))
    flat = reshaped(entry, (5, 12))
    for offsets, sizes in [((0, 0), (5, 12)), ((0, 3), (5, 6)), ((1, 5), (3, 2)), ((2, 11), (1, 1))]:
        want = w.reshape(5, 12)[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]].reshape(-1)
        assert torch.equal(flat.derived.read_box(offsets, sizes), want), (offsets, sizes)
    assert torch.equal(read_all(rope.transposed(flat, "t")), w.reshape(5, 12).t())
    merged = reshaped(entry, (15, 4))  # rows of two merged axes
    assert torch.equal(merged.derived.read_box((0, 1), (15, 2)), w.reshape(15, 4)[:, 1:3].reshape(-1))
    assert torch.equal(merged.derived.read_box((4, 0), (3, 3)), w.reshape(15, 4)[4:7, :3].reshape(-1))


def test_unstack_and_scale_of_stored_tensors(ckpt, tmp_path):
    """A name map's unstack (one tensor per index of an axis: a scanned JAX model's layers on axis 1) and scale (times
    a constant in float32, cast back), from a real safetensors file: bit-equal to numpy's slicing and torch's product,
    with a reshape, transpose and permute after the unstack; bad rules are exit 2, naming the rule, with no output."""
    torch.manual_seed(0)
    q = torch.randn(8, 3, 2, 6).to(torch.bfloat16)  # [embed, layers, heads, head_dim]
    norm = torch.randn(8, 3)
    save_file({"layers.q.kernel": q, "layers.norm": norm}, tmp_path / "src.safetensors")
    (tmp_path / "map.yaml").write_text(
        "unstack:\n  - {from: 'layers\\.(.+)', axis: 1, to: 'layers_{layer}.\\1'}\n"
        "reshape:\n  - {from: 'layers_\\d+\\.q\\.kernel', shape: [0, -1]}\n"
        "transpose: ['layers_\\d+\\.q\\.kernel']\n"
        "permute:\n  - {from: 'layers_\\d+\\.q\\.kernel', rope: halves, heads: 2}\n"
        "scale:\n  - {from: 'layers_\\d+\\.q\\.kernel', by: 2.5}\n"
    )
    src = tmp_path / "src.safetensors"
    res = ckpt("convert", src, tmp_path / "out.safetensors", "--to", "safetensors", "--name-map", tmp_path / "map.yaml")
    assert res.code == 0 and "2 unstacked into 6" in res.err and "3 scaled" in res.err, res.err
    out = load_file(tmp_path / "out.safetensors")
    assert sorted(out) == [f"layers_{i}.{n}" for i in range(3) for n in ("norm", "q.kernel")]
    for i in range(3):
        assert torch.equal(out[f"layers_{i}.norm"], norm[:, i])
        w = q[:, i].reshape(8, 12).t()
        w = w.reshape(2, 3, 2, 8).transpose(1, 2).reshape(12, 8)  # interleaved -> halves per head
        want = (w.to(torch.float32) * torch.tensor(2.5)).to(torch.bfloat16)
        assert torch.equal(out[f"layers_{i}.q.kernel"].view(torch.int16), want.view(torch.int16)), i
    for rule, says in [
        ("unstack:\n  - {from: 'layers\\.norm', axis: 2, to: 'n{layer}'}\n", "has no axis 2"),
        ("unstack:\n  - {from: 'layers\\.norm', axis: 1, to: 'n'}\n", "a name holding {layer}"),
        ("scale:\n  - {from: 'layers\\.norm', by: 0}\n", "each scale is"),
        ("scale:\n  - {from: 'layers\\.norm', by: 'sqrt(head_dim)'}\n", "--hf-config"),
        ("reshape:\n  - {from: 'layers\\.norm', shape: [-1, hidden_size]}\n", "--hf-config"),
    ]:
        (tmp_path / "bad.yaml").write_text(rule)
        res = ckpt("convert", src, tmp_path / "bad.safetensors", "--to", "safetensors", "--name-map", tmp_path / "bad.yaml")
        assert res.code == 2 and says in res.err and len(res.err.strip().splitlines()) == 1, (rule, res.err)
        assert not (tmp_path / "bad.safetensors").exists()


def test_unstacked_boxes_of_a_computed_tensor():
    """Index i of axis k of a computed tensor with boxes (an Orbax array) reads the source's box with that axis fixed,
    for flat windows and for boxes (what a reshape and a transpose after it ask)."""
    from ckpt_cli.core.names.unstack import Unstack

    w = torch.arange(5 * 3 * 2 * 4, dtype=torch.float32).reshape(5, 3, 2, 4)
    entry = TensorEntry("stack", by_name("float32"), (5, 3, 2, 4), "model", [], derived=Boxes(w))
    layers = Unstack("stack", 1, "layer_{layer}").apply(entry, "stack")
    assert [e.name for e in layers] == ["layer_0", "layer_1", "layer_2"]
    for i, layer in enumerate(layers):
        assert layer.shape == (5, 2, 4) and torch.equal(read_all(layer), w[:, i])
        assert torch.equal(layer.derived.read(7, 13, None), w[:, i].reshape(-1)[7:20])
        assert torch.equal(layer.derived.read_box((1, 1, 2), (3, 1, 2)), w[1:4, i, 1:2, 2:4].reshape(-1))
        flat = rope.transposed(reshaped_to(layer, (5, 8)), "t")
        assert torch.equal(read_all(flat), w[:, i].reshape(5, 8).t())


def reshaped_to(entry, shape):
    from ckpt_cli.core.names.reshape import reshaped

    return reshaped(entry, shape)
