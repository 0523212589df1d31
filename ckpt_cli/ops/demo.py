"""`demo DIR`: small, real sample checkpoints in every format, written by the real producers.

A tiny language model (tied embedding, two blocks) trains three AdamW steps with a warmup schedule;
then torch.save and torch.distributed.checkpoint write the full training state, safetensors writes
the weights, ckpt's own hf writer shards them, ckpt's own DeepSpeed writer turns the DCP training state
into a ZeRO-2 checkpoint (no DeepSpeed needed), a run folder holds two steps, and `llama/` is a tiny Hugging Face
Llama release (config.json + safetensors) that transformers loads. Every command can be tried on the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.write.executor import execute
from ckpt_cli.formats.hf import folder as hf
from ckpt_cli.store import Guard
from ckpt_cli.store.local import staged

# The DeepSpeed sample: what `ckpt convert demo/dcp X --to deepspeed --zero-stage 2 --world-size 2` writes.
DS_ZERO_STAGE, DS_WORLD_SIZE = 2, 2
VOCAB, DIM, LAYERS, STEPS = 96, 32, 2, 3


def _model() -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)) for _ in range(LAYERS)
            )
            self.norm = nn.LayerNorm(DIM)
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
            self.lm_head.weight = self.embed.weight  # tied, as most LMs are

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for block in self.blocks:
                x = x + block(x)
            return self.lm_head(self.norm(x))

    return TinyLM()


def _train() -> tuple[Any, Any, Any, dict[str, Any]]:
    import torch

    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (4, 16))
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, {"epoch": 0, "samples_seen": STEPS * 4}


def _save_dcp(state: dict[str, Any], path: Path) -> None:
    """The same training state through torch.distributed.checkpoint (one process, no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _write_deepspeed(dcp_dir: Path, dest: Path) -> None:
    """The DCP training state as a DeepSpeed ZeRO checkpoint, through ckpt's own writer (the one call into convert)."""
    from ckpt_cli.ops import convert

    request = convert.Request(
        dcp_dir,
        dest,
        "deepspeed",
        write=WriteOptions(world_size=DS_WORLD_SIZE),
        cross=convert.CrossSettings(zero_stage=DS_ZERO_STAGE),
    )
    convert.run(convert.prepare(request), overwrite=False)


DEMO_NAMES = ("training_state.pt", "dcp", "deepspeed", "model.safetensors", "hf", "run", "llama")
# A Hugging Face Llama release (config.json + safetensors) that transformers loads: what `ckpt parity` runs.
LLAMA_CONFIG: dict[str, Any] = {  # config.json: JSON values
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": DIM,
    "intermediate_size": 2 * DIM,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": DIM // 4,
    "hidden_act": "silu",
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _write_llama(folder: Path) -> None:
    """A tiny Llama's weights (seeded, at initialisation scale) under Hugging Face's names, with its config."""
    import json

    import torch
    from safetensors.torch import save_file

    c, g = LLAMA_CONFIG, torch.Generator().manual_seed(0)
    hidden, inner, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    sd = {
        "model.embed_tokens.weight": weight(VOCAB, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": weight(VOCAB, hidden),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden)}
        sd.update({f"{p}self_attn.{n}.weight": weight(*s) for n, s in shapes.items()})
        shapes = {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}
        sd.update({f"{p}mlp.{n}.weight": weight(*s) for n, s in shapes.items()})
        sd.update({f"{p}input_layernorm.weight": torch.ones(hidden), f"{p}post_attention_layernorm.weight": torch.ones(hidden)})
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


def is_demo(folder: Path) -> bool:
    """A folder `ckpt demo` wrote (what --overwrite may replace): it holds only the sample names."""
    return folder.is_dir() and {p.name for p in folder.iterdir()} <= set(DEMO_NAMES)


def write_demo(folder: Path, overwrite: bool = False) -> list[Path]:
    """Write the samples into `folder` (atomically); return the checkpoints written."""
    import torch
    from safetensors.torch import save_model

    from ckpt_cli.ops.source import open_checkpoint

    with staged(folder, True, overwrite, Guard(is_checkpoint=is_demo)) as tmp:  # a place it cannot write: refused first
        model, opt, sched, loader = _train()
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "lr_scheduler": sched.state_dict(),
            "step": STEPS,
            "rng": {"torch": torch.get_rng_state()},
            "dataloader": loader,
        }
        torch.save(state, tmp / "training_state.pt")
        # DCP keyed by parameter name, as get_state_dict gives it: what `convert --to deepspeed` carries over.
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        _save_dcp({**{k: v for k, v in state.items() if k not in ("model", "optimizer")}, "model": msd, "optim": osd}, tmp / "dcp")
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        weights = open_checkpoint(tmp / "model.safetensors")
        execute(hf.WRITER.plan(weights, tmp / "hf", WriteOptions(num_shards=3)))
        _write_deepspeed(tmp / "dcp", tmp / "deepspeed")
        (tmp / "run").mkdir()
        for step in (100, 200):  # a run folder: `--tag` picks one, the highest step by default
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            save_model(model, str(tmp / "run" / f"step_{step}.safetensors"), metadata={"format": "pt"})
        _write_llama(tmp / "llama")
    return [folder / n for n in DEMO_NAMES]
