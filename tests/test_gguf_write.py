"""`--to gguf`: ckpt's GGUF byte-equal to llama.cpp's converter (convert_hf_to_gguf.py from the sources llama-cpp-python
vendors), llama.cpp's logits from ckpt's file, the block quantizers bit-equal to gguf-py's, bad input refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf_reference as ref
import numpy as np
import pytest
from conftest import PRODUCERS, built_once

OUTTYPES = {"f32": ["--dtype", "fp32"], "bf16": ["--dtype", "bf16"], "f16": ["--dtype", "fp16"], "q8_0": ["--quantize", "q8_0"]}


def release(tmp_path_factory, arch: str) -> Path:
    """A tiny Hugging Face release of `arch` (tests/producers/gguf_models.py), in a folder named after it."""

    def build(root: Path) -> None:
        proc = subprocess.run(
            [sys.executable, str(PRODUCERS / "gguf_models.py"), arch, str(root / arch)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once(tmp_path_factory, f"gguf-{arch}", build) / arch


@pytest.fixture(scope="session")
def llama_release(tmp_path_factory) -> Path:
    pytest.importorskip("sentencepiece")
    return release(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def bpe_converter(tmp_path_factory) -> tuple[Path, str]:
    """The tiny Qwen BPE tokenizer's pre-tokenizer registered as `qwen2`, the one way in both tools: its check hash (the
    sha256 of its ids for the converter's fixed text, computed by ckpt with the tokenizers library) patched into a copy
    of the converter's get_vocab_base_pre, as convert_hf_to_gguf_update.py adds a released model, and given to ckpt's
    `bpe.register`. The converter hashes through transformers: a hash that differed would make it refuse the tokenizer."""
    from tokenizers import Tokenizer

    from ckpt_cli.formats.gguf import bpe

    src = release(tmp_path_factory, "qwen2")
    found = bpe.check_hash(Tokenizer.from_file(str(src / "tokenizer.json")))
    assert found not in bpe.PRE_BY_HASH
    folder = tmp_path_factory.mktemp("converter") / "llama.cpp"
    shutil.copytree(ref.converter_dir(), folder)
    base = folder / "conversion" / "base.py"
    marker = '        if res is None:\n            logger.warning("\\n")'
    text = base.read_text()
    assert text.count(marker) == 1
    base.write_text(text.replace(marker, f'        if chkhsh == "{found}":\n            res = "qwen2"\n' + marker))
    return folder, found


@pytest.fixture
def registered(bpe_converter, monkeypatch) -> Path:
    from ckpt_cli.formats.gguf import bpe

    folder, found = bpe_converter
    monkeypatch.setitem(bpe.REGISTERED, found, "qwen2")
    return folder


def ckpt_gguf(ckpt, src: Path, out: Path, *options: str) -> Path:
    result = ckpt("convert", src, out, "--to", "gguf", *options, "--quiet")
    assert result.code == 0, result.err
    return out


@pytest.mark.slow
@pytest.mark.parametrize("outtype", list(OUTTYPES))
def test_llama_equals_the_converter(ckpt, llama_release, tmp_path, outtype):
    """Every byte: header, key-values (architecture, tokenizer, special tokens, chat template), tensor infos and
    types (norms F32, ffn_down's rows of 80 falling back to F16 under q8_0), q/k permuted, data and padding."""
    mine = ckpt_gguf(ckpt, llama_release, tmp_path / "ckpt.gguf", *OUTTYPES[outtype])
    theirs = ref.convert(llama_release, tmp_path / "ref.gguf", outtype)
    assert mine.read_bytes() == theirs.read_bytes()


@pytest.mark.slow
def test_llama_logits_in_llama_cpp(ckpt, llama_release, tmp_path):
    """llama.cpp runs ckpt's file: its logits equal those of the converter's file, and (f32) transformers' own."""
    pytest.importorskip("llama_cpp")
    import torch
    from transformers import LlamaForCausalLM

    tokens = [1, 17, 200, 45, 3, 99, 150, 7]
    for outtype in ("f32", "q8_0"):
        mine = ckpt_gguf(ckpt, llama_release, tmp_path / f"ckpt-{outtype}.gguf", *OUTTYPES[outtype])
        theirs = ref.convert(llama_release, tmp_path / f"ref-{outtype}.gguf", outtype)
        got = ref.logits(mine, tokens)
        assert np.array_equal(got, ref.logits(theirs, tokens)), outtype
        if outtype == "f32":
            model = LlamaForCausalLM.from_pretrained(llama_release, torch_dtype=torch.float32)
            with torch.no_grad():
                expected = model(torch.tensor([tokens])).logits[0].numpy()
            np.testing.assert_allclose(got, expected, atol=2e-5)


ARCHS = {
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "outtype"), [(arch, "f32") for arch in ARCHS] + [("qwen2_moe", "q8_0")])  # q8_0: see llama's
def test_architectures_equal_the_converter(ckpt, tmp_path_factory, registered, tmp_path, arch, outtype):
    """Mistral and Mixtral (SentencePiece, q/k permuted, Mixtral's experts stacked w1, w2, w3), Qwen2 (q/k/v biases),
    Qwen3 (q/k norms, tied embeddings) and Qwen2-MoE (experts stacked down, gate, up; a gated shared expert, routers
    F32) with a BPE tokenizer.json: every byte as the converter writes it; at f32 llama.cpp's logits from ckpt's file
    follow transformers' own."""
    pytest.importorskip("sentencepiece")
    src = release(tmp_path_factory, arch)
    mine = ckpt_gguf(ckpt, src, tmp_path / "ckpt.gguf", *OUTTYPES[outtype])
    theirs = ref.convert(src, tmp_path / "ref.gguf", outtype, converter=registered)
    assert mine.read_bytes() == theirs.read_bytes()
    if outtype == "f32" and pytest.importorskip("llama_cpp"):
        import torch
        import transformers

        tokens = [5, 17, 200, 45, 3, 99, 150, 7]
        model = getattr(transformers, ARCHS[arch]).from_pretrained(src, torch_dtype=torch.float32)
        with torch.no_grad():
            expected = model(torch.tensor([tokens])).logits[0].numpy()
        np.testing.assert_allclose(ref.logits(mine, tokens), expected, atol=5e-5)


