"""ckpt beside the tools a user would otherwise run, on synthetic checkpoints of each format, in one run.

    python benchmarks/run.py --sizes 1,4 [--repeat 3] [--json out.json] [--workdir /tmp/ckpt-bench]
                             [--only safetensors,hf,dcp,deepspeed2,deepspeed3] [--no-peers] [--no-workers]

For each size (GB on disk) it builds once, and reuses from WORKDIR afterwards (builds are never timed):

  safetensors  one .safetensors file of fp32 tensors from 64 KB to 256 MB (hf_build.py)
  hf           the same tensors as a Hugging Face sharded folder, 250MB shards (hf_build.py)
  dcp          a DCP checkpoint saved by real FSDP2 + AdamW on 2 ranks (fsdp2_build.py)
  deepspeed2   a ZeRO-2 fp32 checkpoint saved by real DeepSpeed + AdamW on 2 ranks (deepspeed_build.py)
  deepspeed3   the same at ZeRO-3
  deepspeed_moe  ZeRO-2 with deepspeed.moe.layer.MoE layers (8 experts, ep_size 2) on 2 ranks (deepspeed_build.py moe):
               reshards keeping ep_size and changing it (2 -> 1) beside each other; DeepSpeed's own tools
               cannot read native MoE, so the floor is cp

and times, on each source, `ckpt inspect`, `ckpt verify --deep` (and with `--finite`: held to 1.5x of
`--deep`), the conversions that start from it
(split, merge, convert, reshard) and, beside each conversion, the peer a user would otherwise run on
the same input (a full load + save with safetensors / huggingface_hub, torch's dcp_to_torch_save,
DeepSpeed's zero_to_fp32.py and ds_to_universal), and `cp -r` of the source, without and with a
`sync` (ckpt fsyncs what it writes): the physical floor. On the safetensors file, `ckpt diff` against
the hf folder of the same tensors (identical bytes: compared as bytes) and against a bf16 copy made
by `ckpt convert --dtype bf16` before each run, untimed (every value compared, --rtol 1e-2).

Every run: the previous output removed, the input read once with `cat` (warm page cache, the same
for every tool), `sync`; wall time is the median of --repeat runs, peak RSS the largest (see
common.py for how it is measured). Then, if several sizes were given, the RSS of every ckpt
operation at the largest size over the smallest (target <= 1.15), and for the operations that
write several files, `--workers 1` against `--workers 2`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common import Measure, du, measure, remove

HERE = Path(__file__).resolve().parent
PY = sys.executable
CKPT = [PY, "-m", "ckpt_cli"]
GROUPS = ("safetensors", "hf", "dcp", "deepspeed2", "deepspeed3", "deepspeed_moe")
BUILDS = {"safetensors": "hf", "hf": "hf", "dcp": "dcp", "deepspeed2": "zero2", "deepspeed3": "zero3", "deepspeed_moe": "zero2moe"}
SHARD = "250MB"  # hf shards: of the built folder, and of `ckpt split`
EXPORT_SHARD = "200MB"  # `ckpt convert` DCP -> hf: several shards, so that --workers has files to share
RSS_FLAT, RSS_MAX, CP_MAX = 1.15, 500e6, 1.3  # the targets
FINITE_MAX = 1.5  # verify --finite (alone or with --deep) over verify --deep: the NaN/Inf count rides the same read
CP_BOUND = ("split", "merge", "convert", "reshard")  # operations held to CP_MAX x cp -r

NAIVE_SPLIT = """\
import os, sys
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
os.makedirs(sys.argv[2])
save_torch_state_dict(load_file(sys.argv[1]), sys.argv[2], max_shard_size=sys.argv[3])
"""
NAIVE_MERGE = """\
import glob, sys
from safetensors.torch import load_file, save_file
sd = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    sd.update(load_file(f))
save_file(sd, sys.argv[2], metadata={"format": "pt"})
"""
DCP_TO_TORCH = """\
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""
DCP_TO_HF = """\
import os, sys, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
os.makedirs(sys.argv[2])
dcp_to_torch_save(sys.argv[1], sys.argv[2] + "/full.pt")
sd = torch.load(sys.argv[2] + "/full.pt", weights_only=False)
os.remove(sys.argv[2] + "/full.pt")
save_file(sd["model"], sys.argv[2] + "/model.safetensors")
"""


