"""Any other fsspec protocol (gs://, memory://, ...): read through fsspec's own filesystem; ckpt does not write there."""

from __future__ import annotations

from typing import Any

from ckpt_cli.errors import UsageError

INSTALL_HINT = "the fsspec implementation of this protocol (gcsfs for gs://)"
CREDENTIALS = "the credentials this protocol's fsspec implementation reads"
ENVIRONMENT: tuple[str, ...] = ()
Writer = None  # reads only


def make(protocol: str) -> Any:
    try:
        import fsspec

        return fsspec.filesystem(protocol, skip_instance_cache=True)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"{protocol}://: no filesystem for this protocol ({exc})") from None


def translate(exc: BaseException, where: object) -> Exception | None:
    return None
