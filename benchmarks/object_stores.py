"""ckpt on object storage against a plain parallel copy of the same objects: S3 -> S3 on moto, Azure -> Azure on Azurite.

    python benchmarks/object_stores.py --sizes 0.25,1 [--stores s3,az] [--repeat 1] [--workers 4] [--json out.json]

Starts each store's local server (moto in server mode; Azurite from $CKPT_AZURITE, azurite-blob on PATH or the test
suite's npm cache ~/.cache/ckpt-tests, else Azure is skipped with a line saying so) and, for each size (GB), uploads
(untimed) a DCP checkpoint saved by dcp.save (benchmarks/s3.py's build: fp32 tensors of 4 MiB, one file per 8) and
the same tensors as an hf folder of 50 MB shards (written by ckpt). Then, on the server, each timed as a process of
its own:

  dcp->hf     `ckpt convert DCP DST --to hf --max-shard-size 50MB`: every byte read with ranged GETs (the DCP chunks
              are zip records whose CRC32 is checked on the way) and written as multipart uploads / staged blocks
  hf->hf      `ckpt convert HF DST --to hf --max-shard-size 50MB`: every output object equals a source object, so the
              store copies it (S3 CopyObject, Azure Copy Blob From URL); no data byte passes through ckpt
  merge       `ckpt merge HF DST.safetensors`: one object made of every shard's data; S3 copies the long ranges as
              parts (UploadPartCopy), Azure streams them (Azurite has no Put Block From URL)
  copy        the plain parallel copy of the same objects with the same library and ckpt's request shape: --workers
              objects at once, each read in 8 MiB ranged GETs and written in 8 MiB parts / blocks (fsspec's
              open(src).read -> open(dst, "wb").write, s3fs / adlfs) through ckpt's counted clients
  server-copy the same objects copied by the store, --workers at once (fsspec's `copy`: s3fs CopyObject /
              UploadPartCopy, adlfs Copy Blob): what `aws s3 cp --recursive` or `azcopy` do between two prefixes

Every command counts its requests and the bytes it received, sent and had the store copy (ckpt_cli.store.clients,
written at exit). The table gives wall time (median of --repeat), ratio to the copy of the same source, requests,
MB received / sent / copied by the store, the server's CPU seconds while the command ran (median; `srv CPU`) and peak
RSS (benchmarks/common.py). Both servers run on this machine's cores beside the client: absolute figures are theirs
(moto answers every GET, ranged or not, by reading the whole object from its spool file: about 26-33 ms of its CPU
for a 37 MB object whether the range is 3 KiB or 16 MiB; Azurite keeps blocks in files and a Loki database), and both
sides pay them: with the server's CPU the bound, requests times object size is what a command costs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import measure
from s3 import build as build_dcp
from s3 import free_port, start_server

PY = sys.executable
PART = 8 << 20
CONTAINER = "bench"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # Azurite's published key

RUN = """\
import atexit, json, os, sys
from ckpt_cli.store import clients
atexit.register(lambda: open(os.environ["BENCH_STATS"], "w").write(json.dumps(vars(clients.stats()))))
from ckpt_cli.cli.app import main
main(sys.argv[1:])
"""

COPY = """\
import atexit, json, os, sys
from concurrent.futures import ThreadPoolExecutor
from ckpt_cli.store import clients
src, dst, workers, part, server = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
protocol, src, dst = src.split("://")[0], src.split("://")[1], dst.split("://")[1]
fs = clients.filesystem(protocol)
keys = fs.find(src)
sent = []
def copy(key):
    if server:
        fs.copy(key, dst + key[len(src):])
        return
    with fs.open(key, "rb", block_size=part, cache_type="none") as r, fs.open(dst + key[len(src):], "wb", block_size=part) as w:
        while chunk := r.read(part):
            w.write(chunk)
            sent.append(len(chunk))
with ThreadPoolExecutor(workers) as pool:
    list(pool.map(copy, keys))
