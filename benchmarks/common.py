"""Measure one command: wall time and peak memory of its whole process tree.

- Peak RSS: GNU `/usr/bin/time -f %M` (wait4's rusage: the peak resident set of the largest process
  of the command's tree; every waited-for descendant counts). Exact, and `time` itself is a small C
  program, so a tiny command (`cp`) shows ~2 MB, not the image of a Python wrapper.
- Tree PSS: every SAMPLE_S, the sum of the proportional set sizes (shared pages split between the
  processes that share them) of every process of the tree, the largest sum seen: the memory of a
  command that runs several processes at once (DeepSpeed's `ds_to_universal` worker pool), which
  the peak RSS of its largest process understates. Sampled, so a peak shorter than SAMPLE_S may be
  missed; used only to flag such commands.
- Wall: around the command alone, taken by this process, which waits in its main thread while a
  second thread samples.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

SAMPLE_S = 0.2
TIME = "/usr/bin/time"


@dataclass
class Measure:
    wall: float  # seconds: median of the runs
    walls: list[float]  # seconds: every run
    peak_rss: int  # bytes: the largest process of the tree, largest of the runs (exact)
    tree_pss: int  # bytes: sum over the tree's processes at once (sampled), largest of the runs
    processes: int  # most processes of the tree seen at once


def measure(cmd: list[str], repeat: int, prepare: Callable[[], None], env: dict[str, str] | None = None) -> Measure:
    """Median wall time and largest peak memory of `repeat` runs, each after `prepare()` and a `sync`."""
    if not shutil.which(TIME):
        raise SystemExit(f"{TIME} (GNU time) is needed to measure peak RSS: apt-get install time")
    runs = []
    for _ in range(repeat):
        prepare()
        os.sync()
        runs.append(_measure_once(cmd, env))
    walls = [m.wall for m in runs]
    return Measure(
        wall=sorted(walls)[len(walls) // 2],
        walls=walls,
        peak_rss=max(m.peak_rss for m in runs),
        tree_pss=max(m.tree_pss for m in runs),
        processes=max(m.processes for m in runs),
    )


def _measure_once(cmd: list[str], env: dict[str, str] | None) -> Measure:
    with tempfile.NamedTemporaryFile("w+", suffix=".time") as result, tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen([TIME, "-f", "%M", "-o", result.name, *cmd], stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        done = threading.Event()
        sampled = {"tree_pss": 0, "processes": 1}
        sampler = threading.Thread(target=_sample, args=(proc.pid, done, sampled), daemon=True)
        sampler.start()
        returncode = proc.wait()
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
        if returncode != 0:
            stderr.seek(0)
            tail = "\n".join(stderr.read().strip().splitlines()[-30:])
            raise SystemExit(f"failed (exit {returncode}): {' '.join(cmd)}\n{tail}")
        peak_kb = int(Path(result.name).read_text().split()[-1])
    return Measure(wall, [wall], peak_kb * 1024, sampled["tree_pss"], sampled["processes"])


def _sample(pid: int, done: threading.Event, sampled: dict[str, int]) -> None:
    """Until `done`: the largest sum of PSS over the descendants of `pid` (the `time` process itself excluded)."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    while not done.is_set():
        try:
            pids = [child.pid for child in root.children(recursive=True)]
        except psutil.Error:
            pids = []
        sampled["tree_pss"] = max(sampled["tree_pss"], sum(_pss(p) for p in pids))
        sampled["processes"] = max(sampled["processes"], len(pids))
        done.wait(SAMPLE_S if pids else 0.01)  # quickly at first: `time` has not started the command yet


def _pss(pid: int) -> int:
    """Proportional set size of one process in bytes (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure_rows(
    rows: list[tuple[str, list, Path]], repeat: int, env: dict[str, str] | None = None, sizes: bool = False
) -> dict[str, Measure]:
    """Each (label, command, output) measured in turn, its output removed before each run, and printed as a line
    (wall, peak RSS and, with `sizes`, the output's size)."""
    width = max(len(label) for label, _, _ in rows)
    results = {}
    for label, cmd, out in rows:
        m = measure([str(c) for c in cmd], repeat, lambda out=out: remove(out), env=env)
        results[label] = m
        size = f"  out {du(out) / 1e9:.2f} GB" if sizes else ""
        print(f"  {label:{width}s} {m.wall:7.1f} s  {m.peak_rss / 1e6:7.0f} MB{size}", flush=True)
    return results


def print_ratios(results: dict[str, Measure], name: str = "ckpt") -> None:
    """The first row's time and peak RSS over each other row's."""
    base, *others = results.items()
    for label, m in others:
        print(f"  {name} / {label}: time {base[1].wall / m.wall:.2f}x, peak RSS {base[1].peak_rss / m.peak_rss:.2f}x")


def remove(path: Path) -> None:
    """Delete a file or a folder if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def du(path: Path) -> int:
    """Bytes of the files at `path` (a file or a folder)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


_COMPARE = """\
import sys, torch
from pathlib import Path
from safetensors.torch import load_file
def tensors(folder):
    out = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
print("bit-equal" if same else "DIFFERENT")
"""


def same_tensors(a: Path, b: Path) -> str:
    """'bit-equal' when two folders of safetensors files hold the same tensors (names, dtypes, bytes), else
    'DIFFERENT' (in a fresh process: the benchmark's own memory is not what is measured)."""
    done = subprocess.run([sys.executable, "-c", _COMPARE, str(a), str(b)], capture_output=True, text=True, check=True)
    return done.stdout.strip()
