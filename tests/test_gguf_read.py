"""GGUF read: files made by llama.cpp's own converter (convert_hf_to_gguf.py, f32/f16/bf16/q8_0, and a split set) and
quantizer (llama_model_quantize: Q4_K_M, Q2_K, Q3_K_M, Q5_K_M, Q6_K) from a tiny random Llama saved by transformers.
inspect reports them, verify passes them, and a conversion to hf / safetensors / dcp holds exactly the state dict that
transformers' `from_pretrained(gguf_file=...)` loads, each tensor what gguf-py's `dequantize` gives. Damaged files
(tests/test_gguf_hostile.py) get one line and exit 1."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import assert_fails, built_once, producer

FILES = ("f32", "f16", "bf16", "q8_0")
KQUANTS = ("q4_k_m", "q2_k", "q3_k_m", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")
STORED_TYPES = {"f32": {"F32"}, "f16": {"F16", "F32"}, "bf16": {"BF16", "F32"}, "q8_0": {"Q8_0", "F32"}, "q4_k_m": {"Q4_K", "Q6_K", "F32"}}


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def gguf_llama(tmp_path_factory):
    """hf/ (the transformers model), the converter's files, llama.cpp's K-quants (with llama-cpp-python), split/."""
    name = "gguf-llama" + ("-kquants" if _has_llama_cpp() else "")
    return built_once(tmp_path_factory, name, lambda root: producer("gguf_llama.py", root, "--split"))


def gguf_file(root, kind):
    if kind in KQUANTS and not (root / f"{kind}.gguf").exists():
        pytest.skip("llama-cpp-python is not installed: llama.cpp's quantizer made no K-quant files")
    return root / f"{kind}.gguf"


def transformers_state_dict(path):
    """What transformers loads from the GGUF file (it dequantizes with gguf-py and un-permutes Llama's q/k)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_hf(folder):
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def assert_bit_equal(got, want, names=None):
    names = sorted(want) if names is None else names
    assert sorted(got) == sorted(names), set(got) ^ set(names)
    for name in names:
        a, b = got[name], want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


def test_inspect_reports_the_file(gguf_llama, ckpt):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gguf_llama / "hf")
    res = ckpt("inspect", gguf_llama / "q8_0.gguf", "--json")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    d = doc["details"]
    assert doc["format"] == "gguf" and d["architecture"] == "llama" and d["version"] == 3
    assert d["hyperparameters"]["attention.head_count"] == config.num_attention_heads
    assert d["hyperparameters"]["attention.head_count_kv"] == config.num_key_value_heads
    assert d["hyperparameters"]["embedding_length"] == config.hidden_size
    assert d["tokenizer"]["model"] == "llama" and d["tokenizer"]["vocab_size"] == config.vocab_size
    assert d["tensor_types"] == {"Q8_0": 16, "F32": 5}  # the converter keeps norms (1-d) in f32
    assert doc["num_params"] == sum(v.numel() for v in load_hf(gguf_llama / "hf").values())
    names = {t["name"] for t in doc["tensors"]}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    text = ckpt("inspect", gguf_llama / "q8_0.gguf")
    assert "tokenizer    llama, 320 tokens" in text.out and "Q8_0 x16" in text.out


@pytest.mark.parametrize("kind", FILES + KQUANTS)
def test_verify_deep(gguf_llama, ckpt, kind):
    res = ckpt("verify", gguf_file(gguf_llama, kind), "--deep")
    assert res.code == 0 and res.out.startswith("OK"), res.out + res.err
    assert "stores no checksums" in res.err


@pytest.mark.parametrize("kind", FILES + KQUANTS)
def test_to_hf_equals_transformers(gguf_llama, ckpt, tmp_path, kind):
    """The hf folder holds transformers' GGUF state dict bit for bit (float32, q/k un-permuted)."""
    path = gguf_file(gguf_llama, kind)
    res = ckpt("convert", path, tmp_path / "out", "--to", "hf")
    assert res.code == 0, res.err
    want = transformers_state_dict(path)
    assert_bit_equal(load_hf(tmp_path / "out"), want)
    if kind in STORED_TYPES:
        doc = json.loads(ckpt("inspect", path, "--json").out)
        assert set(doc["details"]["tensor_types"]) == STORED_TYPES[kind]


def test_f32_is_the_original_model(gguf_llama, ckpt, tmp_path):
    """The converter's f32 file read back is the model transformers saved: its q/k permutation undone exactly."""
    res = ckpt("convert", gguf_llama / "f32.gguf", tmp_path / "w.safetensors", "--to", "safetensors")
    assert res.code == 0, res.err
    from safetensors.torch import load_file

    assert_bit_equal(load_file(tmp_path / "w.safetensors"), load_hf(gguf_llama / "hf"))


