"""`ckpt parity RELEASE`: does a Hugging Face release compute what the trained model computed?

Bytes can be right and a release still wrong: a q/k projection left in another rotary layout, a tied head
untied, a config that names the wrong head count all load without an error and give other outputs. Parity runs
the release with transformers on the CPU, in float32, on a few fixed token ids, and compares its logits with a
reference: another Hugging Face folder (`--against`, e.g. the framework's own export) or logits the user saved
from the training framework's forward on the same ids (`--logits FILE.pt`). It reports the largest and mean
absolute difference, the KL divergence of the release's next-token distribution from the reference's, and how
often the top token agrees. transformers and torch are optional dependencies; nothing runs remote code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.errors import TORCH_INSTALL, DataError, UsageError

DEFAULT_TOKENS = 16


@dataclass(frozen=True)
class ParityReport:
    release: str
    reference: str
    tokens: list[int]
    max_abs: float
    mean_abs: float
    kl: float  # mean over positions of KL(reference || release), in nats
    argmax_equal: int
    atol: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.atol

    def to_json(self) -> dict[str, Any]:
        return {
            "release": self.release,
            "reference": self.reference,
            "tokens": self.tokens,
            "max_abs_diff": self.max_abs,
            "mean_abs_diff": self.mean_abs,
            "kl": self.kl,
            "argmax_equal": self.argmax_equal,
            "positions": len(self.tokens),
            "atol": self.atol,
            "ok": self.ok,
        }


def parity(release: Path, against: Path | None, logits: Path | None, tokens: list[int] | None, atol: float) -> ParityReport:
    if (against is None) == (logits is None):
        raise UsageError("parity compares the release with one reference: --against DIR (a Hugging Face folder) or --logits FILE.pt")
    torch, auto = _libraries()
    model = _load(release, auto, torch)
    saved_tokens, reference = (None, None) if logits is None else _saved_logits(logits, torch)
    if tokens is not None and saved_tokens is not None and tokens != saved_tokens:
        raise UsageError(f"{logits}: saved for tokens {saved_tokens[:8]}..., not the --tokens given")
    ids = tokens or saved_tokens or default_tokens(model.config.vocab_size)
    if not ids or any(t < 0 or t >= model.config.vocab_size for t in ids):
        raise UsageError(f"token ids are 0..{model.config.vocab_size - 1} for this model (vocab_size), got {ids[:8]}")
    ours = _forward(model, ids, torch)
    if against is not None:
        reference = _forward(_load(against, auto, torch), ids, torch)
    assert reference is not None
    reference = reference.reshape(-1, reference.shape[-1]).double()
    if reference.shape != ours.shape:
        raise UsageError(f"the reference's logits are {list(reference.shape)}, the release's {list(ours.shape)} (positions x vocab)")
    diff = (ours - reference).abs()
    log_ref, log_ours = torch.log_softmax(reference, -1), torch.log_softmax(ours, -1)
    kl = float((log_ref.exp() * (log_ref - log_ours)).sum(-1).mean())
    equal = int((ours.argmax(-1) == reference.argmax(-1)).sum())
    where = str(against if against is not None else logits)
    return ParityReport(str(release), where, ids, float(diff.max()), float(diff.mean()), max(kl, 0.0), equal, atol)


def default_tokens(vocab: int) -> list[int]:
    """Sixteen ids spread over the vocabulary (1, then steps of about vocab / 16), the same on every run."""
    step = max(vocab // DEFAULT_TOKENS, 1)
    return [(1 + i * step) % vocab for i in range(min(DEFAULT_TOKENS, vocab))]


def _libraries() -> tuple[Any, Any]:
    try:
        import torch
    except ImportError:
        raise UsageError(f"parity runs the model, which needs torch: {TORCH_INSTALL}") from None
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging
    except ImportError:
        raise UsageError("parity loads the release with transformers, which is not installed: pip install transformers") from None
    transformers_logging.set_verbosity_error()  # the verdict is the output: no loading bars or config advice on stderr
    transformers_logging.disable_progress_bar()
    return torch, AutoModelForCausalLM


def _load(folder: Path, auto: Any, torch: Any) -> Any:
    if not (folder / "config.json").is_file():
        raise UsageError(f"{folder}: no config.json; a release transformers loads holds one (ckpt convert --hf-config DIR carries it)")
    try:
        model = auto.from_pretrained(str(folder), dtype=torch.float32, use_safetensors=True, trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, RuntimeError for a bad folder
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{folder}: transformers cannot load it ({first})") from exc
    return model.eval()


def _forward(model: Any, ids: list[int], torch: Any) -> Any:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids])).logits
    return out.reshape(-1, out.shape[-1]).double()


def _saved_logits(path: Path, torch: Any) -> tuple[list[int] | None, Any]:
    """A torch.save of logits ([positions, vocab] or [1, positions, vocab]) or of {'logits': ..., 'tokens': ...}
    (the ids may be called 'input_ids' or 'ids' too)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except Exception as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: not a torch.save file of logits ({why})") from exc
    tokens = None
    if isinstance(saved, dict):
        tokens = next((saved[k] for k in ("tokens", "input_ids", "ids") if k in saved), None)
        tokens = [int(t) for t in (tokens.flatten().tolist() if torch.is_tensor(tokens) else tokens)] if tokens is not None else None
        saved = saved.get("logits")
    if not torch.is_tensor(saved) or saved.ndim not in (2, 3) or not saved.is_floating_point() or not math.prod(saved.shape):
        raise DataError(f"{path}: holds no logits tensor ([positions, vocab] or [1, positions, vocab], floating point)")
    return tokens, saved