def test_unknown_bpe_pre_tokenizer_is_refused(ckpt, tmp_path_factory, tmp_path):
    """Unregistered, the tiny tokenizer's hash is unknown to llama.cpp's table: refused as the converter refuses it."""
    pytest.importorskip("tokenizers")
    result = ckpt("convert", release(tmp_path_factory, "qwen2"), tmp_path / "out.gguf", "--to", "gguf")
    assert result.code == 2 and "pre-tokenizer" in result.err and "check hash" in result.err
    assert not (tmp_path / "out.gguf").exists()


def test_the_hash_table_is_the_converters():
    """pre_hashes.py holds what the converter's get_vocab_base_pre says (its text to hash, every hash and name)."""
    import re

    from ckpt_cli.formats.gguf import pre_hashes

    source = (ref.converter_dir() / "conversion" / "base.py").read_text()
    body = source[source.index("# Marker: Start get_vocab_base_pre") : source.index("# Marker: End get_vocab_base_pre")]
    table = dict(re.findall(r'if chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#[^\n]*\n)*\s*res = "([^"]+)"', body))
    assert body.count("if chkhsh ==") == len(re.findall(r'if chkhsh == "', body)) and table == pre_hashes.PRE_BY_HASH
    assert f"chktxt = {pre_hashes.CHECK_TEXT!r}" in body or repr(pre_hashes.CHECK_TEXT)[1:-1] in body


