"""The pickle guard's opcode scan in C (core/_pickle_scan.c) gives the Python scan's verdict on every pickle: the
hostile and legitimate pickles of test_hostile_pickles.py, real checkpoint pickles, and thousands of truncated
and mutated copies of them (seeded, so a failure reproduces)."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from test_hostile_pickles import HOSTILE, LEGIT

from ckpt_cli.core import pickle_guard
from ckpt_cli.core.pickle_guard import PickleRefused


def verdict(walk, data: bytes) -> str:
    try:
        return f"ok inexact={walk(data)}"
    except PickleRefused as exc:
        return f"refused: {exc}"


def python_walk(data: bytes) -> bool:
    return pickle_guard._Scan(data).run()


def c_walk(data: bytes) -> bool:
    return pickle_guard._walk(data)


def corpus() -> dict[str, bytes]:
    pickles = {f"hostile {name}": data for name, (data, _) in HOSTILE.items()}
    pickles.update({f"legit {name} p{p}": pickle.dumps(value, protocol=p) for name, value in LEGIT.items() for p in (0, 2, 4)})
    state = {"model": {f"layer{i}.weight": torch.zeros(2, 3) for i in range(20)}, "step": 3, "betas": (0.9, 0.999)}
    pickles["torch.save protocol 2"] = pickle.dumps(state, protocol=2)
    pickles["dcp-like records"] = pickle.dumps([{"offsets": (i, 0), "sizes": (1, 32), "fqn": f"l{i}"} for i in range(300)], protocol=2)
    return pickles


def test_the_c_scan_is_built():
    assert pickle_guard._pickle_scan is not None, "core/_pickle_scan.c was not built: pip install -e . needs a C compiler"


@pytest.mark.parametrize("name", list(corpus()))
def test_same_verdict(name):
    data = corpus()[name]
    assert verdict(c_walk, data) == verdict(python_walk, data)


def test_same_verdict_on_damaged_copies():
    rng = random.Random(20261202)
    seen = set()
    for name, data in corpus().items():
        if len(data) > 200_000:
            continue
        for _ in range(60):
            damaged = bytearray(data)
            kind = rng.randrange(3)
            if kind == 0:  # truncated
                damaged = damaged[: rng.randrange(len(damaged) + 1)]
            elif kind == 1:  # bytes changed
                for _ in range(rng.randrange(1, 4)):
                    damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            else:  # a span repeated (more opcodes of the same kinds)
                a = rng.randrange(len(damaged))
                b = min(len(damaged), a + rng.randrange(1, 40))
                damaged[a:a] = damaged[a:b] * rng.randrange(1, 5)
            python = verdict(python_walk, bytes(damaged))
            assert verdict(c_walk, bytes(damaged)) == python, (name, kind, bytes(damaged)[:200])
            seen.add(python.split(":")[0] if python.startswith("refused") else python)
    assert len(seen) >= 3  # the damage reached refusals and acceptances alike
