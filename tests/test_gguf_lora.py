"""A PEFT LoRA adapter written as a GGUF LoRA (`--to gguf` of an adapter folder, `--hf-config BASE`), against llama.cpp's
own convert_lora_to_gguf.py and llama.cpp running both files over the converter's base model.

Producer: peft's get_peft_model + save_pretrained over the tiny Llama release of test_gguf_write (a SentencePiece
tokenizer trained on the spot), every projection targeted, one module at a rank of its own, B set at random.
"""

from __future__ import annotations

from pathlib import Path

import gguf_reference as ref
import numpy as np
import pytest
import torch
from test_gguf_write import release

pytest.importorskip("sentencepiece")
pytest.importorskip("gguf")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# model-card keys the converter guesses from the adapter folder's README.md (gguf-py metadata heuristics)
CARD_KEYS = ("general.name", "general.base_model.", "general.tags")
TOKENS = [1, 17, 200, 45, 3, 99, 150, 7]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return release(tmp_path_factory, "llama")


def _adapter(base: Path, folder: Path, **extra: object) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, rank_pattern={"layers.1.self_attn.q_proj": 2}, **extra)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base), config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> Path:
    return _adapter(base, tmp_path_factory.mktemp("lora") / "adapter")


def _fields(path: Path) -> tuple[dict[str, object], dict[str, tuple[str, list[int], bytes]]]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    kvs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("GGUF.", *CARD_KEYS))}
    tensors = {t.name: (t.tensor_type.name, [int(n) for n in t.shape], np.asarray(t.data).tobytes()) for t in reader.tensors}
    return kvs, tensors


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_a_lora_equals_convert_lora_to_gguf(ckpt, base, adapter, tmp_path, outtype):
    """Every tensor (names in order, types: B's rows of 4 falling back to F16 under q8_0, shapes, bytes, attn_q/attn_k's
    B rows permuted) and every key but the model card's; llama.cpp's logits over the converter's base with each file
    applied are equal, and differ from the base's own."""
    options = ["--quantize", "q8_0"] if outtype == "q8_0" else []
    res = ckpt("convert", adapter, tmp_path / "ckpt.gguf", "--to", "gguf", "--hf-config", base, *options, "--quiet")
    assert res.code == 0, res.err
    theirs = ref.convert_lora(adapter, base, tmp_path / "ref.gguf", outtype)
    mine_kvs, mine_tensors = _fields(tmp_path / "ckpt.gguf")
    ref_kvs, ref_tensors = _fields(theirs)
    assert mine_kvs == ref_kvs and mine_kvs["adapter.lora.alpha"] == 8.0
    assert list(mine_tensors) == list(ref_tensors) and mine_tensors == ref_tensors
    assert "blk.1.attn_q.weight.lora_a" in mine_tensors and len(mine_tensors) == 2 * 7 * 2
    pytest.importorskip("llama_cpp")
    model = ref.convert(base, tmp_path / "base.gguf", "f32")
    with_ours = ref.logits(model, TOKENS, lora=tmp_path / "ckpt.gguf")
    assert np.array_equal(with_ours, ref.logits(model, TOKENS, lora=theirs))
    assert not np.allclose(with_ours, ref.logits(model, TOKENS), atol=1e-3)


def test_what_llama_cpp_cannot_apply_is_refused(ckpt, base, tmp_path):
    """rsLoRA's alpha / sqrt(r) and DoRA's magnitudes (the converter writes them and llama.cpp applies them wrongly),
    and an adapter without its base's config: one line, exit 2, nothing written."""
    for extra, needle in (({"use_rslora": True}, "rsLoRA"), ({"use_dora": True}, "DoRA")):
        folder = _adapter(base, tmp_path / needle, **extra)
        res = ckpt("convert", folder, tmp_path / f"{needle}.gguf", "--to", "gguf", "--hf-config", base)
        assert res.code == 2 and needle in res.err and "alpha / r" in res.err and "Traceback" not in res.err, res.err
        assert not (tmp_path / f"{needle}.gguf").exists()
    res = ckpt("convert", tmp_path / "DoRA", tmp_path / "x.gguf", "--to", "gguf")
    assert res.code == 2 and "--hf-config" in res.err and not (tmp_path / "x.gguf").exists()
