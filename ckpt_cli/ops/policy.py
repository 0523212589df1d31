"""`verify --policy FILE.yaml`: what a CI job expects of a checkpoint.

tensors:
  required: ["model.embed_tokens.weight", "lm_head.*"]   # globs; each must match a tensor
  forbidden: ["*.lora_*"]                                 # globs; none may match
  dtypes: {"model.*": [bfloat16, float32]}                # glob -> allowed dtypes
  shapes: {"model.embed_tokens.weight": [32000, 4096]}
min_params: 1000000
max_params: 8000000000
finite: true                                              # fail on any NaN/Inf
training_state: [optimizer, lr_scheduler]                 # must be present
tolerance: {atol: 0.0, rtol: 0.0}                         # for --against
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core import dtypes, roles
from ckpt_cli.core.model import Checkpoint
from ckpt_cli.core.paths import read_regular_text
from ckpt_cli.errors import CkptError, DataError, UsageError

_TOP_KEYS = {"tensors", "min_params", "max_params", "finite", "training_state", "tolerance"}
_STATE_KEYS = {"optimizer", "lr_scheduler", "rng", "dataloader", "client_state"}


@dataclass
class Policy:
    required: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)
    dtypes: dict[str, list[str]] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    min_params: int | None = None
    max_params: int | None = None
    finite: bool = False
    training_state: list[str] = field(default_factory=list)
    atol: float | None = None
    rtol: float | None = None


def _list_of_str(value: Any, key: str, path: Path) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{path}: '{key}' must be a list of strings")
    return value


def load(path: Path) -> Policy:
    import yaml

    try:
        doc = yaml.safe_load(read_regular_text(path, max_bytes=64 << 20))  # a local file or an object (s3://)
    except FileNotFoundError:
        raise UsageError(f"{path}: policy file not found") from None
    except (OSError, DataError, yaml.YAMLError) as exc:
        raise UsageError(f"{path}: not readable YAML ({str(exc).splitlines()[0]})") from exc
    doc = doc or {}
    if not isinstance(doc, dict) or not set(doc) <= _TOP_KEYS:
        unknown = sorted(set(doc) - _TOP_KEYS) if isinstance(doc, dict) else ["(not a mapping)"]
        raise UsageError(f"{path}: unknown policy keys {unknown} (known: {sorted(_TOP_KEYS)})")
    tensors = doc.get("tensors") or {}
    policy = Policy(
        required=_list_of_str(tensors.get("required", []), "tensors.required", path),
        forbidden=_list_of_str(tensors.get("forbidden", []), "tensors.forbidden", path),
        min_params=doc.get("min_params"),
        max_params=doc.get("max_params"),
        finite=bool(doc.get("finite", False)),
        training_state=_list_of_str(doc.get("training_state", []), "training_state", path),
    )
    for glob, allowed in (tensors.get("dtypes") or {}).items():
        names = [allowed] if isinstance(allowed, str) else _list_of_str(allowed, f"tensors.dtypes.{glob}", path)
        try:
            policy.dtypes[glob] = [dtypes.by_name(n).name for n in names]
        except CkptError as exc:
            raise UsageError(f"{path}: {exc}") from exc
    for name, shape in (tensors.get("shapes") or {}).items():
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise UsageError(f"{path}: tensors.shapes.{name} must be a list of integers")
        policy.shapes[name] = shape
    unknown_state = set(policy.training_state) - _STATE_KEYS
    if unknown_state:
        raise UsageError(f"{path}: unknown training_state entries {sorted(unknown_state)} (known: {sorted(_STATE_KEYS)})")
    tolerance = doc.get("tolerance") or {}
    policy.atol, policy.rtol = tolerance.get("atol"), tolerance.get("rtol")
    return policy


def check(ckpt: Checkpoint, policy: Policy) -> list[str]:
    """Every way `ckpt` breaks `policy`, one line each."""
    where = ckpt.path
    problems = []
    names = list(ckpt.tensors)
    for glob in policy.required:
        if not any(fnmatch.fnmatchcase(n, glob) for n in names):
            problems.append(f"{where}: policy requires a tensor matching '{glob}'; none found")
    for glob in policy.forbidden:
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if hits:
            problems.append(f"{where}: policy forbids '{glob}' but found {len(hits)} (e.g. '{hits[0]}')")
    for glob, allowed in policy.dtypes.items():
        for t in ckpt.tensors.values():
            if fnmatch.fnmatchcase(t.name, glob) and t.dtype.name not in allowed:
                problems.append(f"{where}: tensor '{t.name}' is {t.dtype.name}; policy allows {', '.join(allowed)}")
    for name, shape in policy.shapes.items():
        t = ckpt.tensors.get(name)
        if t is None:
            problems.append(f"{where}: policy gives a shape for '{name}', which is missing")
        elif list(t.shape) != shape:
            problems.append(f"{where}: tensor '{name}' has shape {list(t.shape)}; policy expects {shape}")
    params = sum(math.prod(t.shape) for t in ckpt.tensors.values() if t.role == "model")
    if policy.min_params is not None and params < policy.min_params:
        problems.append(f"{where}: {params} parameters, fewer than the policy's min_params {policy.min_params}")
    if policy.max_params is not None and params > policy.max_params:
        problems.append(f"{where}: {params} parameters, more than the policy's max_params {policy.max_params}")
    state = roles.describe_training_state(ckpt)
    for key in policy.training_state:
        if not state.get(key):
            problems.append(f"{where}: policy requires training state '{key}', which is absent")
    return problems
