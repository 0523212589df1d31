"""ckpt: inspect, verify and convert training checkpoints (DCP, DeepSpeed, Hugging Face, safetensors, torch).

The Python API (ckpt_cli/api.py): `ckpt_cli.open(path)` for metadata and streamed tensor reads, and
`convert`, `reshard`, `merge`, `split`, `verify`, `inspect`, `diff` as functions returning the reports the CLI prints.
The library never imports typer, rich or tqdm; those belong to `ckpt_cli.cli`.
"""

from ckpt_cli.api import (
    Checkpoint,
    Report,
    TensorInfo,
    Tree,
    WriteReport,
    convert,
    diff,
    inspect,
    merge,
    open,
    reshard,
    split,
    verify,
)
from ckpt_cli.errors import CkptError, DataError, UnsafePickleError, UsageError
from ckpt_cli.ops.source import open_checkpoint

__version__ = "0.1.0"
__all__ = [
    "Checkpoint",
    "CkptError",
    "DataError",
    "Report",
    "TensorInfo",
    "Tree",
    "UnsafePickleError",
    "UsageError",
    "WriteReport",
    "__version__",
    "convert",
    "diff",
    "inspect",
    "merge",
    "open",
    "open_checkpoint",
    "reshard",
    "split",
    "verify",
]