@pytest.mark.slow
def test_split_set_equals_the_converters(ckpt, llama_release, tmp_path):
    """--max-shard-size: gguf-split's names and split.* keys, each file byte-equal to the converter's --split-max-size
    output; llama.cpp loads the set from its first file and gives the single file's logits."""
    result = ckpt(
        "convert", llama_release, tmp_path / "llama.gguf", "--to", "gguf", "--quantize", "q8_0", "--max-shard-size", "30000", "--quiet"
    )
    assert result.code == 0, result.err
    (tmp_path / "ref").mkdir()
    ref.convert(llama_release, tmp_path / "ref" / "llama.gguf", "q8_0", "--split-max-size", "30000")
    names = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert names == [f"llama-{i:05d}-of-00005.gguf" for i in range(1, 6)]
    assert sorted(p.name for p in (tmp_path / "llama.gguf").iterdir()) == names
    for name in names:
        assert (tmp_path / "llama.gguf" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    pytest.importorskip("llama_cpp")
    single = ckpt_gguf(ckpt, llama_release, tmp_path / "one.gguf", "--quantize", "q8_0")
    tokens = [1, 17, 200, 45, 3]
    assert np.array_equal(ref.logits(tmp_path / "llama.gguf" / names[0], tokens), ref.logits(single, tokens))


@pytest.mark.slow
def test_dcp_training_checkpoint_equals_the_hf_route(ckpt, fsdp2_saves, tmp_path):
    """A tiny Llama trained under FSDP2 (dcp.save at 2 ranks) straight to GGUF with --hf-config (config.json from the
    run, a tokenizer trained here): the same bytes as going through a Hugging Face folder first, which in turn is the
    converter's file."""
    sys.path.insert(0, str(PRODUCERS))
    from gguf_models import train_spm

    release = tmp_path / "run" / "tiny"
    for f in (fsdp2_saves[2] / "llama_config").iterdir():
        (release.parent).mkdir(exist_ok=True)
        release.mkdir(exist_ok=True)
        shutil.copy(f, release / f.name)
    config = json.loads((release / "config.json").read_text())  # a bare config.save_pretrained names no model class
    (release / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    train_spm(release, vocab_size=60, byte_fallback=False)  # the run's vocabulary is 64: padded as the converter pads
    src = fsdp2_saves[2] / "llama"
    hf = tmp_path / "hf" / "tiny"
    assert ckpt("convert", src, hf, "--to", "hf", "--weights-only", "--strip-prefix", "model.", "-q").code == 0
    for f in release.iterdir():
        shutil.copy(f, hf / f.name)
    for outtype in ("f32", "q8_0"):
        direct = tmp_path / f"direct-{outtype}.gguf"
        options = ("--weights-only", "--strip-prefix", "model.", "--hf-config", release, *OUTTYPES[outtype])
        ckpt_gguf(ckpt, src, direct, *options)
        via_hf = ckpt_gguf(ckpt, hf, tmp_path / f"hf-{outtype}.gguf", *OUTTYPES[outtype])
        assert direct.read_bytes() == via_hf.read_bytes(), outtype
        assert direct.read_bytes() == ref.convert(hf, tmp_path / f"ref-{outtype}.gguf", outtype).read_bytes(), outtype


@pytest.mark.parametrize("kind", ["--quantize=q8_0", "--quantize=q5_1", "--dtype=bf16"])
def test_bands_and_threads_do_not_change_a_byte(ckpt, llama_release, tmp_path, monkeypatch, kind):
    """A tensor is computed in bands of rows, several bands a window on a pool of threads: bands of one row (and of
    a row of a few bytes) give the file that whole-tensor bands give."""
    from ckpt_cli.formats.gguf import writer

    whole = ckpt_gguf(ckpt, llama_release, tmp_path / "whole.gguf", kind)
    monkeypatch.setattr(writer, "BAND_BYTES", 1)
    monkeypatch.setattr(writer, "THREADS", 3)
    assert ckpt_gguf(ckpt, llama_release, tmp_path / "rows.gguf", kind).read_bytes() == whole.read_bytes()


def test_unsupported_architecture_is_refused(ckpt, llama_release, tmp_path):
    src = tmp_path / "gpt"
    shutil.copytree(llama_release, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    result = ckpt("convert", src, tmp_path / "out.gguf", "--to", "gguf")
    assert result.code == 2
    assert "GPTNeoXForCausalLM" in result.err and len(result.err.strip().splitlines()) == 1
    assert not (tmp_path / "out.gguf").exists()


def test_missing_tokenizer_names_the_files(ckpt, llama_release, tmp_path):
    src = tmp_path / "notok"
    shutil.copytree(llama_release, src)
    (src / "tokenizer.model").unlink()
    result = ckpt("convert", src, tmp_path / "out.gguf", "--to", "gguf")
    assert result.code == 2
    assert "tokenizer.model" in result.err and "tokenizer.json" in result.err
    assert not (tmp_path / "out.gguf").exists()


def test_weights_without_a_config_ask_for_hf_config(ckpt, llama_release, tmp_path):
    """A training checkpoint (here one safetensors file) carries no config.json: the message names --hf-config."""
    shutil.copy(llama_release / "model.safetensors", tmp_path / "weights.safetensors")
    result = ckpt("convert", tmp_path / "weights.safetensors", tmp_path / "out.gguf", "--to", "gguf")
    assert result.code == 2 and "--hf-config" in result.err and "config.json" in result.err
    assert not (tmp_path / "out.gguf").exists()


def test_truncated_tokenizer_model_is_a_data_error(ckpt, llama_release, tmp_path):
    src = tmp_path / "cut"
    shutil.copytree(llama_release, src)
    data = (src / "tokenizer.model").read_bytes()
    (src / "tokenizer.model").write_bytes(data[: len(data) // 2 + 3])
    result = ckpt("convert", src, tmp_path / "out.gguf", "--to", "gguf")
    assert result.code == 1 and "tokenizer.model" in result.err and len(result.err.strip().splitlines()) == 1, result.err
    assert not (tmp_path / "out.gguf").exists()


def test_fp8_is_not_a_gguf_type(ckpt, llama_release, tmp_path):
    result = ckpt("convert", llama_release, tmp_path / "out.gguf", "--to", "gguf", "--quantize", "fp8")
    assert result.code == 2 and "q8_0" in result.err
    result = ckpt("convert", llama_release, tmp_path / "out", "--to", "hf", "--quantize", "q8_0")
    assert result.code == 2 and "gguf" in result.err


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "bf16"])
def test_quantizers_equal_gguf_py(kind):
    """Rows of every scale, zero blocks and NaN, bit-equal to gguf-py's whole-array quantizer (gguf==0.19.0)."""
    gguf = pytest.importorskip("gguf")
    from ckpt_cli.formats.gguf import quantize
    from ckpt_cli.formats.gguf.constants import TensorType

    rng = np.random.default_rng(0)
    values = (rng.standard_normal((37, 96)) * rng.uniform(0, 4, (37, 1))).astype(np.float32)
    values[3, :32] = 0
    values[5, 7] = np.nan
    values[6] = rng.standard_normal(96).astype(np.float16)  # ties for the round-to-nearest-even
    values[7, :32] = np.arange(32) - 16.5  # q8_0's halves: rounded away from zero
    values[8, :32] = np.inf * np.sign(rng.standard_normal(32))
    values[9] *= np.float32(1e30)
    values[10] *= np.float32(1e-30)
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf.quants.quantize(values, qtype)
    assert quantize.quantize(values, TensorType[kind.upper()]).tobytes() == expected.tobytes()
    assert quantize.quantize(values[10:20], TensorType[kind.upper()]).tobytes() == expected[10:20].tobytes()  # a band


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q5_0", "q5_1"])
def test_block_types_equal_gguf_py_on_the_converters_tensors(ckpt, llama_release, tmp_path, kind):
    """The converter has no --outtype for these: each tensor of ckpt's file is gguf-py's quantizer applied to the
    converter's f32 tensor (q/k permuted), with the converter's type rules (1-D and norms F32, rows of 80 that are
    not whole blocks F16); llama.cpp loads the file and its logits follow the f32 file's."""
    gguf = pytest.importorskip("gguf")
    mine = ckpt_gguf(ckpt, llama_release, tmp_path / "ckpt.gguf", "--quantize", kind)
    f32 = ref.convert(llama_release, tmp_path / "ref.gguf", "f32")
    reference = {t.name: t for t in gguf.GGUFReader(f32).tensors}
    ours = gguf.GGUFReader(mine)
    fallback = 0
    for tensor in ours.tensors:
        values = np.asarray(reference[tensor.name].data, dtype=np.float32)
        if values.ndim <= 1 or tensor.name.endswith("_norm.weight"):
            want = gguf.GGMLQuantizationType.F32
        elif values.shape[-1] % 32:
            want, fallback = gguf.GGMLQuantizationType.F16, fallback + 1
        else:
            want = gguf.GGMLQuantizationType[kind.upper()]
        assert tensor.tensor_type == want, tensor.name
        assert np.asarray(tensor.data).tobytes() == gguf.quants.quantize(values, want).tobytes(), tensor.name
    assert fallback == 2  # ffn_down of both layers
    pytest.importorskip("llama_cpp")
    tokens = [1, 17, 200, 45, 3]
    got, exact = ref.logits(mine, tokens), ref.logits(f32, tokens)
    assert np.isfinite(got).all() and np.corrcoef(got.ravel(), exact.ravel())[0, 1] > 0.95
