"""llama.cpp's own converter for the GGUF tests: convert_hf_to_gguf.py with its conversion/ package and gguf-py, taken
from the llama.cpp sources that the llama-cpp-python sdist vendors (the same release the tests run llama.cpp from),
downloaded once with pip into the user's cache (~/.cache/ckpt-tests) and extracted there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
SCRIPTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")
PARTS = (*SCRIPTS, "conversion/", "gguf-py/")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckpt-tests" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


def converter_dir() -> Path:
    """The folder holding convert_hf_to_gguf.py (fetched and extracted on first use)."""
    from filelock import FileLock

    cache = cache_dir()
    root = cache / "llama.cpp"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        if all((root / script).exists() for script in SCRIPTS):
            return root
        shutil.rmtree(root, ignore_errors=True)  # an older cache without a script the tests now run
        sdists = list(cache.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                str(cache),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, f"pip download llama-cpp-python failed: {proc.stderr[-2000:]}"
            sdists = list(cache.glob("llama_cpp_python-*.tar.gz"))
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        tmp = cache / "extract"
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(PARTS)]
            tar.extractall(tmp, members=members, filter="data")
        (tmp / prefix).rename(root)
        return root


def convert(src: Path, out: Path, outtype: str, *extra: str, converter: Path | None = None) -> Path:
    """The converter's GGUF of a Hugging Face folder, named as ckpt names it (general.name: the folder's name)."""
    script = (converter or converter_dir()) / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(src), "--outtype", outtype, "--outfile", str(out), "--model-name", src.name, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"convert_hf_to_gguf.py failed:\n{proc.stderr[-4000:]}"
    return out


def convert_lora(adapter: Path, base: Path, out: Path, outtype: str) -> Path:
    """convert_lora_to_gguf.py's GGUF LoRA of a PEFT adapter folder, for the base model's folder."""
    script = converter_dir() / "convert_lora_to_gguf.py"
    cmd = [sys.executable, str(script), str(adapter), "--base", str(base), "--outtype", outtype, "--outfile", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"convert_lora_to_gguf.py failed:\n{proc.stderr[-4000:]}"
    return out


def logits(path: Path, tokens: list[int], lora: Path | None = None) -> object:
    """llama.cpp's logits for every position of `tokens` (llama-cpp-python on the CPU), with a GGUF LoRA applied."""
    import numpy as np
    from llama_cpp import Llama

    # an f32 KV cache (type 0), so the logits of an f32 file can be held to transformers closely
    lora_path = str(lora) if lora is not None else None
    model = Llama(model_path=str(path), lora_path=lora_path, logits_all=True, n_ctx=64, n_threads=1, verbose=False, type_k=0, type_v=0)
    model.eval(tokens)
    out = np.array(model.scores[: len(tokens)], dtype=np.float32)
    model.close()
    return out
