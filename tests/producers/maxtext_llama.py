"""A small Llama in MaxText's layout, saved as MaxText saves its train state, with its logits: `python maxtext_llama.py OUT`.

MaxText itself needs Python >= 3.12 and a TPU-shaped stack, so this producer holds what MaxText's Linen Llama decoder
holds (layers/llama2.py, attentions.py, embeddings.py `LLaMARotaryEmbedding`, at MaxText e591f30), computed the way it
computes it, and saves it the way MaxText's `save_checkpoint` (common/checkpointing.py) does: a CheckpointManager step
with one item `items` holding the train state {step, params: {params: ...}, opt_state} (`PyTreeSave` with a
`chunk_byte_size` and the OCDBT target file size, Orbax's defaults otherwise) and `custom_metadata={"scan_layers": ...}`.
What MaxText's layout is:
- kernels are [in, out]: attention `query` [embed, heads, head_dim], `key`/`value` [embed, kv_heads, head_dim], `out`
  [heads, head_dim, embed]; `mlp.wi_0` (gate), `wi_1` (up) [embed, mlp], `wo` [mlp, embed]; `logits_dense` [embed, vocab];
- the query kernel is stored divided by sqrt(head_dim) (attentions.py folds the softmax scale into its initializer and
  its HF import divides by it), so attention takes q.k without a scale;
- rotary embedding pairs dims 2i and 2i+1 of a head (interleaved), with timescale theta^(2i/head_dim);
- RMSNorm is x * rsqrt(mean(x^2) + eps) * scale;
- with `scan_layers` every layer parameter is stacked on axis 1 (`param_scan_axis: 1`): query [embed, layers, heads,
  head_dim], a norm scale [embed, layers].

Written: OUT/scanned/<step>/items (float32, scan_layers) and OUT/unscanned/<step>/items (bfloat16, layers_N), each
sharded over 8 simulated devices; OUT/<name>_arrays/<leaf>.npy (the params as the producer held them, bfloat16 as
uint16 bits); OUT/hf-config/config.json (the LlamaConfig of the same model); OUT/tokens.npy and OUT/logits.npy (the
scanned float32 model's forward over the tokens, float32).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

STEP = 10
VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = 128, 64, 4, 2, 12, 96, 3
THETA, EPS = 10000.0, 1e-5


def layer_params(key: jax.Array) -> dict:
    k = jax.random.split(key, 7)

    def normal(i: int, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(k[i], shape, jnp.float32) / np.sqrt(fan_in)

    return {
        "pre_self_attention_layer_norm": {"scale": 1.0 + 0.1 * jax.random.normal(k[5], (EMBED,))},
        "post_self_attention_layer_norm": {"scale": 1.0 + 0.1 * jax.random.normal(k[6], (EMBED,))},
        "self_attention": {
            "query": {"kernel": normal(0, (EMBED, HEADS, HEAD_DIM), EMBED) / np.sqrt(HEAD_DIM)},
            "key": {"kernel": normal(1, (EMBED, KV_HEADS, HEAD_DIM), EMBED)},
            "value": {"kernel": normal(2, (EMBED, KV_HEADS, HEAD_DIM), EMBED)},
            "out": {"kernel": normal(3, (HEADS, HEAD_DIM, EMBED), HEADS * HEAD_DIM)},
        },
        "mlp": {
            "wi_0": {"kernel": normal(4, (EMBED, MLP), EMBED)},
            "wi_1": {"kernel": jax.random.normal(jax.random.fold_in(key, 1), (EMBED, MLP)) / np.sqrt(EMBED)},
            "wo": {"kernel": jax.random.normal(jax.random.fold_in(key, 2), (MLP, EMBED)) / np.sqrt(MLP)},
        },
    }


def model_params(scanned: bool) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(3), LAYERS + 3)
    layers = [layer_params(keys[i]) for i in range(LAYERS)]
    decoder: dict = {
        "decoder_norm": {"scale": 1.0 + 0.1 * jax.random.normal(keys[-1], (EMBED,))},
        "logits_dense": {"kernel": jax.random.normal(keys[-2], (EMBED, VOCAB)) / np.sqrt(EMBED)},
    }
    if scanned:  # one array per parameter, the layers on axis 1 (MaxText's param_scan_axis)
        decoder["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs, axis=1), *layers)
    else:
        decoder.update({f"layers_{i}": layer for i, layer in enumerate(layers)})
    return {"params": {"decoder": decoder, "token_embedder": {"embedding": jax.random.normal(keys[-3], (VOCAB, EMBED))}}}


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + EPS) * scale


def rotary(x: jax.Array) -> jax.Array:
    """MaxText's LLaMARotaryEmbedding on [seq, heads, head_dim]: pairs (2i, 2i + 1), timescale theta^(2i/head_dim)."""
    fraction = jnp.repeat(2 * jnp.arange(HEAD_DIM // 2) / HEAD_DIM, 2)
    timescale = THETA**fraction
    position = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None, None]
    angle = position / timescale
    left = jnp.concatenate([x[..., 1:], x[..., :1]], axis=-1)
    right = jnp.concatenate([x[..., -1:], x[..., :-1]], axis=-1)
    shifted = jnp.where(jnp.arange(HEAD_DIM) % 2 == 1, right, left)
    sign = jnp.tile(jnp.array([-1.0, 1.0]), HEAD_DIM // 2)
    return x * jnp.cos(angle) + shifted * jnp.sin(angle) * sign


def layer_forward(x: jax.Array, p: dict) -> jax.Array:
    attn = p["self_attention"]
    h = rms_norm(x, p["pre_self_attention_layer_norm"]["scale"])
    q = rotary(jnp.einsum("se,ehd->shd", h, attn["query"]["kernel"]))
    k = rotary(jnp.einsum("se,ehd->shd", h, attn["key"]["kernel"]))
    v = jnp.einsum("se,ehd->shd", h, attn["value"]["kernel"])
    k, v = jnp.repeat(k, HEADS // KV_HEADS, axis=1), jnp.repeat(v, HEADS // KV_HEADS, axis=1)
    scores = jnp.einsum("shd,thd->hst", q, k)  # no 1/sqrt(head_dim): it is in the query kernel
    seq = x.shape[0]
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    out = jnp.einsum("hst,thd->shd", jax.nn.softmax(scores, axis=-1), v)
    x = x + jnp.einsum("shd,hde->se", out, attn["out"]["kernel"])
    h = rms_norm(x, p["post_self_attention_layer_norm"]["scale"])
    mlp = p["mlp"]
    gate, up = h @ mlp["wi_0"]["kernel"], h @ mlp["wi_1"]["kernel"]
    return x + (jax.nn.silu(gate) * up) @ mlp["wo"]["kernel"]


def logits(params: dict, tokens: jax.Array) -> jax.Array:
    p = params["params"]
    x = p["token_embedder"]["embedding"][tokens]
    stacked = p["decoder"]["layers"]
    for i in range(LAYERS):
        x = layer_forward(x, jax.tree_util.tree_map(lambda a, i=i: a[:, i], stacked))
    x = rms_norm(x, p["decoder"]["decoder_norm"]["scale"])
    return x @ p["decoder"]["logits_dense"]["kernel"]


def train_state(params: dict) -> dict:
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree_util.tree_map(lambda x: jnp.full(x.shape, 0.01, x.dtype), params)
    _, opt_state = opt.update(grads, opt_state, params)
    return {"step": jnp.asarray(STEP, jnp.int32), "params": params, "opt_state": opt_state}


def leaf_name(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def save_arrays(tree: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        value = np.asarray(leaf)
        np.save(out / f"{leaf_name(path)}.npy", value.view(np.uint16) if value.dtype.name == "bfloat16" else value)


def save(state: dict, root: Path, scanned: bool) -> None:
    """As MaxText's save_checkpoint: item `items`, PyTreeSave with chunk_byte_size and ocdbt_target_data_file_size."""
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def place(x: jax.Array) -> jax.Array:
        spec = P("fsdp") if x.ndim and x.shape[0] % 8 == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    state = jax.tree_util.tree_map(place, state)
    chunk = 2 << 30  # MaxText's default checkpoint_storage_target_data_file_size_bytes
    args = ocp.args.PyTreeSave(
        item=state,
        save_args=jax.tree_util.tree_map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk), state),
        ocdbt_target_data_file_size=chunk,
    )
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mgr:
        mgr.save(STEP, args=ocp.args.Composite(items=args), custom_metadata={"scan_layers": scanned})
        mgr.wait_until_finished()


def hf_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": EMBED,
        "intermediate_size": MLP,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    out = ap.parse_args().out
    scanned = model_params(scanned=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, 16), jnp.int32)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", np.asarray(tokens))
    np.save(out / "logits.npy", np.asarray(logits(scanned, tokens), np.float32))
    unscanned = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), model_params(scanned=False))
    for name, params, scan in (("scanned", scanned, True), ("unscanned", unscanned, False)):
        save_arrays(params, out / f"{name}_arrays")
        save(train_state(params), out / name, scan)
    (out / "hf-config").mkdir(exist_ok=True)
    (out / "hf-config" / "config.json").write_text(json.dumps(hf_config(), indent=1))


if __name__ == "__main__":
    main()
