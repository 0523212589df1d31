"""ckpt: inspect, verify and convert training checkpoints (DCP, DeepSpeed, Hugging Face, safetensors, torch).

The Python API (ckpt_cli/api.py): `ckpt_cli.open(path)` for metadata and streamed tensor reads, and
`convert`, `reshard`, `merge`, `split`, `verify`, `inspect`, `diff`, `parity` as functions returning the reports the CLI prints.
The library never imports typer, rich or tqdm; those belong to `ckpt_cli.cli`.
"""

from __future__ import annotations

from ckpt_cli.errors import CkptError, DataError, UnsafePickleError, UsageError

_API = ("Checkpoint", "Report", "TensorInfo", "Tree", "WriteReport", "convert", "diff", "inspect", "merge", "open", "reshard")
_API += ("split", "verify", "Request", "PreparedWrite", "prepare", "write", "convert_request", "reshard_request")
_API += ("merge_request", "split_request", "parity", "ParityReport")


def __getattr__(name: str) -> object:  # no typing import: ckpt starts without it (cli/entry.py)
    """The API is imported on first use, so that `ckpt` can handle Ctrl-C before its heavy imports (cli/entry.py)."""
    if name in _API:
        from ckpt_cli import api

        return getattr(api, name)
    if name == "open_checkpoint":
        from ckpt_cli.ops.source import open_checkpoint

        return open_checkpoint
    raise AttributeError(f"module 'ckpt_cli' has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = [
    "Checkpoint",
    "CkptError",
    "PreparedWrite",
    "Request",
    "DataError",
    "Report",
    "TensorInfo",
    "Tree",
    "UnsafePickleError",
    "UsageError",
    "WriteReport",
    "__version__",
    "convert",
    "convert_request",
    "diff",
    "inspect",
    "merge",
    "merge_request",
    "open",
    "open_checkpoint",
    "parity",
    "ParityReport",
    "prepare",
    "reshard",
    "reshard_request",
    "split",
    "split_request",
    "verify",
    "write",
]
