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

from ckpt_cli.core import dtypes, roles, structured
from ckpt_cli.core.model import Checkpoint
from ckpt_cli.core.paths import read_regular_text
from ckpt_cli.core.structured import Optional
from ckpt_cli.errors import CkptError, DataError, UsageError

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


def _names(value: Any) -> str | None:
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return None
    return "must be a dtype name or a list of them"


def _tolerance(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return f"must be a number >= 0, not {value!r}"[:100]
    return None


SCHEMA = {
    "tensors": Optional(
        {
            "required": Optional([str]),
            "forbidden": Optional([str]),
            "dtypes": Optional({str: _names}),
            "shapes": Optional({str: [structured.non_negative]}),
        }
    ),
    "min_params": Optional(structured.non_negative),
    "max_params": Optional(structured.non_negative),
    "finite": Optional(bool),
    "training_state": Optional([str]),
    "tolerance": Optional({"atol": Optional(_tolerance), "rtol": Optional(_tolerance)}),
}


def load(path: Path) -> Policy:
    try:
        text = read_regular_text(path, max_bytes=64 << 20)  # a local file or an object (s3://)
    except FileNotFoundError:
        raise UsageError(f"{path}: policy file not found") from None
    except (OSError, DataError) as exc:
        raise UsageError(f"{path}: not readable ({str(exc).splitlines()[0]})") from exc
    doc = structured.load_yaml(text, str(path), UsageError) or {}
    structured.check(doc, SCHEMA, str(path), UsageError)
    tensors = doc.get("tensors") or {}
    policy = Policy(
        required=tensors.get("required") or [],
        forbidden=tensors.get("forbidden") or [],
        min_params=doc.get("min_params"),
        max_params=doc.get("max_params"),
        finite=bool(doc.get("finite", False)),
        training_state=doc.get("training_state") or [],
    )
    for glob, allowed in (tensors.get("dtypes") or {}).items():
        names = [allowed] if isinstance(allowed, str) else allowed
        try:
            policy.dtypes[glob] = [dtypes.by_name(n).name for n in names]
        except CkptError as exc:
            raise UsageError(f"{path}: tensors.dtypes.{glob}: {exc}") from exc
    policy.shapes = dict(tensors.get("shapes") or {})
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
        found = ckpt.tensors.get(name)
        if found is None:
            problems.append(f"{where}: policy gives a shape for '{name}', which is missing")
        elif list(found.shape) != shape:
            problems.append(f"{where}: tensor '{name}' has shape {list(found.shape)}; policy expects {shape}")
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
