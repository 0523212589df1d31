"""GGUF files from the real producers: a tiny random Llama saved by transformers with a SentencePiece tokenizer trained
on the spot, converted by llama.cpp's own `convert_hf_to_gguf.py` (from the llama.cpp sources the llama-cpp-python
sdist vendors), and quantized by llama.cpp's own quantizer (`llama_model_quantize` through llama-cpp-python).

Run as a script: `gguf_llama.py OUT [--split]` writes OUT/hf (the model), OUT/f32.gguf, f16, bf16, q8_0, a Llama
with attention biases and tied embeddings (OUT/hf-bias, OUT/bias-f32.gguf), a Qwen2 and a Qwen3 (OUT/hf-qwen2,
OUT/qwen2-f32.gguf, qwen2-q8_0; OUT/qwen3-f32.gguf) and, when llama_cpp imports, the K-quants; with --split,
OUT/split/ holds the f32 file split by --split-max-size. The converter comes from the llama-cpp-python sdist,
downloaded once with pip into ~/.cache/ckpt-tests and extracted there (tests/gguf_reference.py `converter_dir`, the
one copy the GGUF tests share).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the converter's fetch, shared with the tests
from gguf_reference import converter_dir  # noqa: E402

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers (include/llama.h): what llama_model_quantize makes from the f32 file
QUANTS = {"q4_k_m": 15, "q2_k": 10, "q3_k_m": 12, "q5_k_m": 17, "q6_k": 18, "iq4_nl": 25, "iq4_xs": 30}
WORDS = "the a model weights tensor block scale file read write quant llama layer head row column".split()


def config() -> object:
    from transformers import LlamaConfig

    # rows of 256 (hidden 256, intermediate 512): K-quants take blocks of 256, so every matrix can be K-quantized
    return LlamaConfig(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )


def train_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.model: a SentencePiece model trained here on generated text (llama's special ids 0, 1, 2)."""
    import sentencepiece as spm

    rng = random.Random(0)
    text = folder / "corpus.txt"
    syllables = [a + b for a in "bcdfgklmnprstvz" for b in "aeiou"]
    words = WORDS + ["".join(rng.choice(syllables) for _ in range(rng.randrange(1, 4))) for _ in range(400)]
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000)))
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=False,
        minloglevel=2,
    )
    text.unlink()
    (folder / "tokenizer.vocab").unlink()


def save_model(folder: Path, bias: bool = False) -> None:
    """The tiny Llama; with `bias`, a smaller one with attention biases (llama.cpp permutes q/k biases too) and tied
    embeddings (the converter writes no output.weight)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = config()
    if bias:
        cfg.attention_bias, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = True, 64, 128, 16
        cfg.tie_word_embeddings = True
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1: a wrong map between norms would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_()
    model.save_pretrained(folder)
    train_tokenizer(folder, model.config.vocab_size)


def save_qwen(folder: Path, arch: str) -> None:
    """A tiny Qwen2 (q/k/v biases) or Qwen3 (q/k norms, head_dim 16: not the config's default 128) with the same
    tokenizer (the converter reads a tokenizer.model with SentencePiece before it looks for tokenizer.json)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    make, model_class = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = make(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_()
    model.save_pretrained(folder)
    train_tokenizer(folder, cfg.vocab_size)


def convert(llama_cpp: Path, model: Path, out: Path, outtype: str, *extra: str) -> None:
    cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out), "--outtype", outtype, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def quantize(src: Path, dst: Path, ftype: int) -> None:
    """llama.cpp's quantizer, as llama-quantize runs it."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to ftype {ftype} failed ({rc})")


def main() -> None:
    llama_cpp, out = converter_dir(), Path(sys.argv[1])
    model = out / "hf"
    save_model(model)
    for outtype in OUTTYPES:
        convert(llama_cpp, model, out / f"{outtype}.gguf", outtype)
    save_model(out / "hf-bias", bias=True)
    convert(llama_cpp, out / "hf-bias", out / "bias-f32.gguf", "f32")
    for arch in ("qwen2", "qwen3"):
        save_qwen(out / f"hf-{arch}", arch)
        for outtype in ("f32", "q8_0") if arch == "qwen2" else ("f32",):
            convert(llama_cpp, out / f"hf-{arch}", out / f"{arch}-{outtype}.gguf", outtype)
    if "--split" in sys.argv:
        (out / "split").mkdir()
        convert(llama_cpp, model, out / "split" / "model.gguf", "f32", "--split-max-size", "2M")
    try:
        import llama_cpp as _  # noqa: F401
    except ImportError:
        return
    for name, ftype in QUANTS.items():
        quantize(out / "f32.gguf", out / f"{name}.gguf", ftype)


if __name__ == "__main__":
    main()
