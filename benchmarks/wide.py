"""ckpt at width: thousands of tensors on hundreds to a thousand ranks, beside the peers, in one run.

    python benchmarks/wide.py [--ranks 64,512,1024] [--sources stack-zero3,stack-dcp,...] [--workdir /tmp/ckpt-wide]
                              [--peer-ranks 64] [--json out.json] [--torchrun 2]

Sources (wide_build.py, real producers at 2 ranks, built once and reused from WORKDIR):

  stack-zero2, stack-zero3, stack-dcp  500 blocks of Linear(32, 32) + LayerNorm(32): 2,000 parameters, AdamW
  moe-zero2, moe-zero3, moe-dcp        40 layers x 256 per-expert modules: 20,520 parameters, AdamW

ckpt reshards each to every --ranks W (timed: `reshard 2->W`); on the W-rank copy it then times inspect, ls,
verify, verify --deep, merge, convert --to hf, reshard W->8 and diff against a byte copy, and at --peer-ranks
the peers on the same folder: DeepSpeed's zero_to_fp32 and ds_to_universal, torch's dcp_to_torch_save and
FileSystemReader.read_metadata (the floor for reading DCP metadata). `merge` is compared with the peer's
export tensor by tensor (bit-equal or not). Every command's wall time and peak RSS (GNU time: the largest
process of its tree) come from common.measure (one run; the median of three for a command under 2 s, where one
run is mostly noise); the metadata bound is 1.5 x the largest metadata file + 200 MB.
At the end: ratios to the peers and the growth of each figure from the smallest to the largest W. With
--torchrun N, each `reshard 2->W` is timed again on N torchrun processes sharing its files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from common import du, measure, remove

HERE = Path(__file__).resolve().parent
PY = sys.executable
CKPT = [PY, "-m", "ckpt_cli"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone"]
SOURCES = ("stack-zero2", "stack-zero3", "stack-dcp", "moe-zero2", "moe-zero3", "moe-dcp")
RSS_SLOPE, RSS_BASE = 1.5, 200e6  # the memory bound: 1.5 x the largest metadata file + 200 MB

READ_METADATA = """\
import sys
from torch.distributed.checkpoint import FileSystemReader
FileSystemReader(sys.argv[1]).read_metadata()
"""
DCP_TO_TORCH = """\
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""
COMPARE = """\
import sys, torch
from safetensors.torch import load_file
ours = load_file(sys.argv[1])
if sys.argv[3] == "dcp":
    theirs = {k.removeprefix("model."): v for k, v in torch.load(sys.argv[2], weights_only=False)["model"].items()}
    ours = {k.removeprefix("model."): v for k, v in ours.items()}
else:
    theirs = load_file(sys.argv[2] + "/model.safetensors")
same = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
print("bit-equal" if same else f"DIFFERENT ({len(ours)} vs {len(theirs)} tensors)")
"""


@dataclass
class Row:
    source: str
    ranks: int
    key: str
    command: str
    wall_s: float
    peak_rss_bytes: int
    input_bytes: int
    metadata_bytes: int  # the largest metadata file read or written: `.metadata`, or one rank's model-states file
    note: str = ""


