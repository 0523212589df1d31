"""The install the README gives resolves without backtracking through releases: pip fetches one release of each
package (an open range met before a pin makes pip download a second botocore, a 16 MB wheel, and can send it
backtracking for many minutes)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict

import pytest
from test_readme import ROOT

# A wheel's or sdist's file name as pip's verbose log names it when it fetches one: name-version(-tags).whl / .tar.gz
FETCHED = re.compile(
    r"(?:Downloading|Using cached|File was already downloaded)\s+(?:\S*/)?([A-Za-z0-9_.]+)-([0-9][^-\s]*?)(?:-[^\s]*)?\.(?:whl|tar\.gz|zip)"
)


def fetched_releases(log: str) -> dict[str, set[str]]:
    releases: dict[str, set[str]] = defaultdict(set)
    for name, version in FETCHED.findall(log):
        releases[name.lower().replace("_", "-").replace(".", "-")].add(version)
    return releases


def test_fetched_releases_parses_pips_log():
    log = "  Downloading botocore-1.43.127-py3-none-any.whl (16.3 MB)\n  Using cached s3fs-2026.9.0-py3-none-any.whl (33 kB)\n"
    log += "  Downloading botocore-1.43.117-py3-none-any.whl (16.1 MB)\n  Downloading pyyaml-6.0.4.tar.gz (130 kB)\n"
    assert fetched_releases(log) == {"botocore": {"1.43.127", "1.43.117"}, "s3fs": {"2026.9.0"}, "pyyaml": {"6.0.4"}}


@pytest.mark.slow
@pytest.mark.parametrize("extras", ["test", "s3,azure", "parity"])
def test_pip_fetches_one_release_of_each_package(extras, tmp_path):
    """`pip install -e '.[EXTRAS]'` as the README gives it, resolved (--dry-run) into an empty target: no package is
    fetched in two releases. pip's build environment for the editable install is left out (setuptools may appear twice:
    once to build, once as a dependency)."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-v", "--no-build-isolation"]
    cmd += ["torch==2.13.0", "-e", f".[{extras}]"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    twice = {name: sorted(v) for name, v in fetched_releases(proc.stdout).items() if len(v) > 1}
    assert not twice, f"pip fetched several releases of {twice}: pin the package in the extra that names the open range"
