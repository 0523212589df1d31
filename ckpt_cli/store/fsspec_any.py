"""Any other fsspec protocol (gs://, memory://, ...): read through fsspec's own filesystem; ckpt does not write there."""

from __future__ import annotations

from typing import Any

from ckpt_cli.errors import UsageError
from ckpt_cli.store.objects import ObjectStore


class AnyFsspec(ObjectStore):
    """The Backend of store/backend.py for a protocol with no backend of its own: reads only (no `Writer`), errors
    in the shared words (no `translate` of its own)."""

    INSTALL_HINT = "the fsspec implementation of this protocol (gcsfs for gs://)"
    CREDENTIALS = "the credentials this protocol's fsspec implementation reads"

    def make(self, protocol: str) -> Any:
        try:
            import fsspec

            return fsspec.filesystem(protocol, skip_instance_cache=True)
        except (ImportError, ValueError) as exc:
            raise UsageError(f"{protocol}://: no filesystem for this protocol ({exc})") from None
