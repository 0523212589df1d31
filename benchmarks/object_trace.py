"""Where `ckpt convert s3://DCP s3://DST --to hf` (or `ckpt merge s3://HF s3://DST.safetensors`) spends its time beside
a plain parallel copy of the same objects: every S3 request timed on a moto server (botocore's before-call /
after-call events), in this process.

    python benchmarks/object_trace.py [--size 0.25] [--command dcp|merge] [--workers 4] [--workdir /tmp/ckpt-bench-s3]

For each of the two it prints the wall time, this process's CPU seconds and the moto server's (the server runs on the
same cores, and its CPU is what bounds both: it reads the whole object for every GET, ranged or not), the time no
request was in flight (the client working alone), the mean and peak number of requests in flight, the peak of parts
being uploaded at once, when the first tensor-data GET started (what came before: reading `.metadata`, the chunk
headers, planning), per S3 operation the requests, the bytes received and the mean time one took, and the GETs by
size. The copy is benchmarks/object_stores.py's (8 MiB ranges and parts) of the command's source.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from object_stores import PART, S3Server, sources

EVENTS: list[tuple[str, float, float, int]] = []  # (operation, start, end, bytes received)
_lock = threading.Lock()


def _before(context: dict | None = None, **_: object) -> None:
    if context is not None:
        context["bench_t0"] = time.perf_counter()


def _after(http_response=None, model=None, context: dict | None = None, **_: object) -> None:  # noqa: ANN001
    got = int(http_response.headers.get("content-length") or 0) if http_response is not None else 0
    with _lock:
        EVENTS.append((model.name, (context or {}).get("bench_t0", 0.0), time.perf_counter(), got))


def hook(fs) -> None:  # noqa: ANN001
    fs.s3.meta.events.register("before-call.s3", _before)
    fs.s3.meta.events.register("after-call.s3", _after)


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def summary(name: str, t0: float, t1: float, cpu: tuple[float, float]) -> None:
    ev = [e for e in EVENTS if e[1] >= t0]
    edges = sorted([(a, 1, op) for op, a, _, _ in ev] + [(b, -1, op) for op, _, b, _ in ev])
    now = parts = peak = peak_parts = 0
    last, idle, area = t0, 0.0, 0.0
    for t, step, op in edges:
        idle += (t - last) if now == 0 else 0.0
        area += now * (t - last)
        last, now = t, now + step
        parts += step if op in ("UploadPart", "UploadPartCopy") else 0
        peak, peak_parts = max(peak, now), max(peak_parts, parts)
    idle += t1 - last
    data = [a for op, a, _, n in ev if op == "GetObject" and n > 1 << 20]
    first = f"{min(data) - t0:.2f}s" if data else "-"
    print(f"{name}: wall {t1 - t0:.2f}s, CPU here {cpu[0]:.2f}s, moto's {cpu[1]:.2f}s, nothing in flight {idle:.2f}s, ", end="")
    print(f"in flight mean {area / (t1 - t0):.1f} peak {peak}, ", end="")
    print(f"parts at once {peak_parts}, first data GET at {first}")
    ops: dict[str, list[float]] = {}
    for op, a, b, n in ev:
        o = ops.setdefault(op, [0, 0, 0.0])
        o[0], o[1], o[2] = o[0] + 1, o[1] + n, o[2] + b - a
    for op, (count, got, spent) in sorted(ops.items()):
        print(f"   {op:26} {int(count):5d} requests {got / 1e6:8.1f} MB received {spent / count * 1000:8.1f} ms each")
    sizes = collections.Counter(f"{n >> 20} MiB" if n >= 1 << 20 else f"{-(-n // 1024)} KiB" for op, _, _, n in ev if op == "GetObject")
    print("   GETs by size:", ", ".join(f"{count} x {size}" for size, count in sorted(sizes.items(), key=lambda kv: -kv[1])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=0.25, help="checkpoint size in GB (default: 0.25)")
    parser.add_argument("--command", choices=("dcp", "merge"), default="dcp", help="convert dcp -> hf, or merge the hf folder")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench-s3"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    server = S3Server()
    moto = psutil.Process(server.server.pid)

    def cpu() -> tuple[float, float]:
        times = moto.cpu_times()
        return client_cpu(), times.user + times.system

    def spent(before: tuple[float, float]) -> tuple[float, float]:
        now = cpu()
        return now[0] - before[0], now[1] - before[1]

    try:
        kind = "dcp" if args.command == "dcp" else "hf"
        src = server.upload(sources(args.workdir, args.size)[kind], f"src/{kind}")
        from ckpt_cli import api
        from ckpt_cli.store.location import remote

        hook(remote(src).fs)
        t0, before = time.perf_counter(), cpu()
        if args.command == "dcp":
            api.convert(src, server.url("out/hf"), to="hf", max_shard_size="50MB", workers=args.workers)
        else:
            api.merge(src, server.url("out/merged.safetensors"), workers=args.workers)
        summary(args.command, t0, time.perf_counter(), spent(before))
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        hook(fs)
        root = src.split("://")[1]
        keys = fs.find(root)

        def copy(key: str) -> None:
            target = f"{server.root}/copy" + key[len(root) :]
            with fs.open(key, "rb", block_size=PART, cache_type="none") as r, fs.open(target, "wb", block_size=PART) as w:
                while chunk := r.read(PART):
                    w.write(chunk)

        t0, before = time.perf_counter(), cpu()
        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(copy, keys))
        summary("copy", t0, time.perf_counter(), spent(before))
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
