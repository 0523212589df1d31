"""`ckpt verify SRC`: exit 0 when whole, 1 with one line per problem when not."""

from __future__ import annotations

from typing import Any

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import Source, declared_command
from ckpt_cli.options import RunOptions, VerifyOptions

MAX_SHOWN = 20


def verify(src: str, **values: Any) -> None:
    """Check integrity: files, sizes, headers, tiling, CRCs and checksums; optionally compare."""
    from ckpt_cli import api  # imported when a command runs (`ckpt --help` imports no format)

    json_, quiet = values.pop("json"), values.pop("quiet")
    with output.reading(f"verify {output.last_name(src)}", quiet):
        report = api.verify(src, **values)
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


# Its options in the order --help lists them, declared in VerifyOptions (--overwrite: verify's own) or RunOptions.
OPTIONS = ("deep", "finite", "write_manifest", "manifest", "against", "atol", "rtol", "policy", "json", "format", "tag")
declared_command(verify, [("src", Source)], (*OPTIONS, "trust_pickle", "overwrite", "quiet"), VerifyOptions, RunOptions)
