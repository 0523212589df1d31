"""GGUF tensor names back to Hugging Face's, as transformers' GGUF loader names them
(transformers/modeling_gguf_pytorch_utils.py: `get_gguf_hf_weights_map` reverses gguf-py's TensorNameMap over the
model's state dict), and which tensors it un-permutes (`TENSOR_PROCESSORS`: for architecture `llama` only,
LlamaTensorProcessor reverses the q/k rotary permutation that llama.cpp's converter applied, with the attention head
count for attn_q and the key-value head count for attn_k, and only when the file gives both counts).

Only architectures whose weights transformers loads unchanged besides that are mapped: gemma's norms (minus 1),
bloom's fused qkv, MoE expert stacks and the rest stay under their GGUF names (a note says so).
"""

from __future__ import annotations

import re

from ckpt_cli.formats.gguf.arch import DENSE_LAYER, TOP

# architectures whose tensors carry Hugging Face names on reading: the dense decoders of GGUF_CONFIG_MAPPING that share
# Llama's layout (gguf-py MODEL_TENSORS for LLAMA, QWEN2, QWEN3)
MAPPED = ("llama", "qwen2", "qwen3")
UNPERMUTED = ("llama",)  # transformers' TENSOR_PROCESSORS["llama"]
# the writer's names read backwards (formats/gguf/arch.py): GGUF name -> Hugging Face module path
GLOBAL = {gguf: hf for hf, gguf in TOP.items()}
BLOCK = {gguf: hf for hf, gguf in DENSE_LAYER.items()}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"([a-z_]+)\.(weight|bias)")


def hf_name(name: str, arch: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name` (None: transformers has no parameter for it, e.g. rope_freqs)."""
    if m := _BLOCK_NAME.fullmatch(name):
        part = BLOCK.get(m[2])
        return f"model.layers.{m[1]}.{part}.{m[3]}" if part else None
    if m := _GLOBAL_NAME.fullmatch(name):
        part = GLOBAL.get(m[1])
        return f"{part}.{m[2]}" if part else None
    return None


def heads_for(name: str, arch: str, metadata: dict[str, object]) -> int | None:
    """The head count to un-permute tensor `name` by (None: left as stored), as LlamaTensorProcessor decides."""
    if arch not in UNPERMUTED or not (".attn_q." in name or ".attn_k." in name):
        return None
    heads, kv_heads = metadata.get(f"{arch}.attention.head_count"), metadata.get(f"{arch}.attention.head_count_kv")
    if not isinstance(heads, int) or not isinstance(kv_heads, int):  # absent (or per-layer lists): transformers leaves them
        return None
    return heads if ".attn_q." in name else int(kv_heads)


# transformers' GGUF_CONFIG_MAPPING (transformers/integrations/ggml.py) for the mapped architectures: the config a
# Hugging Face folder written from the file carries, as load_gguf_checkpoint builds it
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# transformers maps Llama's rope.dimension_count to head_dim and Qwen's to nothing, so its GGUF loader gives a Qwen3 of
# head_dim other than 128 (the config's default) the wrong shapes; the converter writes the head size as
# attention.key_length, which ckpt reads for them (the folder then loads with from_pretrained)
HEAD_DIM_KEY = {"llama": "rope.dimension_count", "qwen2": "attention.key_length", "qwen3": "attention.key_length"}
TOKEN_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(metadata: dict[str, object], arch: str, tensor_names: set[str]) -> dict[str, object]:
    """config.json for the weights read from a file of a mapped architecture (float32, as they are presented)."""
    config: dict[str, object] = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "torch_dtype": "float32"}
    for key, hf in {**CONFIG_KEYS, HEAD_DIM_KEY[arch]: "head_dim"}.items():
        value = metadata.get(f"{arch}.{key}")
        if isinstance(value, (int, float)):
            config[hf] = value
    for key, hf in TOKEN_KEYS.items():
        value = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            config[hf] = value
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, list):  # transformers#32526: the token count instead
        config["vocab_size"] = len(tokens)
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch == "llama" and "blk.0.attn_q.bias" in tensor_names:  # Llama with attention_bias (transformers' GGUF loader drops them)
        config["attention_bias"] = True
    return config
