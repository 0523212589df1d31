"""ckpt split / merge against cp of the same bytes and against the naive in-memory path.

    python benchmarks/bench_convert.py --size-gb 2

Builds a synthetic single-file safetensors checkpoint of fp32 tensors of varied sizes, then
measures, in one run: `ckpt split` to hf shards and `ckpt merge` back; `cp` (and `cp` + `sync`,
since ckpt fsyncs what it writes) of the same bytes; and the naive path a user would write
(`safetensors.torch.load_file` + `huggingface_hub.save_torch_state_dict`, and load all shards +
`save_file`). Prints wall time, peak RSS and the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import Measure, du, fresh, measure, table

NAIVE_SPLIT = (
    "import sys; from safetensors.torch import load_file; from huggingface_hub import save_torch_state_dict\n"
    "import os; os.makedirs(sys.argv[2]); save_torch_state_dict(load_file(sys.argv[1]), sys.argv[2], max_shard_size=sys.argv[3])\n"
)
NAIVE_MERGE = (
    "import sys, json; from safetensors.torch import load_file, save_file\n"
    "index = json.load(open(sys.argv[1] + '/model.safetensors.index.json'))\n"
    "sd = {}\n"
    "for f in sorted(set(index['weight_map'].values())): sd.update(load_file(sys.argv[1] + '/' + f))\n"
    "save_file(sd, sys.argv[2], metadata={'format': 'pt'})\n"
)


def build_source(path: Path, size_bytes: int) -> None:
    """fp32 tensors from 64 KB to 256 MB, cycling, until `size_bytes` (written one shard at a time)."""
    import torch
    from safetensors.torch import save_file

    sizes = [2**14, 2**18, 2**20, 3 * 2**20, 2**22, 2**24, 2**26, 5 * 2**22]  # elements
    sd, total, i = {}, 0, 0
    while total < size_bytes:
        n = min(sizes[i % len(sizes)], max((size_bytes - total) // 4, 1))
        sd[f"layers.{i}.weight"] = torch.randn(n)
        total += n * 4
        i += 1
    save_file(sd, str(path), metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench-convert"))
    parser.add_argument("--shard", default="500MB")
    parser.add_argument("--repeat", type=int, default=3, help="runs per operation (median wall, max RSS)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"source-{args.size_gb:g}GB.safetensors"
    if not src.exists():
        print(f"building {src} ...", file=sys.stderr)
        build_source(src, int(args.size_gb * 1e9))
    measure("warm page cache", ["cat", str(src)])
    ckpt = [sys.executable, "-m", "ckpt_cli"]

    def op(label: str, cmd: list[str], out: Path, warm: Path) -> Measure:
        # Remove the previous output and warm the page cache with the input, the same for every tool.
        return measure(
            label,
            cmd,
            repeat=args.repeat,
            before=["sh", "-c", f"rm -rf {out}; cat {warm if warm.is_file() else str(warm) + '/*'} > /dev/null"],
        )

    split_dir, copy, merged = work / "split", work / "copy", work / "merged.safetensors"
    cp = op("cp", ["cp", str(src), str(copy)], copy, src)
    cp_sync = op("cp + sync", ["sh", "-c", f"cp {src} {copy} && sync"], copy, src)
    split = op(
        f"ckpt split --max-shard-size {args.shard}",
        [*ckpt, "split", str(src), str(split_dir), "--max-shard-size", args.shard, "-q"],
        split_dir,
        src,
    )
    naive_split = op(
        "naive split (load_file + save_torch_state_dict)",
        [sys.executable, "-c", NAIVE_SPLIT, str(src), str(work / "naive_split"), args.shard],
        work / "naive_split",
        src,
    )
    cp_dir = op("cp -r of the shards", ["cp", "-r", str(split_dir), str(copy)], copy, split_dir)
    cp_dir_sync = op("cp -r of the shards + sync", ["sh", "-c", f"cp -r {split_dir} {copy} && sync"], copy, split_dir)
    merge = op("ckpt merge", [*ckpt, "merge", str(split_dir), str(merged), "-q"], merged, split_dir)
    naive_merge = op(
        "naive merge (load all shards + save_file)",
        [sys.executable, "-c", NAIVE_MERGE, str(split_dir), str(work / "naive.safetensors")],
        work / "naive.safetensors",
        split_dir,
    )
    rows = [
        (cp, []),
        (cp_sync, []),
        (split, [("cp", cp), ("cp+sync", cp_sync), ("naive", naive_split)]),
        (naive_split, [("cp", cp)]),
        (cp_dir, []),
        (cp_dir_sync, []),
        (merge, [("cp", cp_dir), ("cp+sync", cp_dir_sync), ("naive", naive_merge)]),
        (naive_merge, [("cp", cp_dir)]),
    ]
    same = merged.read_bytes() == src.read_bytes()
    print(f"\nsource: {src} ({du(src) / 1e9:.2f} GB, {args.repeat} runs each, median wall, max peak RSS)")
    print(f"merge output byte-identical to the source: {same}\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([{"label": m.label, "wall_s": m.wall, "peak_rss_bytes": m.peak_rss} for m, _ in rows], indent=2))
    for leftover in (copy, work / "naive_split", work / "naive.safetensors"):
        fresh(leftover)


if __name__ == "__main__":
    main()