@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_each_tensor_equals_gguf_py(gguf_llama, ckpt, tmp_path, kind):
    """Each tensor is gguf-py's `dequantize` of the stored blocks (q/k compared after ckpt's un-permutation is undone)."""
    import gguf
    from safetensors.torch import load_file

    path = gguf_file(gguf_llama, kind)
    assert ckpt("convert", path, tmp_path / "w.safetensors", "--to", "safetensors").code == 0
    got = load_file(tmp_path / "w.safetensors")
    reader = gguf.GGUFReader(path)
    heads = {"attn_q": 4, "attn_k": 2}
    for t in reader.tensors:
        want = gguf.dequantize(t.data, t.tensor_type)
        name = hf_name(t.name)
        mine = got[name].numpy()
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if part in heads:  # llama.cpp's permute (convert_hf_to_gguf LlamaModel.permute) applied back
            n = heads[part]
            mine = mine.reshape(n, 2, mine.shape[0] // n // 2, *mine.shape[1:]).swapaxes(1, 2).reshape(mine.shape)
        assert mine.shape == want.shape and np.array_equal(mine.view(np.uint32), np.ascontiguousarray(want).view(np.uint32)), t.name


def hf_name(name):
    from ckpt_cli.formats.gguf import names

    out = names.hf_name(name, "llama")
    assert out is not None, name
    return out


def test_dtype_applies(gguf_llama, ckpt, tmp_path):
    path = gguf_llama / "q8_0.gguf"
    assert ckpt("convert", path, tmp_path / "out", "--to", "hf", "--dtype", "bf16").code == 0
    want = {k: v.to(torch.bfloat16) for k, v in transformers_state_dict(path).items()}
    assert_bit_equal(load_hf(tmp_path / "out"), want)


def test_to_dcp_loads_in_torch(gguf_llama, ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp

    path = gguf_file(gguf_llama, "q4_k_m")
    assert ckpt("convert", path, tmp_path / "dcp", "--to", "dcp", "--world-size", "2").code == 0
    want = transformers_state_dict(path)
    loaded = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"))
    assert_bit_equal(loaded, want)


# ---- split sets (convert_hf_to_gguf.py --split-max-size) ----------------------------------------------------------


def split_parts(root):
    parts = sorted((root / "split").glob("model-*.gguf"))
    assert len(parts) > 2, parts
    return parts


def test_split_set_reads_as_one(gguf_llama, ckpt, tmp_path):
    parts = split_parts(gguf_llama)
    res = ckpt("verify", parts[0], "--deep")
    assert res.code == 0 and f"in {len(parts)} files" in res.out, res.out + res.err
    doc = json.loads(ckpt("inspect", parts[1], "--json").out)  # any part names the set
    assert doc["details"]["parts"] == len(parts) and len(doc["files"]) == len(parts)
    assert ckpt("convert", parts[0], tmp_path / "out", "--to", "hf").code == 0
    assert_bit_equal(load_hf(tmp_path / "out"), load_hf(gguf_llama / "hf"))


@pytest.fixture
def split_copy(gguf_llama, tmp_path):
    dest = tmp_path / "split"
    shutil.copytree(gguf_llama / "split", dest)
    return sorted(dest.glob("model-*.gguf"))


def test_split_missing_part(split_copy, ckpt, tmp_path):
    split_copy[1].unlink()
    for command in (("inspect", split_copy[0]), ("verify", split_copy[0]), ("convert", split_copy[0], tmp_path / "o", "--to", "hf")):
        res = ckpt(*command)
        assert_fails(res, split_copy[1].name, "missing")
    assert not (tmp_path / "o").exists()


def test_split_mismatched_part(split_copy, ckpt, tmp_path):
    shutil.copy(split_copy[1], split_copy[2])  # part 2's header under part 3's name
    res = ckpt("convert", split_copy[0], tmp_path / "o", "--to", "hf")
    assert_fails(res, split_copy[2].name, "split.no 1")
    assert len([line for line in res.err.splitlines() if not line.startswith("note: ")]) == 1, res.err
    assert not (tmp_path / "o").exists()


def test_hf_folder_loads_as_the_gguf_model(gguf_llama, ckpt, tmp_path):
    """The folder carries a config.json as transformers builds it from the file: from_pretrained(folder) is the model
    from_pretrained(gguf_file=...) gives, logits equal."""
    from transformers import AutoModelForCausalLM

    path = gguf_file(gguf_llama, "q4_k_m")
    assert ckpt("convert", path, tmp_path / "out", "--to", "hf").code == 0
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    mine = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert mine.config.num_key_value_heads == ref.config.num_key_value_heads and mine.config.rms_norm_eps == ref.config.rms_norm_eps
    ids = torch.tensor([[1, 17, 42, 99, 250, 3]])
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, ref(ids).logits)


def test_in_object_storage(gguf_llama, s3, ckpt, tmp_path):
    """A GGUF file and a split set in S3: read through ranged reads, the same report and the same bytes written."""
    single = s3.upload(gguf_llama / "q8_0.gguf", "gguf/q8_0.gguf")
    split = s3.upload(gguf_llama / "split", "gguf/split")
    first = split + "/" + split_parts(gguf_llama)[0].name
    for url, local in ((single, gguf_llama / "q8_0.gguf"), (first, split_parts(gguf_llama)[0])):
        res = ckpt("verify", url, "--deep")
        assert res.code == 0 and res.out.startswith("OK"), res.out + res.err
        remote_doc, local_doc = (json.loads(ckpt("inspect", p, "--json").out) for p in (url, local))
        assert remote_doc["details"] == local_doc["details"] and remote_doc["tensors"] == local_doc["tensors"]
        assert ckpt("convert", url, tmp_path / "s3.safetensors", "--to", "safetensors", "--overwrite").code == 0
        assert ckpt("convert", local, tmp_path / "here.safetensors", "--to", "safetensors", "--overwrite").code == 0
        assert (tmp_path / "s3.safetensors").read_bytes() == (tmp_path / "here.safetensors").read_bytes()


def test_ls_lists_a_split_set_once(gguf_llama, ckpt):
    res = ckpt("ls", gguf_llama / "split", "--json")
    assert res.code == 0, res.err
    rows = json.loads(res.out)
    rows = rows["checkpoints"] if isinstance(rows, dict) else rows
    assert [r["path"] for r in rows] == [split_parts(gguf_llama)[0].name] and rows[0]["complete"], rows


def test_llama_attention_biases_and_tied_embeddings(gguf_llama, ckpt, tmp_path):
    """llama.cpp's converter permutes q/k biases as it does the weights: read back, the f32 file is the saved model,
    biases included, and its config says attention_bias (transformers' GGUF loader has no such key, and drops them).
    Tied embeddings (no output.weight): no lm_head written, and the config ties it."""
    from transformers import AutoModelForCausalLM

    doc = json.loads(ckpt("inspect", gguf_llama / "bias-f32.gguf", "--json").out)
    assert "lm_head.weight" not in {t["name"] for t in doc["tensors"]}
    assert ckpt("convert", gguf_llama / "bias-f32.gguf", tmp_path / "out", "--to", "hf").code == 0
    assert_bit_equal(load_hf(tmp_path / "out"), load_hf(gguf_llama / "hf-bias"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.attention_bias and model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen(gguf_llama, ckpt, tmp_path, arch):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms): no permutation; f32 read back is the saved model, and the folder
    loads with from_pretrained with the saved model's logits. Qwen2's q8_0 is transformers' GGUF state dict bit for bit
    (its loader gives a Qwen3 of head_dim 16 the config default 128, and fails: ckpt reads attention.key_length)."""
    from transformers import AutoModelForCausalLM

    assert ckpt("convert", gguf_llama / f"{arch}-f32.gguf", tmp_path / "f32", "--to", "hf").code == 0
    assert_bit_equal(load_hf(tmp_path / "f32"), load_hf(gguf_llama / f"hf-{arch}"))
    ids = torch.tensor([[1, 17, 42, 99, 250, 3]])
    with torch.no_grad():
        mine = AutoModelForCausalLM.from_pretrained(tmp_path / "f32")(ids).logits
        saved = AutoModelForCausalLM.from_pretrained(gguf_llama / f"hf-{arch}")(ids).logits
    assert torch.equal(mine, saved)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "f32").config.head_dim == 16
    if arch == "qwen2":
        assert ckpt("convert", gguf_llama / "qwen2-q8_0.gguf", tmp_path / "q8", "--to", "hf").code == 0
        assert_bit_equal(load_hf(tmp_path / "q8"), transformers_state_dict(gguf_llama / "qwen2-q8_0.gguf"))


@pytest.mark.parametrize(
    "type_name",
    ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
    + ["IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4"],
)
def test_dequantizers_on_random_blocks(type_name):
    """Every byte pattern (inf and NaN scales included) decodes to gguf-py's float32 bits."""
    import gguf

    from ckpt_cli.formats.gguf import dequant
    from ckpt_cli.formats.gguf.constants import ALL_BLOCKS

    kind = gguf.GGMLQuantizationType[type_name]
    _, block, size = ALL_BLOCKS[int(kind)]
    raw = np.random.default_rng(int(kind)).integers(0, 256, size=(8, 4 * size if block > 1 else 64 * size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(raw, kind)
    got = dequant.dequantize(raw.reshape(-1), type_name, size).reshape(want.shape)
    assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(want).view(np.uint32))