@dataclass
class Task:
    """One command timed on one source."""

    key: str  # unique within its group
    label: str
    kind: str  # "floor" (cp), "ckpt", "peer"
    argv: list[str]
    out: Path | None = None  # what it writes (removed before every run)
    peer: str | None = None  # key of the peer task, for ckpt tasks
    multi_file: bool = False  # writes several files: also timed at --workers 1 and 2
    setup: list[str] | None = None  # run before each timed run, not timed (makes what the command compares against)


@dataclass
class Row:
    group: str
    key: str
    label: str
    kind: str
    size_gb: float
    workers: int | None  # --workers K given explicitly; None: ckpt's default
    input_bytes: int
    output_bytes: int
    output_files: int
    wall_s: float
    walls_s: list[float]
    peak_rss_bytes: int
    tree_pss_bytes: int
    processes: int
    command: str
    peer: str | None = None  # key of the peer's row, for ckpt rows
    vs_peer_time: float | None = None
    vs_peer_rss: float | None = None
    vs_cp: float | None = None
    vs_cp_sync: float | None = None
    vs_deep: float | None = None  # verify --finite rows: wall over that of verify --deep


def gb_tag(size: float) -> str:
    return f"{size:g}GB"


def source(work: Path, group: str, size: float) -> Path:
    tag = gb_tag(size)
    return {
        "safetensors": work / f"model-{tag}.safetensors",
        "hf": work / f"hf-{tag}",
        "dcp": work / f"dcp-{tag}",
        "deepspeed2": work / f"zero2-{tag}",
        "deepspeed3": work / f"zero3-{tag}",
        "deepspeed_moe": work / f"zero2moe-{tag}",
    }[group]


