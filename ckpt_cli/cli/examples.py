"""Each command's examples, shown under its --help and in the man page. Every one is a command of the tested tour
(the README's Try it command, then the console blocks of README.md and docs/, run by tests/test_readme.py), so none can rot:
tests/test_docs.py checks that each appears there verbatim. Followed in order after `ckpt demo demo`, a command's examples
run as shown: what one reads is in demo/ or written by an example above it (tests/test_help.py)."""

from __future__ import annotations

EXAMPLES: dict[str, list[str]] = {
    "inspect": [
        "ckpt inspect demo/deepspeed",
        "ckpt inspect demo/training_state.pt --tree --depth 2",
        "ckpt reshard demo/dcp out/dcp2 --world-size 2",
        "ckpt inspect out/dcp2 --tensors --filter 'model.lm_head.*' --filter 'rng*'",
    ],
    "verify": [
        "ckpt verify --deep demo/deepspeed",
        "ckpt verify --deep --finite --write-manifest manifest.json demo/hf",
        "ckpt verify demo/model.safetensors --against demo/hf",
    ],
    "convert": [
        "ckpt convert demo/dcp out/release --to hf --weights-only --strip-prefix model.",
        "ckpt convert demo/deepspeed out/fsdp8 --to dcp --world-size 8",
        "ckpt convert demo/dcp out/ds --to deepspeed --world-size 2 --zero-stage 2",
    ],
    "reshard": [
        "ckpt reshard demo/deepspeed out/ds8 --world-size 8",
        "ckpt reshard demo/dcp out/dcp2 --world-size 2",
        "ckpt convert demo/training_state.pt out/weights --to hf --weights-only --strip-prefix model.",
        "ckpt reshard out/weights out/two --num-shards 2",
    ],
    "merge": [
        "ckpt merge demo/deepspeed out/ds-weights.safetensors",
        "ckpt merge demo/hf out/model-bf16.safetensors --dtype bf16",
    ],
    "split": ["ckpt split demo/model.safetensors out/split --max-shard-size 30kB --dry-run"],
    "demo": ["ckpt demo demo", "ckpt demo demo --overwrite"],
    "ls": ["ckpt ls demo/run"],
    "completion": ["ckpt completion bash > ckpt.bash"],
    "diff": [
        "ckpt diff demo/hf demo/model.safetensors",
        "ckpt diff demo/dcp demo/deepspeed",
        "ckpt merge demo/hf out/model-bf16.safetensors --dtype bf16",
        "ckpt diff demo/model.safetensors out/model-bf16.safetensors --rtol 1e-2",
    ],
    "parity": [
        "ckpt convert demo/llama out/release-bf16 --to hf --dtype bf16",
        "ckpt parity out/release-bf16 --against demo/llama --atol 0.05 --quiet",
    ],
}


def epilog(command: str) -> str:
    """The Examples section of `command`'s --help (paragraphs: the help formatter keeps their line breaks)."""
    after = "" if command == "demo" else " (after 'ckpt demo demo')"
    return f"Examples{after}:\n\n" + "\n\n".join(f"  $ {line}" for line in EXAMPLES[command])
