"""The docs' examples run as a newcomer's machine would have them: with only what the README's Try it command installs.

tests/test_readme.py puts this folder on PYTHONPATH and names, in TOUR_BLOCKED_MODULES, the top-level modules that
only the test extra brings (transformers, deepspeed, s3fs, ...). Importing one of them fails here as it would on that
machine, so an example that needs more than Try it installs fails its test unless its block names the extra it needs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

BLOCKED = frozenset(filter(None, os.environ.get("TOUR_BLOCKED_MODULES", "").split(",")))


class NotInstalled:
    """A meta path finder that answers 'no such module' for the blocked top-level names."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if BLOCKED:
    sys.meta_path.insert(0, NotInstalled())