def tasks(group: str, src: Path, out: Path) -> list[Task]:
    """What is timed on one source, in table order; `out` is a scratch folder for the outputs."""
    o = out / group
    copy = o / "copy"
    rows = [
        Task("cp", "cp -r (floor)", "floor", ["cp", "-r", str(src), str(copy)], copy),
        Task("cp_sync", "cp -r + sync (floor)", "floor", ["sh", "-c", 'cp -r "$0" "$1" && sync', str(src), str(copy)], copy),
        Task("inspect", "ckpt inspect", "ckpt", [*CKPT, "inspect", str(src)]),
        Task("verify", "ckpt verify --deep", "ckpt", [*CKPT, "verify", "--deep", str(src)]),
        Task("verify_finite", "ckpt verify --finite", "ckpt", [*CKPT, "verify", "--finite", str(src)]),
        Task("verify_finite_deep", "ckpt verify --deep --finite", "ckpt", [*CKPT, "verify", "--deep", "--finite", str(src)]),
    ]
    if group == "safetensors":
        hf = src.with_name(src.name.replace("model-", "hf-", 1).removesuffix(".safetensors"))  # built beside it
        bf16 = o / "bf16.safetensors"
        rows += [
            Task("diff", "ckpt diff (the same tensors as an hf folder)", "ckpt", [*CKPT, "diff", str(src), str(hf)]),
            Task(
                "diff_bf16",
                "ckpt diff --rtol 1e-2 (a bf16 copy: every value compared)",
                "ckpt",
                [*CKPT, "diff", str(src), str(bf16), "--rtol", "1e-2"],
                setup=[*CKPT, "convert", str(src), str(bf16), "--to", "safetensors", "--dtype", "bf16", "--overwrite", "-q"],
            ),
            Task(
                "split",
                f"ckpt split --max-shard-size {SHARD}",
                "ckpt",
                [*CKPT, "split", str(src), str(o / "split"), "--max-shard-size", SHARD, "-q"],
                o / "split",
                peer="naive_split",
                multi_file=True,
            ),
            Task(
                "naive_split",
                "peer: load_file + save_torch_state_dict",
                "peer",
                [PY, "-c", NAIVE_SPLIT, str(src), str(o / "naive_split"), SHARD],
                o / "naive_split",
            ),
        ]
    elif group == "hf":
        rows += [
            Task(
                "merge",
                "ckpt merge",
                "ckpt",
                [*CKPT, "merge", str(src), str(o / "merged.safetensors"), "-q"],
                o / "merged.safetensors",
                "naive_merge",
            ),
            Task(
                "naive_merge",
                "peer: load every shard + save_file",
                "peer",
                [PY, "-c", NAIVE_MERGE, str(src), str(o / "naive.safetensors")],
                o / "naive.safetensors",
            ),
        ]
    elif group == "dcp":
        hf, resharded = o / "hf", o / "resharded"
        rows += [
            Task(
                "convert",
                f"ckpt convert --to hf --weights-only ({EXPORT_SHARD} shards)",
                "ckpt",
                [
                    *CKPT,
                    "convert",
                    str(src),
                    str(hf),
                    "--to",
                    "hf",
                    "--weights-only",
                    "--strip-prefix",
                    "model.",
                    "--max-shard-size",
                    EXPORT_SHARD,
                    "-q",
                ],
                hf,
                peer="to_hf",
                multi_file=True,
            ),
            Task(
                "to_hf",
                "peer: dcp_to_torch_save + torch.load + save_file",
                "peer",
                [PY, "-c", DCP_TO_HF, str(src), str(o / "peer_hf")],
                o / "peer_hf",
            ),
            Task(
                "reshard3",
                "ckpt reshard --world-size 3",
                "ckpt",
                [*CKPT, "reshard", str(src), str(resharded), "--world-size", "3", "-q"],
                resharded,
                peer="to_torch",
                multi_file=True,
            ),
            Task("to_torch", "peer: dcp_to_torch_save", "peer", [PY, "-c", DCP_TO_TORCH, str(src), str(o / "peer.pt")], o / "peer.pt"),
            Task(
                "convert_to_deepspeed",
                "ckpt convert --to deepspeed --zero-stage 2 --world-size 3",
                "ckpt",
                [*CKPT, "convert", str(src), str(o / "ds"), "--to", "deepspeed", "--zero-stage", "2", "--world-size", "3", "-q"],
                o / "ds",
                peer="to_torch",
                multi_file=True,
            ),
        ]
    elif group == "deepspeed_moe":
        rows += [
            Task(
                "merge",
                "ckpt merge (fp32 weights -> safetensors)",
                "ckpt",
                [*CKPT, "merge", str(src), str(o / "w.safetensors"), "-q"],
                o / "w.safetensors",
            ),
            Task(
                "reshard4",
                "ckpt reshard --world-size 4 (ep_size 2 kept)",
                "ckpt",
                [*CKPT, "reshard", str(src), str(o / "r4"), "--world-size", "4", "-q"],
                o / "r4",
                multi_file=True,
            ),
            Task(
                "reshard1_ep1",
                "ckpt reshard --world-size 1 (ep_size 2 -> 1)",
                "ckpt",
                [*CKPT, "reshard", str(src), str(o / "r1"), "--world-size", "1", "-q"],
                o / "r1",
            ),
            Task(
                "reshard4_ep4",
                "ckpt reshard --world-size 4 --ep-size 4 (ep_size 2 -> 4)",
                "ckpt",
                [*CKPT, "reshard", str(src), str(o / "r4e4"), "--world-size", "4", "--ep-size", "4", "-q"],
                o / "r4e4",
                multi_file=True,
            ),
        ]
    else:  # deepspeed2, deepspeed3
        tag = (src / "latest").read_text().strip()
        universal = o / "universal"
        rows += [
            Task(
                "merge",
                "ckpt merge (fp32 weights -> safetensors)",
                "ckpt",
                [*CKPT, "merge", str(src), str(o / "weights.safetensors"), "-q"],
                o / "weights.safetensors",
                peer="zero_to_fp32",
            ),
            Task(
                "zero_to_fp32",
                "peer: zero_to_fp32.py --safe_serialization",
                "peer",
                [PY, str(src / "zero_to_fp32.py"), str(src), str(o / "z2f"), "--safe_serialization"],
                o / "z2f",
            ),
            Task(
                "reshard1",
                "ckpt reshard --world-size 1",
                "ckpt",
                [*CKPT, "reshard", str(src), str(o / "r1"), "--world-size", "1", "-q"],
                o / "r1",
                peer="universal",
            ),
            Task(
                "reshard3",
                "ckpt reshard --world-size 3",
                "ckpt",
                [*CKPT, "reshard", str(src), str(o / "r3"), "--world-size", "3", "-q"],
                o / "r3",
                peer="universal",
                multi_file=True,
            ),
            Task(
                "convert_to_dcp",
                "ckpt convert --to dcp --world-size 3 (training state)",
                "ckpt",
                [*CKPT, "convert", str(src), str(o / "dcp"), "--to", "dcp", "--world-size", "3", "-q"],
                o / "dcp",
                peer="universal",
                multi_file=True,
            ),
            Task(
                "universal",
                "peer: ds_to_universal --inject_missing_state",
                "peer",
                [
                    *(PY, "-m", "deepspeed.checkpoint.ds_to_universal"),
                    *("--input_folder", str(src / tag), "--output_folder", str(universal / tag), "--inject_missing_state"),
                ],
                universal,
            ),
        ]
    return rows


