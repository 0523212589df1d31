"""The docs' examples run as a newcomer's machine would have them: with only what the README's Try it command installs.

tests/test_readme.py puts this folder on PYTHONPATH and names, in TOUR_BLOCKED_MODULES, the top-level modules that
only the test extra brings (transformers, deepspeed, s3fs, ...). Each is marked absent in sys.modules (None): importing
it raises ModuleNotFoundError and importlib.util.find_spec answers None, as on that machine, so an example that needs
more than Try it installs fails its test unless its block names the extra it needs.
"""

from __future__ import annotations

import os
import sys

for _name in filter(None, os.environ.get("TOUR_BLOCKED_MODULES", "").split(",")):
    sys.modules.setdefault(_name, None)  # type: ignore[assignment]
