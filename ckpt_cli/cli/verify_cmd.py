"""`ckpt verify SRC`: exit 0 when whole, 1 with one line per problem when not."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import Format, Json, Quiet, Source, Tag, TrustPickle

MAX_SHOWN = 20


def verify(
    src: Source,
    deep: Annotated[bool, typer.Option("--deep", help="Read every byte: zip CRCs, per-tensor checksums, unreadable records.")] = False,
    finite: Annotated[bool, typer.Option("--finite", help="Count NaN/Inf in floating-point tensors; any is a problem.")] = False,
    write_manifest: Annotated[
        Optional[Path], typer.Option("--write-manifest", metavar="FILE", help="Record per-file and per-tensor BLAKE3 digests in FILE.")
    ] = None,
    manifest: Annotated[
        Optional[Path], typer.Option("--manifest", metavar="FILE", help="Check against a manifest from --write-manifest.")
    ] = None,
    against: Annotated[
        Optional[Path], typer.Option("--against", metavar="CKPT", help="Compare tensor by tensor with another checkpoint (any format).")
    ] = None,
    atol: Annotated[float, typer.Option("--atol", metavar="TOL", help="Absolute tolerance for --against (default: bit-exact).")] = 0.0,
    rtol: Annotated[float, typer.Option("--rtol", metavar="TOL", help="Relative tolerance for --against (default: bit-exact).")] = 0.0,
    policy: Annotated[
        Optional[Path], typer.Option("--policy", metavar="FILE", help="YAML: expected tensors, dtypes, shapes, tolerances, training state.")
    ] = None,
    json_: Json = False,
    format_: Format = None,
    tag: Tag = None,
    trust_pickle: TrustPickle = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Let --write-manifest replace a previous manifest (never any other file).")
    ] = False,
    quiet: Quiet = False,
) -> None:
    """Check integrity: files, sizes, headers, tiling, CRCs and checksums; optionally compare."""
    from ckpt_cli import api  # imported when a command runs (`ckpt --help` imports no format)

    with output.reading(f"verify {output.last_name(src)}", quiet):
        report = api.verify(
            src, deep=deep, finite=finite, against=against, atol=atol, rtol=rtol, manifest=manifest, write_manifest=write_manifest,
            overwrite=overwrite, policy=policy, format=format_, tag=tag, trust_pickle=trust_pickle,
        )  # fmt: skip
    if json_:
        output.emit_json(report.to_json())
    elif report.ok:
        output.emit(
            f"OK {report.path} ({report.format}): {', '.join(report.checks)}; "
            f"{report.stats.get('tensors', 0)} tensors in {report.stats.get('files', 0)} files"
        )
        for note in report.notes:
            output.info(f"note: {note}", quiet)
    else:
        count = len(report.problems)
        output.emit(f"FAILED {report.path} ({report.format or 'unreadable'}): {count} problem{'s' if count > 1 else ''}")
        shown = report.problems[:MAX_SHOWN]
        output.emit("\n".join(f"  {p}" for p in shown))
        if len(report.problems) > MAX_SHOWN:
            output.emit(f"  ... and {len(report.problems) - MAX_SHOWN} more (--json lists all)")
        if report.refused_pickle:
            output.emit("  If you trust this file, pass --trust-pickle.")
    if not report.ok:
        raise typer.Exit(1)