def run_quiet(cmd: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def build(work: Path, name: str, env: dict[str, str]) -> Path:
    """The 2-rank source `name` (SHAPE-PRODUCER), built by wide_build.py unless WORKDIR has it."""
    out = work / f"{name}-w2"
    marker = work / f"{name}-w2.built"
    if not marker.exists():
        remove(out)
        shape, producer = name.split("-")
        torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        print(f"building {name} (torchrun, 2 ranks) ...", file=sys.stderr, flush=True)
        run_quiet([*torchrun, str(HERE / "wide_build.py"), str(out), producer, shape], env)
        marker.touch()
    return out


def metadata_bytes(src: Path) -> int:
    """The largest metadata file: DCP's `.metadata`, or the largest DeepSpeed model-states file (the module)."""
    if (src / ".metadata").exists():
        return (src / ".metadata").stat().st_size
    return max((p.stat().st_size for p in src.rglob("*model_states.pt")), default=0)


def deepspeed_tag(src: Path) -> str:
    return (src / "latest").read_text().strip()


def tasks(name: str, src: Path, out: Path, peers: bool) -> list[tuple[str, str, list[str], Path | None]]:
    """(key, label, argv, output) timed on the W-rank copy `src`."""
    copy = out / "copy"
    rows: list[tuple[str, str, list[str], Path | None]] = [
        ("inspect", "ckpt inspect", [*CKPT, "inspect", str(src)], None),
        ("ls", "ckpt ls", [*CKPT, "ls", str(src)], None),
        ("verify", "ckpt verify", [*CKPT, "verify", str(src)], None),
        ("verify_deep", "ckpt verify --deep", [*CKPT, "verify", "--deep", str(src)], None),
        ("merge", "ckpt merge", [*CKPT, "merge", str(src), str(out / "merged.safetensors"), "-q"], out / "merged.safetensors"),
        ("convert_hf", "ckpt convert --to hf", [*CKPT, "convert", str(src), str(out / "hf"), "--to", "hf", "-q"], out / "hf"),
        ("reshard8", "ckpt reshard --world-size 8", [*CKPT, "reshard", str(src), str(out / "r8"), "--world-size", "8", "-q"], out / "r8"),
        ("diff", "ckpt diff (a byte copy)", [*CKPT, "diff", str(src), str(copy)], None),
    ]
    if not peers:
        return rows
    if name.endswith("dcp"):
        rows += [
            ("read_metadata", "peer: FileSystemReader.read_metadata", [PY, "-c", READ_METADATA, str(src)], None),
            ("peer_export", "peer: dcp_to_torch_save", [PY, "-c", DCP_TO_TORCH, str(src), str(out / "peer.pt")], out / "peer.pt"),
        ]
    else:
        tag = deepspeed_tag(src)
        rows += [
            (
                "peer_export",
                "peer: zero_to_fp32 --safe_serialization",
                [PY, "-m", "deepspeed.utils.zero_to_fp32", str(src), str(out / "z2f"), "--safe_serialization"],
                out / "z2f",
            ),
            (
                "peer_universal",
                "peer: ds_to_universal --inject_missing_state",
                [
                    *(PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src / tag)),
                    *("--output_folder", str(out / "universal" / tag), "--inject_missing_state"),
                ],
                out / "universal",
            ),
        ]
    return rows


QUICK_S = 2.0  # commands faster than this are timed three times


def timed(cmd: list[str], output: Path | None, env: dict[str, str]) -> tuple[float, int]:
    def prepare() -> None:
        if output is not None:
            remove(output)

    m = measure(cmd, 1, prepare, env)
    if m.wall < QUICK_S:  # a sub-second command's one run is mostly noise: the median of three
        again = measure(cmd, 2, prepare, env)
        return sorted([m.wall, *again.walls])[1], max(m.peak_rss, again.peak_rss)
    return m.wall, m.peak_rss


