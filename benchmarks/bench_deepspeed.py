"""ckpt on a DeepSpeed ZeRO-2 checkpoint made by real DeepSpeed (2 ranks), beside DeepSpeed's own tools.

    python benchmarks/bench_deepspeed.py --size-gb 4

Measures the weights export (`ckpt merge` to safetensors) next to `zero_to_fp32.py --safe_serialization`,
`ckpt reshard --world-size 1` next to `ds_to_universal` (DeepSpeed's only route to a new world size),
and `cp -r` of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from common import Measure, du, fresh, measure, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench-deepspeed"))
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    os.environ.update(env)
    src = work / f"zero2-{args.size_gb:g}GB"
    if not src.exists():
        print(f"building {src} with DeepSpeed ZeRO-2 on 2 ranks ...", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                str(Path(__file__).parent / "deepspeed_build.py"),
                str(src),
                str(args.size_gb),
            ],
            check=True,
            env=env,
        )
    tag = (src / "latest").read_text().strip()
    ckpt = [sys.executable, "-m", "ckpt_cli"]
    copy, merged, z2f, resharded, universal = (work / n for n in ("copy", "merged.safetensors", "z2f", "resharded", "universal"))

    def op(label: str, cmd: list[str], out: Path) -> Measure:
        return measure(label, cmd, repeat=args.repeat, before=["sh", "-c", f"rm -rf {out}; cat {src}/{tag}/* > /dev/null"])

    cp = op("cp -r", ["cp", "-r", str(src), str(copy)], copy)
    cp_sync = op("cp -r + sync", ["sh", "-c", f"cp -r {src} {copy} && sync"], copy)
    export = op("ckpt merge (weights -> safetensors)", [*ckpt, "merge", str(src), str(merged), "-q"], merged)
    peer = op(
        "zero_to_fp32.py --safe_serialization",
        [sys.executable, str(src / "zero_to_fp32.py"), str(src), str(z2f), "--safe_serialization"],
        z2f,
    )
    reshard = op("ckpt reshard --world-size 1", [*ckpt, "reshard", str(src), str(resharded), "--world-size", "1", "-q"], resharded)
    uni = op(
        "ds_to_universal",
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(src / tag),
            "--output_folder",
            str(universal / tag),
            "--inject_missing_state",
        ],
        universal,
    )
    print(f"\nsource: {src} ({du(src) / 1e9:.2f} GB; fp32 weights {du(merged) / 1e9:.2f} GB), {args.repeat} run(s) each\n")
    print(
        table(
            [
                (cp, []),
                (cp_sync, []),
                (export, [("zero_to_fp32", peer)]),
                (peer, []),
                (reshard, [("cp", cp), ("cp+sync", cp_sync), ("ds_to_universal", uni)]),
                (uni, []),
            ]
        )
    )
    for leftover in (copy, z2f, universal):
        fresh(leftover)


if __name__ == "__main__":
    main()
