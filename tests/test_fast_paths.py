"""Fast paths give the reference path's answer: the pickle guard's opcode scan in C (core/pickles/_pickle_scan.c) the Python
scan's verdict on every pickle (the hostile and legitimate pickles of test_hostile_pickles.py, real checkpoint
pickles, thousands of truncated and mutated copies of them), and the in-memory zip directory parser of small archives
(core/pickles/zipio.py) zipfile's records or refusal on real torch.save archives and damaged copies. Damage is seeded, so a
failure reproduces."""

from __future__ import annotations

import io
import pickle
import random

import pytest
import torch
from test_hostile_pickles import HOSTILE, LEGIT

from ckpt_cli.core.pickles import pickle_guard, zipio
from ckpt_cli.core.pickles.pickle_guard import PickleRefused
from ckpt_cli.errors import DataError


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
    assert pickle_guard._pickle_scan is not None, "core/pickles/_pickle_scan.c was not built: pip install -e . needs a C compiler"


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


def damaged_copies(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        damaged = bytearray(data)
        kind = rng.randrange(3)
        if kind == 0:
            damaged = damaged[: rng.randrange(len(damaged) + 1)]
        elif kind == 1:
            for _ in range(rng.randrange(1, 4)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        else:  # a byte changed in the directory or the local headers, where the parsers look
            at = rng.choice([len(damaged) - rng.randrange(1, 23), rng.randrange(min(len(damaged), 200))])
            damaged[at] = rng.randrange(256)
        out.append(bytes(damaged))
    return out


def records(data: bytes, monkeypatch: pytest.MonkeyPatch | None, path: str = "fast") -> str:
    """read_records' verdict on `data`: by the fast paths (C, else Python), Python's plain parser, or zipfile's."""
    with monkeypatch.context() if monkeypatch else _nothing() as patch:
        if patch is not None:
            patch.setattr(zipio, "_zip_scan", None)
            if path == "zipfile":
                patch.setattr(zipio, "_plain_directory", lambda buf, base=0: None)
        try:
            return repr(zipio.read_records(io.BytesIO(data), "f.pt"))
        except DataError as exc:
            return f"refused: {exc}"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_small_archives_parse_as_zipfile_parses_them(monkeypatch):
    archives = []
    for value in (torch.arange(6.0).reshape(2, 3), {"a": torch.zeros(3, dtype=torch.bfloat16), "step": 2}, torch.tensor(1)):
        buf = io.BytesIO()
        torch.save(value, buf)
        archives.append(buf.getvalue())
    rng = random.Random(7)
    outcomes = set()
    for data in archives:
        assert zipio._plain_directory(data) is not None  # torch.save's layout takes the fast path
        assert zipio._zip_scan is None or zipio._zip_scan.records(data) is not None  # and the C walk's
        for copy in [data, *damaged_copies(data, rng, 300)]:
            fast = records(copy, None)
            assert fast == records(copy, monkeypatch, "python") == records(copy, monkeypatch, "zipfile"), copy[-64:]
            outcomes.add(fast.startswith("refused"))
    assert outcomes == {True, False}


def test_large_archives_parse_their_directory_from_the_tail_as_zipfile_does(monkeypatch):
    """An archive past WHOLE_BYTES is not read whole: its end records and directory are read from the tail (the
    ZeRO-3 model states of every rank hold thousands of records)."""
    buf = io.BytesIO()
    torch.save({"big": torch.zeros(zipio.WHOLE_BYTES // 4 + 1000), **{f"p{i}": torch.ones(i + 1) for i in range(300)}}, buf)
    data = buf.getvalue()
    assert len(data) > zipio.WHOLE_BYTES
    window = zipio._Window(io.BytesIO(data), 0, len(data))
    assert zipio._tail_directory(window) is not None  # torch.save's layout takes the fast path
    rng = random.Random(11)
    outcomes = set()
    for copy in [data, *damaged_copies(data, rng, 200)]:
        if len(copy) <= zipio.WHOLE_BYTES:
            continue
        fast = records(copy, None)
        assert fast == records(copy, monkeypatch, "zipfile"), copy[-64:]
        outcomes.add(fast.startswith("refused"))
    assert outcomes == {True, False}