def bench_source(name: str, work: Path, ranks: list[int], peer_ranks: set[int], env: dict[str, str], nproc: int = 0) -> list[Row]:
    base = build(work, name, env)
    rows = []
    for w in ranks:
        src = work / f"{name}-w{w}"
        wall, rss = timed([*CKPT, "reshard", str(base), str(src), "--world-size", str(w), "-q", "--overwrite"], None, env)
        written = max(metadata_bytes(base), metadata_bytes(src))  # the largest metadata file a reshard meets is the one it writes
        rows.append(Row(name, w, "reshard_from_2", f"ckpt reshard 2->{w}", wall, rss, du(base), written))
        print(f"{name} W={w}: reshard 2->{w} {wall:.1f} s, {rss / 1e6:.0f} MB", file=sys.stderr, flush=True)
        if nproc > 1:  # the same reshard with the ranks of one torchrun job sharing the files (docs/scale.md)
            spread = work / f"{name}-w{w}-torchrun"
            argv = [*TORCHRUN, "--nproc-per-node", str(nproc), "-m", "ckpt_cli", "reshard", str(base), str(spread)]
            wall_n, rss_n = timed([*argv, "--world-size", str(w), "-q"], spread, env)
            remove(spread)
            note = f"speed-up {ratio(wall, wall_n)} over one process"
            rows.append(Row(name, w, "reshard_torchrun", f"torchrun x{nproc} ckpt reshard 2->{w}", wall_n, rss_n, du(base), written, note))
            print(f"{name} W={w}: torchrun x{nproc} reshard 2->{w} {wall_n:.1f} s ({note})", file=sys.stderr, flush=True)
        out = work / f"out-{name}-w{w}"
        remove(out)
        out.mkdir(parents=True)
        shutil.copytree(src, out / "copy")
        size, meta = du(src), metadata_bytes(src)
        for key, label, argv, output in tasks(name, src, out, w in peer_ranks):
            wall, rss = timed(argv, output, env)
            rows.append(Row(name, w, key, label, wall, rss, size, meta))
            print(f"{name} W={w}: {label} {wall:.2f} s, {rss / 1e6:.0f} MB", file=sys.stderr, flush=True)
        if w in peer_ranks:
            peer_out = out / ("peer.pt" if name.endswith("dcp") else "z2f")
            verdict = run_quiet([PY, "-c", COMPARE, str(out / "merged.safetensors"), str(peer_out), name.split("-")[1]], env).strip()
            next(r for r in rows if r.ranks == w and r.source == name and r.key == "merge").note = f"vs peer: {verdict}"
        remove(out)
    return rows


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def report(rows: list[Row]) -> None:
    print(f"{'source':12} {'W':>5} {'command':44} {'wall s':>8} {'RSS MB':>7} {'bound MB':>8} {'vs peer':>8}  note")
    for r in rows:
        by = {x.key: x for x in rows if x.source == r.source and x.ranks == r.ranks}
        peer = by.get("peer_universal" if r.key.startswith("reshard") and "peer_universal" in by else "peer_export")
        vs = "-" if r.key.startswith("peer") or r.key == "read_metadata" else ratio(r.wall_s, peer.wall_s if peer else None)
        if r.key == "inspect" and "read_metadata" in by:
            r.note = (r.note + f" {ratio(r.wall_s, by['read_metadata'].wall_s)} read_metadata").strip()
        bound = RSS_SLOPE * r.metadata_bytes + RSS_BASE
        print(
            f"{r.source:12} {r.ranks:>5} {r.command:44} {r.wall_s:>8.2f} {r.peak_rss_bytes / 1e6:>7.0f} "
            f"{bound / 1e6:>8.0f} {vs:>8}  {r.note}"
        )
    widths = sorted({r.ranks for r in rows})
    if len(widths) > 1:
        lo, hi = widths[0], widths[-1]
        print(f"\ngrowth from {lo} to {hi} ranks (linear: {hi / lo:g}x)")
        for source in dict.fromkeys(r.source for r in rows):
            for key in dict.fromkeys(r.key for r in rows if r.source == source):
                a = next((r for r in rows if r.source == source and r.key == key and r.ranks == lo), None)
                b = next((r for r in rows if r.source == source and r.key == key and r.ranks == hi), None)
                if a and b:
                    print(f"  {source:12} {key:16} time {ratio(b.wall_s, a.wall_s):>8}  RSS {ratio(b.peak_rss_bytes, a.peak_rss_bytes):>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="64,512,1024")
    parser.add_argument("--peer-ranks", default="64", help="world sizes at which the peers run too")
    parser.add_argument("--sources", default="stack-zero2,stack-zero3,stack-dcp,moe-zero3,moe-dcp")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-wide"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--torchrun", type=int, default=0, metavar="N", help="also time reshard 2->W on N torchrun processes")
    args = parser.parse_args()
    names = args.sources.split(",")
    unknown = set(names) - set(SOURCES)
    if unknown:
        raise SystemExit(f"unknown sources {sorted(unknown)}; choose from {', '.join(SOURCES)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TMPDIR": str(args.workdir / "tmp")}
    # As installed: compiled modules cached (pip compiles them at install; some shells set this off), and warm.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    run_quiet([*CKPT, "--help"], env)
    (args.workdir / "tmp").mkdir(exist_ok=True)
    ranks = [int(w) for w in args.ranks.split(",")]
    peer_ranks = {int(w) for w in args.peer_ranks.split(",") if w}
    rows: list[Row] = []
    for name in names:
        rows += bench_source(name, args.workdir, ranks, peer_ranks, env, args.torchrun)
    report(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
