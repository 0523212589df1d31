"""`ckpt parity RELEASE`: the release's logits against a reference; exit 0 within --atol, 1 beyond it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import Json, Quiet
from ckpt_cli.errors import UsageError


def parity(
    release: Annotated[
        Path, typer.Argument(metavar="RELEASE", help="A Hugging Face folder (config.json + safetensors).", show_default=False)
    ],
    against: Annotated[
        Optional[Path],
        typer.Option("--against", metavar="DIR", help="Reference: another Hugging Face folder (e.g. the framework's own export)."),
    ] = None,
    logits: Annotated[
        Optional[Path],
        typer.Option(
            "--logits",
            metavar="FILE",
            help="Reference: logits saved from the training framework's forward (torch.save of [positions, vocab], "
            "or of {'logits': ..., 'tokens': [...]}).",
        ),
    ] = None,
    tokens: Annotated[
        Optional[str],
        typer.Option(
            "--tokens", metavar="IDS", help="Comma-separated token ids (default: the file's, else 16 ids spread over the vocabulary)."
        ),
    ] = None,
    atol: Annotated[float, typer.Option("--atol", metavar="TOL", help="Largest |difference| of a logit that passes.")] = 1e-5,
    json_: Json = False,
    quiet: Quiet = False,
) -> None:
    """Run a release with transformers (CPU, float32) and compare its logits with a reference: max and mean |diff|, KL,
    top-token agreement."""
    from ckpt_cli.ops.parity import parity as parity_op

    ids = _token_ids(tokens) if tokens is not None else None
    with output.reading(f"parity {release.name}", quiet):
        report = parity_op(release, against, logits, ids, atol)
    if json_:
        output.emit_json(report.to_json())
    elif not quiet or not report.ok:
        verdict = "OK" if report.ok else f"FAILED (over --atol {report.atol:g})"
        typer.echo(
            f"parity {report.release} vs {report.reference}: max |diff| {report.max_abs:.3g}, mean {report.mean_abs:.3g}, "
            f"KL {report.kl:.3g}, top token equal at {report.argmax_equal}/{len(report.tokens)} positions: {verdict}"
        )
    if not report.ok:
        raise typer.Exit(1)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--tokens takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--tokens names no token id")
    return ids
