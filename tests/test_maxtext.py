"""MaxText's Llama layout to Hugging Face's (`--preset maxtext-llama`), as MaxText's own to_huggingface does it.

The source is a small Llama in MaxText's layout saved as MaxText saves its train state (tests/producers/maxtext_llama.py:
item `items`, `params.params.decoder...`, scanned on axis 1 or one `layers_N` per layer). The proof: transformers'
LlamaForCausalLM on ckpt's release gives the logits the MaxText-layout forward gave in JAX, and every tensor is bit for
bit what MaxText's LLAMA31 hooks (checkpoint_conversion/utils/param_mapping.py, saving_to_hf=True) make of the array,
for float32 and bfloat16 kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorstore")
ml_dtypes = pytest.importorskip("ml_dtypes")

HOOKED = ("self_attention.query", "self_attention.key", "self_attention.value", "self_attention.out", "mlp.wi_0", "mlp.wi_1", "mlp.wo")
HF_NAMES = {
    "self_attention.query.kernel": "self_attn.q_proj.weight",
    "self_attention.key.kernel": "self_attn.k_proj.weight",
    "self_attention.value.kernel": "self_attn.v_proj.weight",
    "self_attention.out.kernel": "self_attn.o_proj.weight",
    "mlp.wi_0.kernel": "mlp.gate_proj.weight",
    "mlp.wi_1.kernel": "mlp.up_proj.weight",
    "mlp.wo.kernel": "mlp.down_proj.weight",
    "pre_self_attention_layer_norm.scale": "input_layernorm.weight",
    "post_self_attention_layer_norm.scale": "post_attention_layernorm.weight",
}


def arrays(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in folder.glob("*.npy"):
        value = np.load(f)
        out[f.stem] = value.view(ml_dtypes.bfloat16) if value.dtype == np.uint16 else value
    return out


def maxtext_to_hf(params: dict[str, np.ndarray], config: dict, scanned: bool) -> dict[str, np.ndarray]:
    """MaxText's LLAMA31 mapping and hooks (saving_to_hf=True), in numpy, as its source writes them."""
    head_dim, layers = config["head_dim"], config["num_hidden_layers"]

    def scale_query_layer(x: np.ndarray, target: tuple) -> np.ndarray:
        return (x.astype(np.float32) * np.dtype("float32").type(np.sqrt(head_dim))).astype(x.dtype)

    def adjust_rope(x: np.ndarray, target: tuple) -> np.ndarray:
        return np.concatenate((x[..., ::2], x[..., 1::2]), axis=x.ndim - 1)

    def reshape_kernel(x: np.ndarray, target: tuple) -> np.ndarray:
        return x.reshape(np.flip(np.array(target))).transpose()

    chains = {"self_attention.query": [scale_query_layer, adjust_rope, reshape_kernel], "self_attention.key": [adjust_rope, reshape_kernel]}
    out = {
        "model.embed_tokens.weight": params["params.token_embedder.embedding"],
        "model.norm.weight": params["params.decoder.decoder_norm.scale"],
    }
    kernel = params["params.decoder.logits_dense.kernel"]
    out["lm_head.weight"] = reshape_kernel(kernel, kernel.shape[::-1])
    for i in range(layers):
        for mt, hf in HF_NAMES.items():
            x = params[f"params.decoder.layers.{mt}"][:, i] if scanned else params[f"params.decoder.layers_{i}.{mt}"]
            module = mt.rsplit(".", 1)[0]
            if module in HOOKED:
                rows, cols = x.shape[0], int(np.prod(x.shape[1:]))  # the HF weight [out, in] of an [in, ...] kernel
                target = (x.shape[-1], int(np.prod(x.shape[:-1]))) if module == "self_attention.out" else (cols, rows)
                for hook in chains.get(module, [reshape_kernel]):
                    x = hook(x, target)
            out[f"model.layers.{i}.{hf}"] = x
    return out


def hf_release(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(path / shard))
    return out


@pytest.mark.parametrize("layout", ["scanned", "unscanned"])
def test_maxtext_llama_to_hf_is_maxtexts_own_export(maxtext_saves, ckpt, tmp_path, layout):
    """Every tensor bit for bit what MaxText's hooks make (float32 scanned on axis 1, bfloat16 per layer)."""
    out = tmp_path / "hf"
    res = ckpt(
        "convert", maxtext_saves / layout, out, "--to", "hf", "--preset", "maxtext-llama", "--hf-config", maxtext_saves / "hf-config"
    )
    assert res.code == 0, res.err
    if layout == "scanned":
        assert "9 unstacked into 27" in res.err and "3 scaled" in res.err and "6 permuted" in res.err, res.err
    config = json.loads((maxtext_saves / "hf-config" / "config.json").read_text())
    want = maxtext_to_hf(arrays(maxtext_saves / f"{layout}_arrays"), config, layout == "scanned")
    got = hf_release(out)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert np.array_equal(got[name].view(np.uint8), np.ascontiguousarray(value).view(np.uint8)), name


def test_maxtext_llama_release_gives_maxtexts_logits(maxtext_saves, ckpt, tmp_path):
    """transformers on ckpt's release computes what the MaxText-layout model computed in JAX (float32)."""
    import torch
    import transformers

    out = tmp_path / "hf"
    res = ckpt(
        "convert", maxtext_saves / "scanned", out, "--to", "hf", "--preset", "maxtext-llama", "--hf-config", maxtext_saves / "hf-config"
    )
    assert res.code == 0, res.err
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = torch.from_numpy(np.load(maxtext_saves / "tokens.npy")).long()[None]
    with torch.no_grad():
        logits = model(tokens).logits[0].numpy()
    want = np.load(maxtext_saves / "logits.npy")
    assert np.abs(logits - want).max() < 2e-5 * max(1.0, np.abs(want).max())
    # the same release without the query's scale is another model: the check is not blind to it
    weights = {k: torch.from_numpy(v.copy()) for k, v in hf_release(out).items()}
    weights["model.layers.0.self_attn.q_proj.weight"] /= np.sqrt(12)
    model.load_state_dict(weights)
    with torch.no_grad():
        assert np.abs(model(tokens).logits[0].numpy() - want).max() > 1e-3


def test_an_export_without_the_preset_suggests_it(maxtext_saves, ckpt, tmp_path):
    res = ckpt("convert", maxtext_saves / "unscanned", tmp_path / "hf", "--to", "hf")
    assert "maxtext-llama" in res.err, res.err


def test_the_preset_needs_the_models_config(maxtext_saves, ckpt, tmp_path):
    res = ckpt("convert", maxtext_saves / "scanned", tmp_path / "hf", "--to", "hf", "--preset", "maxtext-llama")
    assert res.code == 2 and "--hf-config" in res.err and len(res.err.strip().splitlines()) == 1, res.err
    assert not (tmp_path / "hf").exists()
