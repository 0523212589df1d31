"""`inspect`: a summary of a checkpoint from its metadata alone (no tensor data is read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_cli.core import roles
from ckpt_cli.core.model import Checkpoint, Opaque
from ckpt_cli.errors import UsageError
from ckpt_cli.formats.runs import read as run_read
from ckpt_cli.ops import quantized
from ckpt_cli.ops import runs as run_roots
from ckpt_cli.ops.resolve import Found, Resolved, relative
from ckpt_cli.ops.transform import matches


def summary(ckpt: Checkpoint, filters: tuple[str, ...] = ()) -> dict[str, Any]:
    """The stable `inspect --json` document (SPEC §3); a run checkpoint's model weights under their exported names."""
    ckpt = run_roots.shown(ckpt)
    chosen = [t for t in ckpt.tensors.values() if matches(t.name, filters)]
    if filters and not chosen:  # as convert --select: an empty selection is a mistake, not an empty table
        raise UsageError(f"--filter {' '.join(filters)} matches no tensor of {ckpt.path}")
    dtypes: dict[str, int] = {}
    for t in chosen:
        dtypes[t.dtype.name] = dtypes.get(t.dtype.name, 0) + t.nbytes
    # Tied weights count once, as the parameters of the model they are.
    tied = {name for group in ckpt.tied_groups() for name in group[1:]}
    scheme = quantized.scheme_of(ckpt) if quantized.may_be_quantized(ckpt) else None
    weights = {t.name for t in chosen if t.role == "model" and t.name not in tied}
    quantization = {"quantization": scheme.summary()} if scheme is not None else {}
    # Every value left unparsed: a pickle the allow list refused (its global named) or one ckpt cannot read.
    opaque = [o for o in ckpt.objects.values() if isinstance(o.value, Opaque)]
    found = Found(Path(ckpt.path), ckpt.details.get("framework") if run_read.is_run(ckpt) else None, ckpt.format)
    return {
        "path": ckpt.path,
        "format": ckpt.format,
        "tag": ckpt.tag,
        "step": run_roots.shown_step(found, ckpt),  # as `ckpt ls` shows it: its own, else the one its name states
        "world_size": ckpt.world_size,
        "num_tensors": len(chosen),
        "num_params": quantized.true_params(ckpt, weights, scheme),
        "total_bytes": sum(t.nbytes for t in chosen),
        "dtypes": dtypes,
        "files": [{"path": f.path, "bytes": f.bytes} for f in ckpt.files],
        "training_state": roles.describe_training_state(ckpt),
        "tensors": [
            {"name": t.name, "dtype": t.dtype.name, "shape": list(t.shape), "role": t.role, "pieces": len(t.pieces)} for t in chosen
        ],
        "details": {**ckpt.details, "objects": len(ckpt.objects), "tied": ckpt.tied_groups(), **quantization},
        "unread": [{"name": o.name, "reason": o.value.reason, "refused_global": o.value.unsafe_global} for o in opaque],
        "notes": ckpt.notes,
    }


def run_root(resolved: Resolved) -> list[dict[str, Any]] | None:
    """For a folder holding several checkpoints (a run root), one entry each (path under it, framework, format),
    oldest first; None when the folder is a checkpoint itself."""
    root = resolved.location
    if resolved.level != "root":
        return None
    return [{"tag": relative(f, root), "framework": f.framework, "format": f.format, "path": str(f.path)} for f in resolved.members] or None
