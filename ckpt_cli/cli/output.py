"""The one place that writes: data to stdout, messages and progress to stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


def emit_yaml(doc: Any) -> None:
    import yaml

    sys.stdout.write(yaml.safe_dump(json.loads(json.dumps(doc, default=str)), sort_keys=False))


def emit(text: str) -> None:
    sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))


def info(text: str, quiet: bool = False) -> None:
    if not quiet:
        sys.stderr.write(text + "\n")


def error(text: str) -> None:
    sys.stderr.write(f"ckpt: error: {text}\n")


@contextmanager
def progress(total_of: Callable[[], int], label: str, quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A byte progress bar (done/total, rate, ETA) on stderr, only when stderr is a terminal. The total is asked for
    only then (a wide write's files are made to be measured)."""
    total = 0 if quiet or not sys.stderr.isatty() else total_of()
    if total <= 0:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()
