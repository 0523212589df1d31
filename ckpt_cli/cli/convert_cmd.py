"""`ckpt convert`, `reshard`, `merge`, `split`: the writing commands, each a target layout."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpt_cli import options
from ckpt_cli.cli import output
from ckpt_cli.cli.options import Dest, Source, declared_command
from ckpt_cli.core.sizes import human_bytes
from ckpt_cli.errors import Interrupted, Terminated
from ckpt_cli.formats.registry import FORMATS

if TYPE_CHECKING:
    from ckpt_cli import api


def plan_text(report: api.WriteReport) -> str:
    """What --dry-run prints: the files, their sizes and the notes."""
    lines = [f"plan: write {report.format} to {report.destination} ({report.file_count} files, {human_bytes(report.total_bytes)})"]
    lines += [f"  {f['path']}  {human_bytes(f['bytes'])}  {f['tensors']} tensors" for f in report.files]
    lines.append(
        f"estimated peak memory: {human_bytes(report.estimated_peak_rss)} "
        f"(largest tensor {human_bytes(report.largest_tensor_bytes)}, streamed)"
    )
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _run(request: api.Request, run: options.RunOptions) -> None:
    from ckpt_cli import api  # imported when a command runs (`ckpt --help` imports no format)
    from ckpt_cli.core.write.distributed import is_main_process

    quiet = run.quiet or not is_main_process()  # under torchrun, rank 0 speaks for all
    dest = request.dest
    prepared = api.prepare(request)
    if run.dry_run:
        report = prepared.dry_run(run.overwrite)
        output.emit_json(report.to_json()) if run.json else output.emit(plan_text(report))
        return
    prepared.check_destination(run.overwrite, run.write_manifest)
    for note in prepared.notes:
        output.info(f"note: {note}", quiet)
    started = time.monotonic()
    with output.progress(lambda: prepared.total_bytes, f"{prepared.source_format} -> {prepared.format}", quiet) as bar:
        try:
            report = prepared.write(run.overwrite, bar, run.workers, run.write_manifest)
        except KeyboardInterrupt as exc:
            terminated = isinstance(exc, Terminated)
            what = "terminated (SIGTERM)" if terminated else "interrupted"
            raise Interrupted(f"{what}; nothing was written to {dest}", terminated) from None
    output.info(f"wrote {report.format} {dest} ({report.file_count} files, {human_bytes(report.total_bytes)})", quiet)
    if run.write_manifest is not None and is_main_process():
        output.info(f"wrote manifest {run.write_manifest}", quiet)
    if run.json and is_main_process():  # what was written, for scripts: the plan's document, and the run's facts
        seconds = round(time.monotonic() - started, 3)
        output.emit_json({**report.to_json(), "seconds": seconds, "manifest": run.write_manifest})


To = Annotated[
    str,
    typer.Option(
        "--to", metavar="FORMAT", help=f"Target format: {', '.join(n for n, f in FORMATS.items() if f.writable)}.", show_default=False
    ),
]


def writing_command(name: str) -> Callable[..., None]:
    """The typer command of writing command `name`: SRC, DST (--to for convert) and the options it takes, each from
    its declaration (ckpt_cli/options.py), in the order of their groups."""
    command = options.COMMANDS[name]
    flags = {f.name: options.flag_of(f) for _, f in options.fields(name)}
    formers = {f"{field_name}_former": (field_name, flag) for field_name, flag in flags.items() if flag.former}

    def run(src: str, dest: str, to: str | None = None, **values: Any) -> None:
        for key, (field_name, flag) in formers.items():
            former = values.pop(key)
            if former:  # the former spelling still works this release, with a note
                note = f"note: {flag.former} is now {flag.flag}, as in inspect and diff; {flag.former} is still taken in this release"
                output.info(note, values.get("quiet", False))
                values[field_name] = [*(values[field_name] or []), *former]
        from ckpt_cli.ops import writes  # imported when a command runs (`ckpt --help` imports no format)

        chosen = options.gather(name, values)
        _run(writes.request(name, src, dest, to, chosen), chosen.run)

    run.__name__ = name
    run.__doc__ = command.summary
    declared_command(run, [("src", Source), ("dest", Dest), *([("to", To)] if command.takes_to else [])], list(flags), *options.GROUPS)
    return run


convert, reshard, merge, split = (writing_command(name) for name in ("convert", "reshard", "merge", "split"))