# ---------------------------------------------------------------------------------------------- builds


def build(work: Path, name: str, size: float) -> None:
    """Build checkpoint `name` ("hf", "dcp", "zero2", "zero3") of `size` GB into `work`, unless built already."""
    tag = gb_tag(size)
    marker = work / f"{name}-{tag}.built"
    if marker.exists():
        return
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if name == "hf":
        outputs = [work / f"model-{tag}.safetensors", work / f"hf-{tag}"]
        cmd = [PY, str(HERE / "hf_build.py"), *map(str, outputs), str(size), SHARD]
    elif name == "dcp":
        outputs = [work / f"dcp-{tag}"]
        cmd = [*torchrun, str(HERE / "fsdp2_build.py"), str(outputs[0]), str(size)]
    else:
        outputs = [work / f"{name}-{tag}"]
        cmd = [*torchrun, str(HERE / "deepspeed_build.py"), str(outputs[0]), str(size), {"zero2moe": "moe"}.get(name, name[-1])]
    for path in outputs:
        remove(path)
    scratch = work / "tmp"  # torchrun's and DeepSpeed's temporary files, removed with the workdir
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    log = work / f"{name}-{tag}.build.log"
    print(f"building {name} {tag} (not timed) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"building {name} {tag} failed (exit {rc}); log: {log}\n{tail}")
    seconds = time.perf_counter() - start
    marker.write_text(json.dumps({"cmd": shlex.join(cmd), "seconds": seconds, "bytes": sum(du(p) for p in outputs)}))


# ----------------------------------------------------------------------------------------- measuring


def warm(path: Path) -> None:
    """Read every file of `path` once, so that every tool starts from the same warm page cache."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)


def run_task(task: Task, group: str, src: Path, size: float, repeat: int, workers: int | None = None) -> Row:
    argv = task.argv + (["--workers", str(workers)] if workers else [])

    def prepare() -> None:
        if task.out:
            remove(task.out)
            task.out.parent.mkdir(parents=True, exist_ok=True)
        if task.setup:
            subprocess.run(task.setup, stdout=subprocess.DEVNULL, check=True, env=env)
        warm(src)

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    m: Measure = measure(argv, repeat, prepare, env)
    out_bytes = du(task.out) if task.out else 0
    out_files = (sum(1 for p in task.out.rglob("*") if p.is_file()) if task.out.is_dir() else 1) if task.out and task.out.exists() else 0
    if task.out:
        remove(task.out)
    return Row(
        group=group,
        key=task.key,
        label=task.label,
        kind=task.kind,
        size_gb=size,
        workers=workers,
        input_bytes=du(src),
        output_bytes=out_bytes,
        output_files=out_files,
        wall_s=m.wall,
        walls_s=m.walls,
        peak_rss_bytes=m.peak_rss,
        tree_pss_bytes=m.tree_pss,
        processes=m.processes,
        command=shlex.join(argv),
        peer=task.peer,
    )


def add_ratios(rows: list[Row]) -> None:
    by = {(r.group, r.key, r.size_gb): r for r in rows if r.workers is None}
    for r in rows:
        if r.kind != "ckpt" or r.workers is not None:
            continue
        peer = by.get((r.group, r.peer, r.size_gb)) if r.peer else None
        if peer:
            r.vs_peer_time = r.wall_s / peer.wall_s
            r.vs_peer_rss = r.peak_rss_bytes / peer.peak_rss_bytes
        if r.key.startswith(CP_BOUND):
            cp, cp_sync = by.get((r.group, "cp", r.size_gb)), by.get((r.group, "cp_sync", r.size_gb))
            r.vs_cp = r.wall_s / cp.wall_s if cp else None
            r.vs_cp_sync = r.wall_s / cp_sync.wall_s if cp_sync else None
        deep = by.get((r.group, "verify", r.size_gb))
        if r.key.startswith("verify_finite") and deep:
            r.vs_deep = r.wall_s / deep.wall_s


# ------------------------------------------------------------------------------------------ printing


@dataclass
class Flatness:
    group: str
    key: str
    label: str
    rss_small_bytes: int
    rss_large_bytes: int
    ratio: float


@dataclass
class Speedup:
    group: str
    key: str
    label: str
    size_gb: float
    files: int
    k1_s: float
    k2_s: float
    speedup: float
    k1_rss_bytes: int
    k2_rss_bytes: int


@dataclass
class Machine:
    date: str
    nproc: int
    ram_bytes: int
    cpu: str
    kernel: str
    workdir: str
    filesystem: str
    command: str
    python: str
    versions: dict[str, str]
    ckpt_commit: str

    def header(self) -> str:
        return "\n".join(
            [
                f"date: {self.date}",
                f"machine: {self.nproc} CPUs ({self.cpu}), {self.ram_bytes / 2**30:.1f} GiB RAM, Linux {self.kernel}",
                f"workdir: {self.workdir} ({self.filesystem})",
                f"command: {self.command}",
                f"versions: python {self.python}, {', '.join(f'{k} {v}' for k, v in self.versions.items())}, ckpt {self.ckpt_commit}",
            ]
        )


def mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else ""


def many_processes(r: Row) -> bool:
    """Several processes at once whose summed PSS is well over the largest one's peak RSS."""
    return r.processes > 1 and r.tree_pss_bytes > 1.1 * r.peak_rss_bytes


def main_table(rows: list[Row], groups: list[str], sizes: list[float]) -> list[str]:
    head = (
        f"{'operation':<54} {'size':>7} {'in -> out GB':>13} {'wall':>8} {'peak RSS':>10}"
        f"  {'ckpt/peer time; RSS':>20} {'ckpt/cp':>8} {'/cp+sync':>8}"
    )
    lines, notes = [head, "-" * len(head)], []
    plain = [r for r in rows if r.workers is None]
    for group in groups:
        lines.append(f"[{group}]")
        for key in dict.fromkeys(r.key for r in plain if r.group == group):
            for r in sorted((r for r in plain if r.group == group and r.key == key), key=lambda r: r.size_gb):
                mark = " "
                if many_processes(r):
                    notes.append(
                        f"[{group}] {r.label} ({gb_tag(r.size_gb)}): {r.processes} processes, summed PSS up to {mb(r.tree_pss_bytes)}"
                    )
                    mark = "+"
                io = f"{r.input_bytes / 1e9:.2f} -> {r.output_bytes / 1e9:.2f}" if r.output_bytes else f"{r.input_bytes / 1e9:.2f}"
                peer = f"{ratio(r.vs_peer_time)}; {ratio(r.vs_peer_rss)}" if r.vs_peer_time is not None else ""
                peer = f"{ratio(r.vs_deep)} --deep" if r.vs_deep is not None else peer
                label = ("  " if r.kind == "peer" else "") + r.label
                lines.append(
                    f"{label:<54} {gb_tag(r.size_gb):>7} {io:>13} {r.wall_s:7.2f}s {mb(r.peak_rss_bytes):>9}{mark}"
                    f"  {peer:>20} {ratio(r.vs_cp):>8} {ratio(r.vs_cp_sync):>8}"
                )
    if notes:
        lines += ["", "+ peak RSS is that of the largest process; this command ran several at once:"]
        lines += [f"  {n}" for n in notes]
    return [line.rstrip() for line in lines]


def flatness(rows: list[Row], sizes: list[float]) -> list[Flatness]:
    """Peak RSS of every ckpt operation at the largest size over the smallest."""
    by = {(r.group, r.key, r.size_gb): r for r in rows if r.workers is None and r.kind == "ckpt"}
    out = []
    for (group, key, size), small in by.items():
        large = by.get((group, key, max(sizes)))
        if size == min(sizes) and large is not None:
            out.append(
                Flatness(group, key, small.label, small.peak_rss_bytes, large.peak_rss_bytes, large.peak_rss_bytes / small.peak_rss_bytes)
            )
    return out


def flatness_table(flat: list[Flatness], sizes: list[float]) -> list[str]:
    head = f"{'operation':<62} {'RSS ' + gb_tag(min(sizes)):>12} {'RSS ' + gb_tag(max(sizes)):>12} {'ratio':>7}"
    lines = [head, "-" * len(head)]
    for f in flat:
        label = f"[{f.group}] {f.label}"
        over = "  OVER" if f.ratio > RSS_FLAT else ""
        lines.append(f"{label:<62} {mb(f.rss_small_bytes):>12} {mb(f.rss_large_bytes):>12} {f.ratio:6.2f}x{over}")
    return lines


def speedups(rows: list[Row]) -> list[Speedup]:
    """--workers 2 against --workers 1, for every operation and size timed at both."""
    by = {(r.group, r.key, r.size_gb, r.workers): r for r in rows if r.workers is not None}
    out = []
    for (group, key, size, k), one in by.items():
        two = by.get((group, key, size, 2))
        if k == 1 and two is not None:
            out.append(
                Speedup(
                    group,
                    key,
                    one.label,
                    size,
                    one.output_files,
                    one.wall_s,
                    two.wall_s,
                    one.wall_s / two.wall_s,
                    one.peak_rss_bytes,
                    two.peak_rss_bytes,
                )
            )
    return out


def speedup_table(found: list[Speedup]) -> list[str]:
    head = f"{'operation':<62} {'size':>7} {'files':>5} {'K=1':>8} {'K=2':>8} {'speed-up':>8} {'RSS K=1':>10} {'RSS K=2':>10}"
    lines = [head, "-" * len(head)]
    for s in found:
        label = f"[{s.group}] {s.label}"
        lines.append(
            f"{label:<62} {gb_tag(s.size_gb):>7} {s.files:>5} {s.k1_s:7.2f}s {s.k2_s:7.2f}s {s.speedup:7.2f}x"
            f" {mb(s.k1_rss_bytes):>10} {mb(s.k2_rss_bytes):>10}"
        )
    return lines


def misses(rows: list[Row], flat: list[Flatness], sizes: list[float]) -> list[str]:
    """Where a ckpt operation misses one of the issue's targets at the largest size (smaller ones: start-up dominates)."""
    found = []
    for r in rows:
        if r.kind != "ckpt" or r.workers is not None or r.size_gb != max(sizes):
            continue
        name = f"[{r.group}] {r.label} ({gb_tag(r.size_gb)})"
        if r.peak_rss_bytes > RSS_MAX:
            found.append(f"{name}: peak RSS {mb(r.peak_rss_bytes)} > {mb(int(RSS_MAX))}")
        if r.vs_cp is not None and r.vs_cp > CP_MAX:
            found.append(f"{name}: wall {r.vs_cp:.2f}x cp -r > {CP_MAX}x ({ratio(r.vs_cp_sync)} cp -r + sync)")
        if r.vs_peer_time is not None and r.vs_peer_time >= 1:
            found.append(f"{name}: wall {r.vs_peer_time:.2f}x its peer")
        if r.vs_peer_rss is not None and r.vs_peer_rss >= 1:
            found.append(f"{name}: peak RSS {r.vs_peer_rss:.2f}x its peer")
        if r.vs_deep is not None and r.vs_deep > FINITE_MAX:
            found.append(f"{name}: wall {r.vs_deep:.2f}x verify --deep > {FINITE_MAX}x")
    for f in flat:
        if f.ratio > RSS_FLAT:
            found.append(f"[{f.group}] {f.label}: peak RSS {f.ratio:.2f}x from {gb_tag(min(sizes))} to {gb_tag(max(sizes))} > {RSS_FLAT}x")
    return found


def machine(work: Path) -> Machine:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    def first(path: str, prefix: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in Path(path).read_text().splitlines() if line.startswith(prefix)), "?")

    def output(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()

    repo = str(HERE.parent)
    dirty = output("git", "-C", repo, "status", "--porcelain", "--", "ckpt_cli")
    return Machine(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        nproc=os.cpu_count() or 0,
        ram_bytes=int(first("/proc/meminfo", "MemTotal:").split()[0]) * 1024,
        cpu=first("/proc/cpuinfo", "model name"),
        kernel=platform.release(),
        workdir=str(work),
        filesystem=(output("df", "--output=fstype", str(work)).split() or ["?"])[-1],
        command=shlex.join(["python", *sys.argv]),
        python=platform.python_version(),
        versions={d: version(d) for d in ("torch", "deepspeed", "safetensors", "huggingface_hub")},
        ckpt_commit=output("git", "-C", repo, "rev-parse", "--short", "HEAD") + (" + uncommitted ckpt_cli changes" if dirty else ""),
    )


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4", help="checkpoint sizes in GB on disk, comma-separated (default: 1,4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of every command: median wall, largest peak RSS (default: 3)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench"), help="built checkpoints (kept, reused) and outputs")
    parser.add_argument("--only", help=f"comma-separated sources to run: {','.join(GROUPS)} (default: all)")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers (quicker; no ckpt/peer ratios)")
    parser.add_argument("--no-workers", action="store_true", help="skip the --workers 1 / 2 comparison")
    args = parser.parse_args()
    sizes = sorted({float(s) for s in args.sizes.split(",")})
    groups = [g.strip() for g in args.only.split(",")] if args.only else list(GROUPS)
    if unknown := [g for g in groups if g not in GROUPS]:
        parser.error(f"--only: unknown {', '.join(unknown)} (known: {', '.join(GROUPS)})")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    remove(out)
    meta = machine(work)
    print(meta.header(), flush=True)

    for size in sizes:  # every build first: a failing build stops the run before any timing
        for name in dict.fromkeys(BUILDS[g] for g in groups):
            build(work, name, size)

    plan = [(size, group, task) for size in sizes for group in groups for task in tasks(group, source(work, group, size), out)]
    plan = [(size, group, task) for size, group, task in plan if not (args.no_peers and task.kind == "peer")]
    runs = [(size, group, task, None) for size, group, task in plan]
    if not args.no_workers:
        runs += [(size, group, task, k) for size, group, task in plan if task.multi_file for k in (1, 2)]
    rows: list[Row] = []
    started = time.perf_counter()
    for i, (size, group, task, workers) in enumerate(runs, 1):
        row = run_task(task, group, source(work, group, size), size, args.repeat, workers)
        rows.append(row)
        k = f" --workers {workers}" if workers else ""
        elapsed = time.perf_counter() - started
        print(
            f"[{i}/{len(runs)} {elapsed:5.0f}s] {group} {gb_tag(size)} {task.label}{k}: {row.wall_s:.2f}s, {mb(row.peak_rss_bytes)}",
            file=sys.stderr,
            flush=True,
        )
    remove(out)

    add_ratios(rows)
    print(f"\nmedian of {args.repeat} run(s) each; ckpt at its default --workers (min(4, CPUs)); GB = 10^9 bytes")
    print("ckpt/cp: wall over `cp -r` of the same source; /cp+sync: over `cp -r` + `sync` (ckpt fsyncs its output)\n")
    print("\n".join(main_table(rows, groups, sizes)))
    flat = flatness(rows, sizes) if len(sizes) > 1 else []
    if flat:
        print(f"\npeak RSS flatness, {gb_tag(max(sizes))} over {gb_tag(min(sizes))} (target <= {RSS_FLAT}x)\n")
        print("\n".join(flatness_table(flat, sizes)))
    found = speedups(rows)
    if found:
        print("\n--workers: K=1 against K=2 (files: output files written)\n")
        print("\n".join(speedup_table(found)))
    missed = misses(rows, flat, sizes)
    print(f"\ntargets at {gb_tag(max(sizes))}: peak RSS <= 500 MB, flat within {RSS_FLAT}x, wall <= {CP_MAX}x cp -r, ahead of every peer")
    print("\n".join(f"  MISS {m}" for m in missed) if missed else "  all met")
    if args.json:
        doc = {
            "meta": asdict(meta),
            "rows": [asdict(r) for r in rows],
            "rss_flatness": [asdict(f) for f in flat],
            "workers": [asdict(s) for s in found],
            "misses": missed,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nfigures written to {args.json}")


if __name__ == "__main__":
    main()
