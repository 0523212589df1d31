"""Manifests: the digest ckpt records, against the alternatives, and what writing one costs next to a conversion.

    python benchmarks/manifest.py [--size 1] [--repeat 3] [--workdir /tmp/ckpt-bench]

On a Hugging Face folder of SIZE GB (fp32 tensors, built once by hf_build.py and reused), with a warm page
cache (read once with `cat`), it prints:

  - each digest's throughput over the same bytes in this process (sha256, blake2b, blake3, and xxh3 and
    crc32c where installed): what verify --write-manifest could cost per GB;
  - wall time and peak RSS of `ckpt verify --write-manifest` (per-file and per-tensor digests), of
    `ckpt verify --deep` (every byte read), of `ckpt convert --to hf` of the same folder without and
    with `--write-manifest` (the output's digests, read back from the page cache), and of `cp -r`.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
import zlib
from pathlib import Path

from common import measure, remove

HERE = Path(__file__).resolve().parent
PY = sys.executable
CKPT = [PY, "-m", "ckpt_cli"]


def digests() -> dict[str, object]:
    found: dict[str, object] = {"sha256": hashlib.sha256, "blake2b": hashlib.blake2b}
    try:
        import blake3

        found["blake3"] = blake3.blake3
    except ImportError:
        pass
    try:
        import xxhash

        found["xxh3_128 (not cryptographic)"] = xxhash.xxh3_128
    except ImportError:
        pass
    return found


def throughput(files: list[Path]) -> None:
    data = [f.read_bytes() for f in files]
    total = sum(len(d) for d in data)
    rows = [(name, lambda make=make: [make(d).digest() for d in data]) for name, make in digests().items()]
    rows.append(("zlib crc32 (not cryptographic)", lambda: [zlib.crc32(d) for d in data]))
    for name, run in rows:
        best = min(_timed(run) for _ in range(3))
        print(f"  {name:32s} {total / best / 1e9:6.2f} GB/s")


def _timed(run: object) -> float:
    start = time.perf_counter()
    run()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench"))
    args = parser.parse_args()
    work = args.workdir / f"manifest-{args.size:g}"
    src = work / "hf"
    if not src.exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([PY, str(HERE / "hf_build.py"), work / "single.safetensors", src, str(args.size), "250MB"], check=True)
    files = sorted(src.iterdir())
    nbytes = sum(f.stat().st_size for f in files)
    print(f"source: {src} ({nbytes / 1e9:.2f} GB, {len(files)} files)")
    print("digest throughput, one core, same bytes in memory:")
    throughput([f for f in files if f.suffix == ".safetensors"])

    def warm() -> None:
        for out in (work / "out", work / "copy", work / "m.json"):
            remove(out)
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)

    commands = {
        "ckpt verify --write-manifest": [*CKPT, "verify", src, "--write-manifest", work / "m.json"],
        "ckpt verify --deep": [*CKPT, "verify", src, "--deep"],
        "ckpt convert --to hf": [*CKPT, "convert", src, work / "out", "--to", "hf", "-q"],
        "ckpt convert ... --write-manifest": [*CKPT, "convert", src, work / "out", "--to", "hf", "-q", "--write-manifest", work / "m.json"],
        "cp -r": ["cp", "-r", src, work / "copy"],
    }
    results = {name: measure(list(map(str, cmd)), args.repeat, warm) for name, cmd in commands.items()}
    print("commands (median wall, peak RSS):")
    for name, m in results.items():
        print(f"  {name:32s} {m.wall:7.2f} s  {nbytes / m.wall / 1e9:5.2f} GB/s  {m.peak_rss / 1e6:7.1f} MB")
    plain, with_manifest = results["ckpt convert --to hf"].wall, results["ckpt convert ... --write-manifest"].wall
    print(f"a conversion that writes its output's manifest: {with_manifest / plain:.2f}x the time of the plain conversion")


if __name__ == "__main__":
    main()
