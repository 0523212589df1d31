"""The Python API raises CkptError subclasses only: damaged copies of real checkpoints of every format (truncated,
bytes flipped, files swapped for wrong JSON, a folder or a FIFO, nesting and integers out of bounds) go through
`ckpt_cli.open`, `inspect` and `verify(deep=True)`, and any other exception fails the test, naming the case."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import ckpt_cli
from ckpt_cli.errors import CkptError

Damage = Callable[[Path], None]


def _truncate(fraction: float) -> Damage:
    def damage(path: Path) -> None:
        os.truncate(path, int(path.stat().st_size * fraction))

    return damage


def _flip(seed: int, count: int, within: int | None) -> Damage:
    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        rng = random.Random(seed)
        span = min(len(data), within or len(data))
        for _ in range(count if span else 0):
            data[rng.randrange(span)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))

    return damage


def _replace(content: bytes) -> Damage:
    def damage(path: Path) -> None:
        path.write_bytes(content)

    return damage


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


BINARY_DAMAGE: dict[str, Damage] = {
    "empty": _truncate(0.0),
    "truncated to a tenth": _truncate(0.1),
    "truncated to half": _truncate(0.5),
    "one byte short": _truncate(0.9999),
    "header bits flipped": _flip(1, 6, 4096),
    "bits flipped anywhere": _flip(2, 24, None),
    "garbage": _replace(b"\x00garbage" * 64),
    "a folder": _folder,
    "a FIFO": _fifo,
}
JSON_DAMAGE: dict[str, Damage] = {
    "a list": _replace(b"[]"),
    "wrong types": _replace(json.dumps({"weight_map": {"a": 5}, "metadata": [], "sharded_backend": 3, "global_step": "x"}).encode()),
    "nested 100,000 deep": _replace(b"[" * 100_000 + b"]" * 100_000),
    "a 5,000-digit integer": _replace(b'{"global_step": ' + b"7" * 5000 + b"}"),
    "not UTF-8": _replace(b'{"a": "\xff\xfe"}'),
}


def _sources(fsdp2_saves, ds_saves, mixed_files, tiny_llama) -> dict[str, Path]:
    return {
        "dcp": fsdp2_saves[2] / "ckpt",
        "deepspeed": ds_saves[2] / "stage3-fp32",
        "hf": tiny_llama[1] / "sharded",
        "safetensors": mixed_files["safetensors"],
        "torch": mixed_files["torch"],
    }


def _members(copy: Path) -> list[Path]:
    """The files a damage is applied to: a few of each checkpoint's own (metadata, index, first and last data file)."""
    if copy.is_file():
        return [copy]
    files = sorted(p for p in copy.rglob("*") if p.is_file() and p.name != "reference.pt")
    picked = [p for p in files if p.suffix == ".json" or p.name in (".metadata", "latest")]
    data = [p for p in files if p not in picked]
    return picked + data[:1] + data[-1:]


def _calls(path: Path) -> list[tuple[str, Callable[[], object]]]:
    return [
        ("open", lambda: ckpt_cli.open(path)),
        ("inspect", lambda: ckpt_cli.inspect(path)),
        ("verify --deep", lambda: ckpt_cli.verify(path, deep=True, finite=True)),
    ]


@pytest.mark.parametrize("name", ["dcp", "deepspeed", "hf", "safetensors", "torch"])
def test_the_api_raises_ckpt_errors_only(tmp_path, name, fsdp2_saves, ds_saves, mixed_files, tiny_llama):
    source = _sources(fsdp2_saves, ds_saves, mixed_files, tiny_llama)[name]
    pristine = tmp_path / "pristine"
    (shutil.copytree if source.is_dir() else shutil.copy)(source, pristine)
    failures = []
    cases = 0
    for member in _members(pristine):
        relative = member.relative_to(pristine) if member != pristine else Path(member.name)
        damages = JSON_DAMAGE if member.suffix == ".json" else BINARY_DAMAGE
        for label, damage in damages.items():
            copy = tmp_path / f"case{cases}"
            (shutil.copytree if pristine.is_dir() else shutil.copy)(pristine, copy)
            target = copy / relative if pristine.is_dir() else copy
            damage(target)
            cases += 1
            for call, run in _calls(copy):
                try:
                    run()
                except CkptError:
                    pass
                except BaseException as exc:  # noqa: BLE001 - the point: anything else is a failure
                    failures.append(f"{call} of {name} with {relative} {label}: {type(exc).__name__}: {str(exc)[:160]}")
            shutil.rmtree(copy) if copy.is_dir() else copy.unlink()
    assert cases >= len(BINARY_DAMAGE)
    assert not failures, "\n".join(failures)
