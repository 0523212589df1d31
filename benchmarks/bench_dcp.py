"""ckpt on a DCP checkpoint made by real FSDP2 on 2 ranks, beside torch's own tools and cp.

    python benchmarks/bench_dcp.py --size-gb 2

Measures `ckpt reshard --world-size 3`, `ckpt convert --to hf --weights-only` and `ckpt verify --deep`
next to `dcp_to_torch_save` (torch's format_utils, the peer for leaving DCP), `dcp_to_torch_save` +
safetensors `save_file` of the weights (the peer for the hf export), and `cp -r` of the same bytes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from common import Measure, du, fresh, measure, table

DCP_TO_TORCH = (
    "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
)
DCP_TO_HF = (
    "import sys, os, torch; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "from safetensors.torch import save_file\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2] + '.pt'); sd = torch.load(sys.argv[2] + '.pt', weights_only=False)\n"
    "os.makedirs(sys.argv[2]); save_file(sd['model'], sys.argv[2] + '/model.safetensors'); os.remove(sys.argv[2] + '.pt')\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench-dcp"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"fsdp2-{args.size_gb:g}GB"
    if not src.exists():
        print(f"building {src} with FSDP2 on 2 ranks ...", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                str(Path(__file__).parent / "fsdp2_build.py"),
                str(src),
                str(args.size_gb),
            ],
            check=True,
            env={"OMP_NUM_THREADS": "1", **__import__("os").environ},
        )
    ckpt = [sys.executable, "-m", "ckpt_cli"]
    copy, resharded, hf, peer_pt, peer_hf = (work / n for n in ("copy", "resharded", "hf", "peer.pt", "peer_hf"))

    def op(label: str, cmd: list[str], out: Path | None) -> Measure:
        # Remove the previous output and warm the page cache with the input, the same for every tool.
        return measure(label, cmd, repeat=args.repeat, before=["sh", "-c", f"rm -rf {out or ''}; cat {src}/* > /dev/null"])

    cp = op("cp -r", ["cp", "-r", str(src), str(copy)], copy)
    cp_sync = op("cp -r + sync", ["sh", "-c", f"cp -r {src} {copy} && sync"], copy)
    reshard = op("ckpt reshard --world-size 3", [*ckpt, "reshard", str(src), str(resharded), "--world-size", "3", "-q"], resharded)
    to_torch = op("dcp_to_torch_save (peer)", [sys.executable, "-c", DCP_TO_TORCH, str(src), str(peer_pt)], peer_pt)
    convert = op(
        "ckpt convert --to hf --weights-only",
        [*ckpt, "convert", str(src), str(hf), "--to", "hf", "--weights-only", "--strip-prefix", "model.", "-q"],
        hf,
    )
    to_hf = op("dcp_to_torch_save + save_file (peer)", [sys.executable, "-c", DCP_TO_HF, str(src), str(peer_hf)], peer_hf)
    verify = op("ckpt verify --deep", [*ckpt, "verify", "--deep", str(src)], None)
    weights = du(hf)
    print(f"\nsource: {src} ({du(src) / 1e9:.2f} GB; weights {weights / 1e9:.2f} GB), {args.repeat} runs each\n")
    print(
        table(
            [
                (cp, []),
                (cp_sync, []),
                (reshard, [("cp", cp), ("cp+sync", cp_sync), ("dcp_to_torch_save", to_torch)]),
                (to_torch, [("cp", cp)]),
                (convert, [("dcp_to_torch_save+save_file", to_hf)]),
                (to_hf, []),
                (verify, [("cp", cp)]),
            ]
        )
    )
    for leftover in (copy, peer_pt, peer_hf):
        fresh(leftover)


if __name__ == "__main__":
    main()
