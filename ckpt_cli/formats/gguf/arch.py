"""A Hugging Face model's architecture as llama.cpp's converter writes it to GGUF: the architecture name and its
hyper-parameter keys from config.json (conversion/base.py `TextModel.set_gguf_parameters`, conversion/llama.py,
conversion/qwen.py), and each Hugging Face tensor's GGUF name (gguf-py's tensor_mapping.py) with the layout changes the
converter makes: Llama's q/k rows permuted back to Meta's interleaved rotary order, MoE experts stacked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core.model import TensorEntry
from ckpt_cli.core.names import rope
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.gguf.constants import ValueType
from ckpt_cli.formats.gguf.encode import KV


@dataclass(frozen=True)
class Arch:
    name: str  # GGUF's general.architecture
    permute_qk: bool  # LlamaModel.undo_permute
    experts: str | None  # how per-expert weights are named and stacked: "mixtral" or "qwen2moe"
    vocab: str  # "spm-first" (SentencePiece, else BPE: Llama, Qwen2) or "bpe"


ARCHS = {
    "LlamaForCausalLM": Arch("llama", True, None, "spm-first"),
    "MistralForCausalLM": Arch("llama", True, None, "spm-first"),
    "MixtralForCausalLM": Arch("llama", True, "mixtral", "spm-first"),
    "Qwen2ForCausalLM": Arch("qwen2", False, None, "spm-first"),
    "Qwen3ForCausalLM": Arch("qwen3", False, None, "spm-first"),
    "Qwen2MoeForCausalLM": Arch("qwen2moe", False, "qwen2moe", "bpe"),
}

# file_type: gguf-py's LlamaFileType of the type asked for
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32}


def arch_of(config: dict[str, Any]) -> tuple[str, Arch]:
    names = config.get("architectures") or []
    hf = names[0] if isinstance(names, list) and names else None
    if hf is None:
        raise UsageError("config.json names no model class ('architectures'), which GGUF's architecture follows from")
    if hf not in ARCHS:
        raise UsageError(
            f"config.json names architecture {hf!r}: ckpt writes GGUF for {', '.join(ARCHS)}; "
            "use llama.cpp's convert_hf_to_gguf.py for others"
        )
    return hf, ARCHS[hf]


def find(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of the first key present (the converter's find_hparam: present with null counts as found)."""
    return next((config[k] for k in keys if k in config), None)


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """TextModel.__init__: rope_parameters (or rope_scaling), with the top-level rope_theta and type mirrored in."""
    rope = dict(config.get("rope_parameters", config.get("rope_scaling")) or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        theta = find(config, ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base"))
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
    return rope


def parameter_kvs(hf: str, arch: Arch, config: dict[str, Any], file_type: str) -> list[KV]:
    """The `{arch}.*` keys in the order the converter adds them, and general.file_type among them."""
    a, u32, f32 = arch.name, ValueType.UINT32, ValueType.FLOAT32
    if (
        "text_config" in config
        or config.get("is_causal") is False
        or config.get("layer_types")
        and "sliding_attention" in config["layer_types"]
    ):
        raise UsageError(f"config.json of {hf}: a multimodal, non-causal or sliding-window variant, which ckpt does not write to GGUF")
    out: list[KV] = []

    def add(key: str, kind: ValueType, value: Any) -> None:
        if value is not None:
            out.append(KV(f"{a}.{key}", kind, float(value) if kind == f32 else value))

    add("block_count", u32, find(config, ("n_layers", "num_hidden_layers", "n_layer", "num_layers")))
    add(
        "context_length",
        u32,
        find(config, ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length", "model_max_length")),
    )
    add("embedding_length", u32, find(config, ("hidden_size", "n_embd", "dim")))
    add(
        "feed_forward_length",
        u32,
        find(config, ("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner", "hidden_dim")),
    )
    add("attention.head_count", u32, find(config, ("num_attention_heads", "n_head", "n_heads")))
    add("attention.head_count_kv", u32, find(config, ("num_key_value_heads", "n_kv_heads")))
    rope = rope_parameters(config)
    kind = rope.get("rope_type")
    if kind not in (None, "default"):
        raise UsageError(f"config.json: rope type {kind!r}, which ckpt does not write to GGUF (plain RoPE only)")
    add("rope.freq_base", f32, rope.get("rope_theta"))
    add("attention.layer_norm_rms_epsilon", f32, find(config, ("rms_norm_eps", "norm_eps")))
    add("attention.layer_norm_epsilon", f32, find(config, ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")))
    add("expert_count", u32, find(config, ("num_local_experts", "num_experts", "n_routed_experts")))
    add("expert_used_count", u32, find(config, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")))
    if config.get("n_group") is not None or find(config, ("score_function", "scoring_func", "score_func")) is not None:
        raise UsageError(f"config.json of {hf}: grouped or scored expert routing, which ckpt does not write to GGUF")
    if config.get("head_dim") is not None:
        add("attention.key_length", u32, config["head_dim"])
        add("attention.value_length", u32, config["head_dim"])
    out.append(KV("general.file_type", u32, FILE_TYPES[file_type]))
    if a == "llama":
        add("vocab_size", u32, config["vocab_size"])
        rope_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        add("rope.dimension_count", u32, rope_dim)
    if a == "qwen2moe":
        add("expert_feed_forward_length", u32, config.get("moe_intermediate_size"))
        add("expert_shared_feed_forward_length", u32, config.get("shared_expert_intermediate_size"))
    return out


# Hugging Face module names inside a layer -> GGUF's (gguf-py tensor_mapping.py, the names these architectures use)
# a dense decoder layer's tensors (Llama, Qwen2, Qwen3), which a GGUF file's reader maps back (formats/gguf/names.py)
DENSE_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER = {
    **DENSE_LAYER,
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# per-expert weights: (layer, expert, which); the stacked tensor's GGUF name per `which`
EXPERT_RE = {
    "mixtral": re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
    "qwen2moe": re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(down_proj|gate_proj|up_proj)\.weight"),
}
EXPERT_ORDER = {"mixtral": ("w1", "w2", "w3"), "qwen2moe": ("down_proj", "gate_proj", "up_proj")}
EXPERT_NAMES = {
    "w1": "ffn_gate_exps",
    "w2": "ffn_down_exps",
    "w3": "ffn_up_exps",
    "gate_proj": "ffn_gate_exps",
    "down_proj": "ffn_down_exps",
    "up_proj": "ffn_up_exps",
}


def skipped(name: str) -> bool:
    return name.endswith(_SKIPPED)


def permuted_qk(entry: TensorEntry, name: str, config: dict[str, Any]) -> TensorEntry:
    """LlamaModel.permute: q with the attention heads, k with the key-value heads, back to Meta's interleaved rows."""
    heads = config["num_attention_heads"]
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = config.get("num_key_value_heads") or heads
    return rope.permuted(entry, entry.name, heads, "interleaved")


def gguf_name(name: str) -> str:
    """A Hugging Face tensor's GGUF name; a name these architectures do not have is refused, as the converter does."""
    stem, _, suffix = name.rpartition(".")
    if stem in TOP and suffix in ("weight", "bias"):
        return f"{TOP[stem]}.{suffix}"
    match = LAYER_RE.fullmatch(name)
    if match and match[2] in _LAYER:
        return f"blk.{match[1]}.{_LAYER[match[2]]}.{match[3]}"
    raise UsageError(f"tensor '{name}' has no GGUF name in this architecture (llama.cpp's converter refuses it too)")
