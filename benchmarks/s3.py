"""ckpt on object storage, against a plain parallel copy of the same objects, on a local S3-protocol server.

    python benchmarks/s3.py --sizes 0.25,1 [--repeat 1] [--json out.json] [--workdir /tmp/ckpt-bench-s3] [--workers 4]

Starts moto in server mode (its own process, HTTP on a free port) and, for each size (GB), builds a DCP
checkpoint with dcp.save (fp32 tensors of 4 MiB, FileSystemWriter: one file per 8 tensors) and uploads it (untimed).
Then, on the server:

  convert   `ckpt convert s3://SRC s3://DST --to hf` (every tensor byte read with ranged GETs and written with
            multipart uploads; the commit marker last)
  copy      a plain parallel copy of the same objects with the same library (s3fs: stream each object from
            fs.open(src) to fs.open(dst, "wb"), --workers objects at once, s3fs's default 50 MiB blocks): the
            floor for moving those bytes
  copy8     the same copy in 8 MiB ranged GETs and 8 MiB multipart parts, the request shape ckpt uses: the
            ratio to it is ckpt's own cost (parsing, planning, CRC checks) beside the server's per request
  inspect   `ckpt inspect s3://SRC`: requests made and bytes received (counted by ckpt_cli.store.clients), in
            this process; and `verify` (structural) the same way. Also for the same tensors as one safetensors
            file, an hf folder (50 MB shards) and a torch file (written by ckpt from the DCP checkpoint), and for
            a ZeRO-2 checkpoint of the same size from real DeepSpeed on 2 ranks (benchmarks/run.py's builder), at
            the smallest size only: moto copies the whole object for every ranged GET, so the 256 record headers of
            a 1 GB torch file cost it minutes (requests and bytes do not depend on the server)

Wall time is the median of --repeat runs, peak RSS the largest (benchmarks/common.py). The table gives the
convert / copy ratio at each size, and the peak RSS of convert at the largest size over the smallest (flat
memory: parts and pieces are bounded, see store/s3.py and store/prefetch.py). moto serves every GET,
ranged or not, by copying the whole object in Python (objects here are 32 MiB), and runs on the same cores:
absolute figures are the server's, and both sides pay it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import Measure, measure

HERE = Path(__file__).resolve().parent
PY = sys.executable
BUCKET = "bench"
TENSOR = 4 << 20

COPY = """\
import sys
from concurrent.futures import ThreadPoolExecutor
import s3fs
src, dst, workers, block = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) or None
fs = s3fs.S3FileSystem()
keys = fs.find(src)
def copy(key):
    with fs.open(key, "rb", block_size=block) as r, fs.open(dst + key[len(src):], "wb", block_size=block) as w:
        while chunk := r.read(8 << 20):
            w.write(chunk)
