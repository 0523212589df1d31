"""ckpt: inspect, verify and convert training checkpoints (DCP, DeepSpeed, Hugging Face, safetensors, torch).

The library never imports typer, rich or tqdm; those belong to `ckpt_cli.cli`.
"""

from ckpt_cli.errors import CkptError, DataError, UsageError
from ckpt_cli.ops.source import open_checkpoint

__version__ = "0.1.0"
__all__ = ["CkptError", "DataError", "UsageError", "open_checkpoint", "__version__"]
