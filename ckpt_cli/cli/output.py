"""The one place that writes: data to stdout, messages and progress to stderr."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any

# Seconds before any progress shows: quick commands print nothing extra (CKPT_PROGRESS_DELAY=0: at once).
DELAY = float(os.environ.get("CKPT_PROGRESS_DELAY", "0.5"))


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
    with _bar(total, label) as bar:
        yield bar.update


def _bar(total: int | None, label: str) -> Any:
    """Decimal units (kB, MB, GB), as every summary line prints sizes."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr, leave=False, delay=DELAY)


@contextmanager
def reading(label: str, quiet: bool, doing: str = "reading metadata") -> Iterator[None]:
    """Progress of a read-only command on stderr when it is a terminal: a clock while it opens the checkpoint
    ("LABEL: reading metadata 3s"), then a byte bar for each pass that reads data (checksums, hashes, values)."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    from ckpt_cli.core import meter

    with closing(_Passes(label, doing)) as bars, meter.metered(bars):
        yield


class _Passes:
    """A core.meter.Meter on the terminal: a clock while metadata are read, then one bar per pass."""

    def __init__(self, label: str, doing: str = "reading metadata") -> None:
        self.label, self.doing, self.bar = label, doing, None
        self.opening = threading.Event()
        self.clock = threading.Thread(target=self._tick, daemon=True)
        self.clock.start()

    def _tick(self) -> None:
        start, shown = time.monotonic(), False
        while not self.opening.wait(max(DELAY, 0.1)):
            if time.monotonic() - start >= DELAY:
                sys.stderr.write(f"\r{self.label}: {self.doing} {time.monotonic() - start:.0f}s")
                sys.stderr.flush()
                shown = True
        if shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()

    def _stop_clock(self) -> None:
        self.opening.set()
        self.clock.join()

    def stage(self, label: str, total: int) -> None:
        self._stop_clock()
        if self.bar is not None:
            self.bar.close()
        self.bar = _bar(total or None, f"{self.label}: {label}")

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def close(self) -> None:
        self._stop_clock()
        if self.bar is not None:
            self.bar.close()


def few(items: list[Any], shown: int) -> str:
    """A list on one line: its first `shown` items, then how many more."""
    more = f", ... ({len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(map(str, items[:shown])) + more


def last_name(path: str) -> str:
    """The last component of a path or URL as typed (SRC stays a string: an s3:// URL is no Path)."""
    return path.rstrip("/").rsplit("/", 1)[-1] or path
