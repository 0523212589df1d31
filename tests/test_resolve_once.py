"""One resolve (issue 51): a path is resolved once per call, so detection runs at most once per folder or file.

What is counted: every call of the four functions that detect what a path is, by (function, str(path)):
`formats.runs.detect.detect` (a framework's run checkpoint), `formats.registry.detect` (a core format),
`formats.registry.member_of` (one file of a checkpoint folder) and `formats.runs.detect.is_part_of` (the run
checkpoint a folder is part of). Each wraps the module attribute, which every caller (the functions' own modules
included) looks up at call time. The readers' own `detect` methods, which these ask, are not counted: one call of
runs.detect asks a reader about its folder more than once by design (_parts, _assemble).

Before one resolve (the same counts locally and on s3://), `inspect` of the Trainer root below entered runs.detect 9
times (the root 4, checkpoint-4 3, checkpoint-2 2) and registry.detect 4 times (the root); `open` and `convert` 5 and 2
(the root twice each, checkpoint-4 twice). Of the hf folder beside a torch file, inspect entered registry.detect 15
times (the root 6, extra.pt 5), runs.detect 13 and member_of 9. Now each is once per path: 3 + 1 and 4 + 4 (+ member_of).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckpt_cli
from ckpt_cli import api
from ckpt_cli.formats import registry
from ckpt_cli.formats.runs import detect as runs
from ckpt_cli.ops.resolve import resolve

COUNTED = ((runs, "detect"), (registry, "detect"), (registry, "member_of"), (runs, "is_part_of"))


@pytest.fixture
def detections(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[tuple[str, str]]]:
    """Every detection by (function, path), counted while the test runs."""
    calls: Counter[tuple[str, str]] = Counter()

    def counting(label: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(path: Path, *args: Any, **kwargs: Any) -> Any:
            calls[label, str(path)] += 1
            return inner(path, *args, **kwargs)

        return wrapper

    for module, name in COUNTED:
        label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
        monkeypatch.setattr(module, name, counting(label, getattr(module, name)))
    yield calls


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed.weight": torch.randn(8, 4, generator=g), "model.norm.weight": torch.randn(4, generator=g)}


def _trainer_root(root: Path) -> Path:
    """A Trainer output_dir with checkpoint-2/ and checkpoint-4/ (weights, trainer_state.json, config.json)."""
    for step in (2, 4):
        folder = root / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file(_weights(step), str(folder / "model.safetensors"))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 1.0, "log_history": []}))
        (folder / "config.json").write_text("{}")
    return root


def _hf_beside_a_file(root: Path) -> Path:
    """An hf folder by its model.safetensors that also holds a torch file: a run root by the one rule."""
    root.mkdir(parents=True)
    save_file(_weights(0), str(root / "model.safetensors"))
    (root / "config.json").write_text("{}")
    torch.save(_weights(1), root / "extra.pt")
    return root


def _at_most_once(calls: Counter[tuple[str, str]], root: str) -> None:
    twice = {key: n for key, n in calls.items() if n > 1}
    assert not twice, f"detected more than once: {twice}"
    assert calls["detect.detect", root] == 1 and calls["registry.detect", root] == 1, dict(calls)


def _inspect_open_convert(src: str, dest: Path, calls: Counter[tuple[str, str]], members: int) -> None:
    doc = api.inspect(src)
    assert len(doc["tags"]) == members and any("--tag PATH picks another" in n for n in doc["notes"]), doc["notes"]
    _at_most_once(calls, src)
    calls.clear()
    with ckpt_cli.open(src) as ckpt:
        assert ckpt.notes[0] == doc["notes"][0]
    _at_most_once(calls, src)
    calls.clear()
    report = api.convert(src, str(dest), to="safetensors", weights_only=True)
    assert report.written and dest.is_file()
    _at_most_once(calls, src)


@pytest.mark.parametrize("build", [_trainer_root, _hf_beside_a_file], ids=["trainer", "hf+pt"])
def test_a_local_run_root_is_detected_once_per_folder(tmp_path: Path, detections: Counter[tuple[str, str]], build: Any) -> None:
    root = build(tmp_path / "run")
    detections.clear()
    _inspect_open_convert(str(root), tmp_path / "out.safetensors", detections, 2)


def test_an_s3_run_root_is_detected_once_per_folder(s3: Any, tmp_path: Path, detections: Counter[tuple[str, str]]) -> None:
    url = s3.upload(_trainer_root(tmp_path / "run"), "resolve-once/run")
    detections.clear()
    _inspect_open_convert(url, tmp_path / "out.safetensors", detections, 2)
    # the counts that used to repeat: the root and the checkpoint chosen, once each by the run detector
    assert detections["detect.detect", f"{url}/checkpoint-4"] == 1


def test_the_resolved_value(tmp_path: Path) -> None:
    root = _trainer_root(tmp_path / "run")
    whole = resolve(str(root))
    assert whole.level == "root" and whole.root == root and whole.format is None and whole.chosen is None
    assert [f.path.name for f in whole.members] == ["checkpoint-2", "checkpoint-4"]
    assert [f.path.name for f in whole.candidates] == ["checkpoint-4", "checkpoint-2"]  # newest first
    tagged = resolve(str(root), tag="checkpoint-2")
    assert tagged.chosen is not None and tagged.chosen.path == root / "checkpoint-2"
    one = resolve(str(root / "checkpoint-4"))
    assert one.level == "run" and one.run is not None and one.run.framework == "trainer" and one.format is registry.get("safetensors")
    weights = resolve(str(root / "checkpoint-4" / "model.safetensors"))
    assert weights.level == "checkpoint" and weights.note is not None and "one part of the trainer checkpoint" in weights.note
    forced = resolve(str(root / "checkpoint-4" / "model.safetensors"), format="safetensors")
    assert forced.forced and forced.note is None