stats = vars(clients.stats())
stats["bytes_out"] = sum(sent)
stats["bytes_copied"] = sum(fs.size(key) for key in keys) if server else 0
open(os.environ["BENCH_STATS"], "w").write(json.dumps(stats))
"""


class Server:
    """A store's local server: its environment, an fsspec filesystem for the setup, URLs."""

    protocol = ""
    env: dict[str, str]
    root = ""
    server: subprocess.Popen

    def cpu(self) -> float:
        """CPU seconds the server process has used so far (user + system)."""
        times = psutil.Process(self.server.pid).cpu_times()
        return times.user + times.system

    def url(self, key: str) -> str:
        return f"{self.protocol}://{self.root}/{key}"

    def upload(self, local: Path, key: str) -> str:
        for path in sorted(local.iterdir()):
            self.fs.put_file(str(path), f"{self.root}/{key}/{path.name}")
        return self.url(key)

    def clear(self, key: str) -> None:
        self.fs.invalidate_cache()
        if self.fs.exists(f"{self.root}/{key}"):
            self.fs.rm(f"{self.root}/{key}", recursive=True)
        self.fs.invalidate_cache()


class S3Server(Server):
    protocol, root = "s3", "bench"

    def __init__(self) -> None:
        self.env = {
            **os.environ,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.server = start_server(self.env)
        os.environ.update(self.env)
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        self.fs.mkdir(self.root)

    def stop(self) -> None:
        self.server.terminate()
        self.server.wait(30)


def azurite() -> str | None:
    """Azurite's blob server as the test suite finds it (tests/conftest.py `azurite_command`), without installing it."""
    found = os.environ.get("CKPT_AZURITE") or shutil.which("azurite-blob")
    if found:
        return found
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckpt-tests"
    binaries = sorted(cache.glob("azurite-*/node_modules/.bin/azurite-blob"))
    return str(binaries[-1]) if binaries else None


class AzureServer(Server):
    protocol, root = "az", CONTAINER

    def __init__(self, command: str) -> None:
        port = free_port()
        self.where = tempfile.mkdtemp(prefix="ckpt-bench-azurite-")
        args = [command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", self.where]
        args += ["--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry"]
        self.server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        else:
            raise SystemExit("Azurite did not start")
        conn = (
            f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
        )
        self.env = {**os.environ, "AZURE_STORAGE_CONNECTION_STRING": conn}
        os.environ.update(self.env)
        import adlfs

        self.fs = adlfs.AzureBlobFileSystem(connection_string=conn, skip_instance_cache=True)
        self.fs.mkdir(self.root)

    def stop(self) -> None:
        self.server.terminate()
        self.server.wait(30)
        shutil.rmtree(self.where, ignore_errors=True)


def sources(work: Path, size: float) -> dict[str, Path]:
    """The DCP checkpoint (built once by benchmarks/s3.py's builder) and its tensors as an hf folder of 50 MB shards."""
    dcp = build_dcp(work, size)
    hf = work / f"hf-{size:g}GB" / "hf"
    if not (hf / "model.safetensors.index.json").exists():
        subprocess.run(
            [PY, "-m", "ckpt_cli", "convert", str(dcp), str(hf), "--to", "hf", "--max-shard-size", "50MB", "--quiet"], check=True
        )
    return {"dcp": dcp, "hf": hf}


def timed(cmd: list[str], repeat: int, server: Server, out: str, env: dict[str, str]) -> dict:
    """`cmd` measured (benchmarks/common.py) after `out` is cleared, with the counts it wrote at exit and the server's
    CPU seconds over each run (median)."""
    starts: list[float] = []
    ends: list[float] = []

    def prepare() -> None:
        if starts:
            ends.append(server.cpu())  # the run before ended
        server.clear(out)
        starts.append(server.cpu())

    with tempfile.NamedTemporaryFile(suffix=".json") as stats:
        m = measure(cmd, repeat, prepare, {**env, "BENCH_STATS": stats.name})
        ends.append(server.cpu())
        counted = json.loads(Path(stats.name).read_text())
    server.clear(out)
    spent = sorted(b - a for a, b in zip(starts, ends))
    return {**vars(m), **counted, "server_cpu": spent[len(spent) // 2]}


def run_store(server: Server, args: argparse.Namespace, sizes: list[float]) -> list[dict]:
    rows = []
    workers = str(args.workers)
    for size in sizes:
        local = sources(args.workdir, size)
        src = {name: server.upload(path, f"src-{size:g}/{name}") for name, path in local.items()}
        nbytes = {name: sum(p.stat().st_size for p in path.iterdir()) for name, path in local.items()}
        out = server.url("out")
        ckpt = [PY, "-c", RUN]
        commands = {
            "dcp->hf": ("dcp", [*ckpt, "convert", src["dcp"], f"{out}/hf", "--to", "hf", "--max-shard-size", "50MB"]),
            "hf->hf": ("hf", [*ckpt, "convert", src["hf"], f"{out}/hf", "--to", "hf", "--max-shard-size", "50MB"]),
            "merge": ("hf", [*ckpt, "merge", src["hf"], f"{out}/merged.safetensors"]),
        }
        for name, (source, cmd) in commands.items():
            row = timed([*cmd, "--workers", workers, "--quiet"], args.repeat, server, "out", server.env)
            rows.append({"store": server.protocol, "size_gb": size, "command": name, "source": source, "bytes": nbytes[source], **row})
        for source in ("dcp", "hf"):
            for name, flag in (("copy", "0"), ("server-copy", "1")):
                cmd = [PY, "-c", COPY, src[source], f"{out}/copy", workers, str(PART), flag]
                row = timed(cmd, args.repeat, server, "out", server.env)
                rows.append({"store": server.protocol, "size_gb": size, "command": name, "source": source, "bytes": nbytes[source], **row})
        server.clear(f"src-{size:g}")
    return rows


def report(rows: list[dict]) -> None:
    mb = 1e6
    head = f"{'store':5} {'size':>6} {'command':11} {'source':6} {'wall':>7} {'/copy':>6} {'/srv':>6} {'req':>5}"
    print(f"{head} {'MB in':>7} {'MB out':>7} {'MB copied':>9} {'srv CPU':>7} {'RSS':>6}")
    for r in rows:
        same = [b for b in rows if (b["store"], b["size_gb"], b["source"]) == (r["store"], r["size_gb"], r["source"])]
        base = {b["command"]: b["wall"] for b in same}
        ratios = " ".join(f"{r['wall'] / base[c]:6.2f}" for c in ("copy", "server-copy"))
        print(
            f"{r['store']:5} {r['bytes'] / 1e9:5.2f}G {r['command']:11} {r['source']:6} {r['wall']:6.1f}s {ratios} {r['requests']:5d} "
            f"{r['bytes_in'] / mb:7.1f} {r['bytes_out'] / mb:7.1f} {r.get('bytes_copied', 0) / mb:9.1f} {r['server_cpu']:6.1f}s "
            f"{r['peak_rss'] / mb:5.0f}M"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.25,1", help="checkpoint sizes in GB, comma-separated (default: 0.25,1)")
    parser.add_argument("--stores", default="s3,az", help="s3 (moto), az (Azurite), comma-separated (default: both)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every command: median wall, largest peak RSS")
    parser.add_argument("--workers", type=int, default=4, help="objects written at once, by ckpt and by the copies (default: 4)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench-s3"), help="built checkpoints (kept, reused)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for protocol in args.stores.split(","):
        if protocol == "az" and azurite() is None:
            print("az: skipped: no Azurite ($CKPT_AZURITE, azurite-blob on PATH, or the test suite's ~/.cache/ckpt-tests)")
            continue
        server: Server = S3Server() if protocol == "s3" else AzureServer(azurite() or "")
        try:
            rows += run_store(server, args, sizes)
        finally:
            server.stop()
    print(f"load average before the last store's run ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
