"""Built-in name maps for what people train, selected by name (`--preset NAME`): one YAML file per preset here.

A preset is a name map (core/training.py NameMap: rename, split, permute, stack, transpose, zero, tied) plus a
`description`, a `detect` pattern (a regular expression that some tensor name of a source in that layout matches)
and optionally `unless` (one that no name of such a source matches: Llama has no q_norm, Qwen3 has), so that an
export without a preset can suggest the one that fits (never apply it unasked); a preset without `detect` is never
suggested.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_cli.core.model import Checkpoint
    from ckpt_cli.core.training import NameMap

_KEYS = ("description", "detect", "unless", "target")


def names() -> list[str]:
    """The presets' names, from the file names alone (the CLI's help lists them without parsing YAML)."""
    return sorted(p.name.removesuffix(".yaml") for p in resources.files(__name__).iterdir() if p.name.endswith(".yaml"))


@functools.cache
def _document(name: str) -> dict[str, Any]:
    from ckpt_cli.core import structured
    from ckpt_cli.errors import UsageError

    if name not in names():
        raise UsageError(f"no preset '{name}' (presets: {', '.join(names())})")
    text = resources.files(__name__).joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    return structured.load_yaml(text, f"preset {name}", UsageError)


def describe(name: str) -> str:
    return " ".join(str(_document(name)["description"]).split())


def load(name: str) -> NameMap:
    """The preset's name map; UsageError naming the presets when there is none of that name."""
    from ckpt_cli.core.training import NameMap

    doc = _document(name)
    return NameMap.from_data({k: v for k, v in doc.items() if k not in _KEYS}, f"preset {name}")


def suggest(ckpt: Checkpoint) -> str | None:
    """The preset whose layout the checkpoint's tensor names show, if exactly one does."""
    fits = [n for n in names() if _fits(_document(n), list(ckpt.tensors))]
    return fits[0] if len(fits) == 1 else None


def _fits(doc: dict[str, Any], tensors: list[str]) -> bool:
    unless = doc.get("unless")
    if unless and any(re.fullmatch(unless, t) for t in tensors):
        return False
    return bool(doc.get("detect")) and any(re.fullmatch(doc["detect"], t) for t in tensors)
