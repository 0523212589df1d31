"""Helpers shared by the benchmarks: run a command, measure its wall time and peak RSS, print ratios."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# A fresh wrapper process per measurement: RUSAGE_CHILDREN's maxrss is then exactly the peak
# resident set of the measured command's process tree (the largest process in it).
_WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:]).returncode\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


@dataclass
class Measure:
    label: str
    wall: float  # seconds, median of the runs
    peak_rss: int  # bytes, largest of the runs


def measure(label: str, cmd: list[str], repeat: int = 1, before: list[str] | None = None) -> Measure:
    """Median wall time and largest peak RSS of `repeat` runs; `sync` first so earlier writes do not interfere."""
    runs = []
    for _ in range(repeat):
        if before:
            subprocess.run(before, check=True)
        os.sync()
        runs.append(_measure_once(label, cmd))
    walls = sorted(m.wall for m in runs)
    return Measure(label, walls[len(walls) // 2], max(m.peak_rss for m in runs))


def _measure_once(label: str, cmd: list[str]) -> Measure:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{proc.stderr}")
    peak_kb = int(proc.stderr.strip().splitlines()[-1])
    return Measure(label, wall, peak_kb * 1024)


def table(rows: list[tuple[Measure, list[tuple[str, Measure]]]]) -> str:
    """One line per measurement: wall, peak RSS, then `wall ratio` (and RSS ratio) against each reference."""
    lines = [f"{'operation':<48} {'wall':>8} {'peak RSS':>10}   ratios (time; RSS)"]
    for m, refs in rows:
        ratios = "  ".join(f"{m.wall / r.wall:5.2f}x; {m.peak_rss / r.peak_rss:5.2f}x vs {name}" for name, r in refs)
        lines.append(f"{m.label:<48} {m.wall:7.2f}s {m.peak_rss / 1e6:7.0f} MB   {ratios}")
    return "\n".join(lines)


def fresh(path: Path) -> Path:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    return path


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