with ThreadPoolExecutor(workers) as pool:
    list(pool.map(copy, keys))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(env: dict[str, str]) -> subprocess.Popen:
    port = int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    server = subprocess.Popen([PY, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.1)
    raise SystemExit("moto server did not start")


def build(work: Path, size: float) -> Path:
    """A DCP checkpoint of about `size` GB saved by dcp.save (kept in `work` and reused)."""
    out = work / f"dcp-{size:g}GB"
    if (out / ".metadata").exists():
        return out
    script = (
        "import sys, warnings, torch, torch.distributed.checkpoint as dcp\n"
        "warnings.filterwarnings('ignore')\n"
        "n = int(sys.argv[2])\n"
        "g = torch.Generator().manual_seed(0)\n"
        "state = {f'layers.{i}.weight': torch.empty(1024, 1024).uniform_(generator=g) for i in range(n)}\n"
        "files = max(1, n // 8)\n"
        "dcp.save({'model': state}, storage_writer=dcp.FileSystemWriter(sys.argv[1], thread_count=files), no_dist=True)\n"
    )
    subprocess.run([PY, "-c", script, str(out), str(max(1, int(size * 1e9) // TENSOR))], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.25,1", help="checkpoint sizes in GB, comma-separated (default: 0.25,1)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every command: median wall, largest peak RSS")
    parser.add_argument("--workers", type=int, default=4, help="objects written at once, by ckpt and by the copy (default: 4)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench-s3"), help="built checkpoints (kept, reused)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(env)
    server = start_server(env)
    try:
        rows = run(args, sizes, env)
    finally:
        server.terminate()
        server.wait(30)
    report(rows, sizes)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


def run(args: argparse.Namespace, sizes: list[float], env: dict[str, str]) -> list[dict]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    rows = []
    for size in sizes:
        local = build(args.workdir, size)
        src = f"{BUCKET}/src-{size:g}/dcp"
        fs.put(str(local) + "/", src + "/", recursive=True)
        nbytes = sum(p.stat().st_size for p in local.iterdir())

        def clear(prefix: str) -> None:
            if fs.exists(prefix):
                fs.rm(prefix, recursive=True)
            fs.invalidate_cache()

        convert = [PY, "-m", "ckpt_cli", "convert", f"s3://{src}", f"s3://{BUCKET}/out/hf", "--to", "hf"]
        convert += ["--max-shard-size", "50MB", "--workers", str(args.workers), "--quiet"]  # >= 5 files at every size: all workers busy
        ckpt_m = measure(convert, args.repeat, lambda: clear(f"{BUCKET}/out"), env)
        copy = [PY, "-c", COPY, src, f"{BUCKET}/copy", str(args.workers), "0"]
        copy_m = measure(copy, args.repeat, lambda: clear(f"{BUCKET}/copy"), env)
        copy8 = [PY, "-c", COPY, src, f"{BUCKET}/copy", str(args.workers), str(8 << 20)]
        copy8_m = measure(copy8, args.repeat, lambda: clear(f"{BUCKET}/copy"), env)
        reads = metadata_reads(f"s3://{src}")
        formats = {"dcp": reads}
        for name, path in other_formats(args.workdir, local, size).items() if size == sizes[0] else ():  # smallest size only
            prefix = f"{BUCKET}/src-{size:g}/{name}/{path.name}"
            fs.put(str(path) + ("/" if path.is_dir() else ""), prefix + ("/" if path.is_dir() else ""), recursive=path.is_dir())
            fs.invalidate_cache()
            formats[name] = {"bytes": sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size}
            formats[name] |= metadata_reads(f"s3://{prefix}")
        measured = {"convert": vars(ckpt_m), "copy": vars(copy_m), "copy8": vars(copy8_m)}
        rows.append({"size_gb": size, "bytes": nbytes, **measured, **reads, "formats": formats})
        clear(f"{BUCKET}/src-{size:g}")
    return rows


def metadata_reads(url: str) -> dict[str, dict[str, float]]:
    """Requests, bytes received and wall time of inspect and structural verify of `url`, in this process."""
    from ckpt_cli import api
    from ckpt_cli.store import clients as filesystems

    reads = {}
    for name, call in (("inspect", api.inspect), ("verify", api.verify)):
        filesystems.reset_stats()
        start = time.perf_counter()
        call(url)
        stats = filesystems.stats()
        reads[name] = {"requests": stats.requests, "bytes": stats.bytes_in, "wall": time.perf_counter() - start}
    return reads


def other_formats(work: Path, dcp: Path, size: float) -> dict[str, Path]:
    """The DCP checkpoint's tensors as safetensors, hf and torch (written by ckpt), and a ZeRO-2 checkpoint of `size` GB
    from real DeepSpeed (built once by benchmarks/run.py's builder, reused); all kept in `work`."""
    from run import build as build_reference

    found = {}
    for name, command, file in (
        ("safetensors", ["merge"], "model.safetensors"),
        ("hf", ["convert", "--to", "hf", "--max-shard-size", "50MB"], "hf"),
        ("torch", ["convert", "--to", "torch"], "model.pt"),
    ):
        out = work / f"{name}-{size:g}GB" / file
        if not out.exists():
            subprocess.run([PY, "-m", "ckpt_cli", command[0], str(dcp), str(out), *command[1:], "--quiet"], check=True)
        found[name] = out
    build_reference(work, "zero2", size)
    found["deepspeed"] = work / f"zero2-{size:g}GB"
    return found


def report(rows: list[dict], sizes: list[float]) -> None:
    mb = 1e6
    head = f"{'size':>8} {'convert':>9} {'copy':>7} {'ratio':>6} {'copy8':>7} {'ratio':>6} {'MB/s':>6}"
    print(f"{head} {'RSS conv':>9} {'RSS copy':>9} {'RSS copy8':>9} {'inspect':>22} {'verify':>22}")
    for r in rows:
        conv, copy, copy8 = Measure(**r["convert"]), Measure(**r["copy"]), Measure(**r["copy8"])
        reads = [f"{r[k]['requests']} req {r[k]['bytes'] / mb:.2f} MB {r[k]['wall']:.1f}s" for k in ("inspect", "verify")]
        walls = f"{conv.wall:8.1f}s {copy.wall:6.1f}s {conv.wall / copy.wall:6.2f} {copy8.wall:6.1f}s {conv.wall / copy8.wall:6.2f}"
        rss = f"{conv.peak_rss / mb:8.0f}M {copy.peak_rss / mb:8.0f}M {copy8.peak_rss / mb:8.0f}M"
        print(f"{r['bytes'] / 1e9:7.2f}G {walls} {r['bytes'] / mb / conv.wall:6.1f} {rss} {reads[0]:>22} {reads[1]:>22}")
    if len(rows) > 1:
        first, last = rows[0]["convert"]["peak_rss"], rows[-1]["convert"]["peak_rss"]
        print(f"convert peak RSS at {sizes[-1]:g} GB over {sizes[0]:g} GB: {last / first:.2f}")
    print(f"\n{'metadata reads':<16} {'size':>7} {'inspect':>22} {'verify':>22}")
    for r in rows:
        for name, f in r["formats"].items():
            reads = [f"{f[k]['requests']} req {f[k]['bytes'] / mb:.2f} MB {f[k]['wall']:.1f}s" for k in ("inspect", "verify")]
            print(f"{name:<16} {f.get('bytes', r['bytes']) / 1e9:6.2f}G {reads[0]:>22} {reads[1]:>22}")


if __name__ == "__main__":
    main()
