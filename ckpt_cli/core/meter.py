"""Bytes read by a long read-only pass (verify's checksums and hashes, diff's values), counted for a progress display.

The loops that read blocks call `advance`; the operation names each pass with `stage`. Whoever wants to show
progress (the CLI on a terminal) installs a Meter around the call with `metered`; without one both are no-ops.
A context variable rather than a callback through every reader: the passes run deep inside format readers
(a ZIP record's CRC, a file's digest), whose signatures should not carry a display concern.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol


class Meter(Protocol):
    def stage(self, label: str, total: int) -> None:
        """A new pass begins that will read about `total` bytes."""

    def advance(self, nbytes: int) -> None:
        """`nbytes` more bytes of the current pass were read."""


_current: ContextVar[Meter | None] = ContextVar("ckpt_meter", default=None)


def stage(label: str, total: int) -> None:
    meter = _current.get()
    if meter is not None:
        meter.stage(label, total)


def advance(nbytes: int) -> None:
    meter = _current.get()
    if meter is not None:
        meter.advance(nbytes)


@contextmanager
def metered(meter: Meter | None) -> Iterator[None]:
    token = _current.set(meter)
    try:
        yield
    finally:
        _current.reset(token)
