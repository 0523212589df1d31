"""Beyond RAM: every writing command on a checkpoint larger than the memory it may use, against `cp -r` + `sync` of
the same bytes under the same limit, in one run.

    python benchmarks/beyond_ram.py [--size 8] [--limit 1G] [--repeat 2] [--workdir /tmp/ckpt-beyond] [--json out.json]

The source: a Hugging Face folder of float32 shards of about --size GB (10^9 bytes; tensors of 64 KB to 80 MB,
cycling, as benchmarks/hf_build.py makes them; shards of SHARD written one at a time, so building it needs no more
memory than one shard). Made from it once, untimed: the folder merged into one file (the source of `split`) and
converted to DCP at 4 ranks (the source of `reshard`).

Timed, alternating with their reference in each round, --repeat rounds:

  convert --to dcp --world-size 4   hf folder -> DCP             reference: cp -r of the hf folder + sync
  merge                             hf folder -> one file        reference: the same cp -r + sync
  split --max-shard-size SHARD      the merged file -> a folder  reference: cp of the merged file + sync
  reshard --world-size 3            the DCP at 4 -> 3 ranks      reference: cp -r of the DCP folder + sync

Each run starts cold: its output removed, `sync`, the source's pages dropped from the page cache
(posix_fadvise DONTNEED, file by file: nothing else's cache is touched). Under --limit, each run is its own child
memory cgroup of the cgroup this script runs in (page cache counted: a conversion on a box smaller than the
checkpoint), created for the run and removed after it; where no child cgroup can be made (no memory controller, no
permission), the runs go unlimited and one line says so. Wall time and peak RSS (GNU time: the largest process) as in
common.py; each command's ratio to its reference in the same round, then the median and spread of those ratios.
Targets (issue 53): every ratio <= 1.15, peak RSS <= 100 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from common import du, measure, remove

PY = sys.executable
CKPT = [PY, "-m", "ckpt_cli"]
SHARD = "1GB"
ELEMENTS = [2**14, 2**18, 2**20, 3 * 2**20, 2**22, 2**24, 5 * 2**22]  # fp32 tensors of 64 KB to 80 MB
RATIO_MAX, RSS_MAX = 1.15, 100e6


@dataclass
class Row:
    key: str
    command: str
    reference: str
    walls_s: list[float]
    reference_walls_s: list[float]
    ratios: list[float]
    peak_rss_bytes: int
    bytes_moved: int
    loads: list[float]  # the 1-minute load average after each round (a shared machine: what the ratios ran under)


def build(folder: Path, size: float, shard_bytes: int) -> None:
    """A sharded hf folder (`model-0000k-of-0000n.safetensors` + index) of about `size` GB, one shard in memory at once."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    total_bytes, i, shards = int(size * 1e9), 0, []
    written = 0
    while written < total_bytes:
        shard: dict[str, torch.Tensor] = {}
        held = 0
        while held < shard_bytes and written + held < total_bytes:
            n = min(ELEMENTS[i % len(ELEMENTS)], max((total_bytes - written - held) // 4, 1))
            shard[f"layers.{i}.weight"] = torch.randn(n)
            held += n * 4
            i += 1
        shards.append(shard)
        written += held
        save_file(shard, str(folder / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
        shards[-1] = {name: None for name in shard}  # the names alone, for the index
    count, weight_map = len(shards), {}
    for k, names in enumerate(shards, 1):
        final = f"model-{k:05d}-of-{count:05d}.safetensors"
        (folder / f"part-{k}.safetensors").rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": written}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def shard_bytes(spec: str) -> int:
    units = {"GB": 10**9, "MB": 10**6}
    return int(float(spec[:-2]) * units[spec[-2:]])


# ---- the memory limit ------------------------------------------------------------------------------------------


def own_memory_cgroup() -> Path | None:
    """The folder of this process's memory cgroup: cgroup v1's memory hierarchy, else the v2 unified one."""
    v1 = v2 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        elif controllers == "":
            v2 = Path("/sys/fs/cgroup") / path.lstrip("/")
    return v1 if v1 is not None and v1.is_dir() else v2 if v2 is not None and v2.is_dir() else None


class Limit:
    """A fresh child memory cgroup per run (`enter()` gives the argv prefix that moves the command into it), removed
    after; `reason` says why there is none."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.reason, self.current = limit, "", None
        self.parent = own_memory_cgroup() if limit else None
        if limit and self.parent is None:
            self.reason = "no memory cgroup found for this process"
        elif limit:
            try:  # one probe, removed at once
                self.current = self._make()
            except OSError as exc:
                self.reason = f"cannot make a child memory cgroup of {self.parent} ({exc.strerror})"
            finally:
                self.leave()

    @property
    def active(self) -> bool:
        return bool(self.limit) and not self.reason

    def _make(self) -> Path:
        assert self.parent is not None and self.limit
        child = self.parent / f"ckpt-beyond-ram-{os.getpid()}"
        child.mkdir()
        self.current = child
        v1 = (child / "memory.limit_in_bytes").exists()
        (child / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(self.limit))
        if not v1:
            (child / "memory.swap.max").write_text("0")
        return child

    def enter(self) -> list[str]:
        if not self.active:
            return []
        child = self._make()
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(child)]

    def leave(self) -> None:
        """Remove the run's cgroup (its command has exited: the cgroup is empty), its page cache going to the parent."""
        child, self.current = self.current, None
        if child is None or not child.exists():
            return
        if (child / "memory.force_empty").exists():
            try:
                (child / "memory.force_empty").write_text("0")
            except OSError:
                pass
        child.rmdir()


def evict(path: Path) -> None:
    """Drop the file's (or the folder's files') clean pages from the page cache: the next read comes from the disk."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# As installed: compiled modules cached (pip compiles them at install; some shells set this off: 0.6 s a command)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str], src: Path, out: Path, limit: Limit) -> tuple[float, int]:
    def prepare() -> None:
        remove(out)
        os.sync()
        evict(src)

    prefix = limit.enter()
    try:
        m = measure([*prefix, *argv], 1, prepare, ENV)
    finally:
        limit.leave()
    remove(out)
    return m.wall, m.peak_rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=8.0, help="GB of float32 tensors (10^9 bytes)")
    parser.add_argument("--limit", default="1G", help="memory limit per run (page cache counted): 1G, 256M; 0 for none")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-beyond"))
    parser.add_argument("--only", default="convert,merge,split,reshard")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    scale = {"G": 1 << 30, "M": 1 << 20}
    limit_bytes = int(float(args.limit[:-1]) * scale[args.limit[-1]]) if args.limit not in ("0", "") else None
    work, tag = args.workdir, f"{args.size:g}gb"
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # `python -m ckpt_cli` puts the working folder first on sys.path: not a checkout's
    hf, merged, dcp, scratch = work / f"hf-{tag}", work / f"merged-{tag}.safetensors", work / f"dcp4-{tag}", work / "out"
    if not (work / f"hf-{tag}.built").exists():
        remove(hf)
        hf.mkdir()
        print(f"building {hf} (not timed) ...", file=sys.stderr, flush=True)
        build(hf, args.size, shard_bytes(SHARD))
        (work / f"hf-{tag}.built").touch()
    measure([*CKPT, "--help"], 1, lambda: None, ENV)  # its modules compiled and cached before anything is timed
    only = args.only.split(",")
    if "split" in only and not merged.exists():
        measure([*CKPT, "merge", str(hf), str(merged), "-q"], 1, lambda: None, ENV)
    if "reshard" in only and not (dcp / ".metadata").exists():
        remove(dcp)
        measure([*CKPT, "convert", str(hf), str(dcp), "--to", "dcp", "--world-size", "4", "-q"], 1, lambda: None, ENV)
    limit = Limit(limit_bytes)
    if limit_bytes and not limit.active:
        print(f"no memory limit: {limit.reason}; the runs below are unlimited", flush=True)
    elif limit.active:
        print(f"memory limit {args.limit} (page cache counted): a child cgroup of {limit.parent} per run", flush=True)
    scratch.mkdir(exist_ok=True)
    copy = scratch / "copy"
    cp_sync = 'cp -r "$0" "$1" && sync'

    def task(label: str, src: Path, out: Path, *args: str) -> tuple[str, Path, list[str], Path]:
        return label, src, [*CKPT, args[0], str(src), str(out), *args[1:], "-q"], out

    tasks = {
        "convert": task(
            f"ckpt convert --to dcp --world-size 4 ({tag} hf)", hf, scratch / "dcp", "convert", "--to", "dcp", "--world-size", "4"
        ),
        "merge": task(f"ckpt merge ({tag} hf)", hf, scratch / "merged.safetensors", "merge"),
        "split": task(
            f"ckpt split --max-shard-size {SHARD} (one {tag} file)", merged, scratch / "split", "split", "--max-shard-size", SHARD
        ),
        "reshard": task(f"ckpt reshard --world-size 3 ({tag} DCP at 4)", dcp, scratch / "r3", "reshard", "--world-size", "3"),
    }
    rows = []
    for key in only:
        label, src, argv, out = tasks[key]
        walls, refs, loads, rss = [], [], [], 0
        for _ in range(args.repeat):  # the reference and the command alternate: the machine's drift hits both
            ref, _ = timed(["sh", "-c", cp_sync, str(src), str(copy)], src, copy, limit)
            wall, peak = timed(argv, src, out, limit)
            refs.append(ref)
            walls.append(wall)
            rss = max(rss, peak)
            loads.append(os.getloadavg()[0])
            print(
                f"{key}: {wall:.1f} s vs cp -r + sync {ref:.1f} s ({wall / ref:.2f}x), {peak / 1e6:.0f} MB, load {loads[-1]:.1f}",
                file=sys.stderr,
                flush=True,
            )
        rows.append(Row(key, label, "cp -r + sync", walls, refs, [w / r for w, r in zip(walls, refs)], rss, du(src), loads))
    print(f"\n{'command':52} {'wall s':>14} {'cp+sync s':>14} {'ratio':>14} {'RSS MB':>7} {'load':>9}")
    for r in rows:
        ratios = sorted(r.ratios)
        spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if len(ratios) > 1 else f"{ratios[0]:.2f}"
        walls = "/".join(f"{w:.1f}" for w in r.walls_s)
        refs = "/".join(f"{w:.1f}" for w in r.reference_walls_s)
        load = "/".join(f"{x:.1f}" for x in r.loads)
        print(f"{r.command:52} {walls:>14} {refs:>14} {spread:>14} {r.peak_rss_bytes / 1e6:>7.0f} {load:>9}")
    misses = [f"{r.key}: {max(r.ratios):.2f}x > {RATIO_MAX}x" for r in rows if max(r.ratios) > RATIO_MAX]
    misses += [f"{r.key}: {r.peak_rss_bytes / 1e6:.0f} MB > {RSS_MAX / 1e6:.0f} MB" for r in rows if r.peak_rss_bytes > RSS_MAX]
    print(
        f"\ntargets: ratio <= {RATIO_MAX}x cp -r + sync, peak RSS <= {RSS_MAX / 1e6:.0f} MB: "
        + ("met" if not misses else "; ".join(misses))
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
