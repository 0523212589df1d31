"""An error names the options of the call its reader made: keyword names for a Python caller (`world_size`, `pass
overwrite=True`), flags for the CLI (`--world-size`, `pass --overwrite`). The same wrong call, made both ways."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import mixed_state_dict
from safetensors.torch import save_file

import ckpt_cli
from ckpt_cli.errors import CkptError, UsageError, worded

FLAG = re.compile(r"(?<![\w-])--[a-z]")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wording")
    sd = {k: v for k, v in mixed_state_dict().items() if v.is_floating_point()}
    save_file(sd, str(root / "m.safetensors"))
    ckpt_cli.split(root / "m.safetensors", root / "hf", num_shards=2)
    (root / "taken").mkdir()
    (root / "taken" / "x.txt").write_text("someone's file")
    shutil.copy(root / "m.safetensors", root / "exists.safetensors")
    return root


# (command, CLI arguments after SRC DST, the API's keyword arguments, the keyword the message must name)
CALLS = [
    ("convert", ["--to", "hf", "--world-size", "2"], {"to": "hf", "world_size": 2}, "world_size"),
    ("convert", ["--to", "dcp", "--tp", "2"], {"to": "dcp", "tp": 2}, "world_size"),
    ("split", ["--num-shards", "2", "--max-shard-size", "1MB"], {"num_shards": 2, "max_shard_size": "1MB"}, "max_shard_size"),
    ("reshard", ["--num-shards", "2", "--ep-size", "2"], {"num_shards": 2, "ep_size": 2}, "world_size"),
    ("convert", ["--to", "dcp", "--world-size", "2", "--layout", "nope"], {"to": "dcp", "world_size": 2, "layout": "nope"}, "layout"),
    (
        "convert",
        ["--to", "hf", "--preset", "megatron-gpt", "--name-map", "x.yaml"],
        {"to": "hf", "preset": "megatron-gpt", "name_map": "x"},
        "preset",
    ),
    ("merge", ["--all"], {"all": True}, "all"),
    ("convert", ["--to", "hf", "--quantize", "int3"], {"to": "hf", "quantize": "int3"}, "quantize"),
    ("convert", ["--to", "dcp"], {"to": "dcp"}, "world_size"),
]


@pytest.mark.parametrize("command, cli_args, kwargs, named", CALLS, ids=[f"{c[0]}-{c[3]}" for c in CALLS])
def test_a_wrong_call_names_its_options_in_the_readers_words(ckpt, sources, tmp_path, command, cli_args, kwargs, named):
    src = sources / ("hf" if command in ("reshard",) else "m.safetensors")
    dest = tmp_path / ("out.safetensors" if command == "merge" else "out")
    with pytest.raises(UsageError) as raised:
        getattr(ckpt_cli, command)(src, dest, **kwargs)
    message = str(raised.value)
    assert not FLAG.search(message), message
    assert re.search(rf"\b{named}\b", message), message
    res = ckpt(command, src, dest, *cli_args)
    assert res.code == 2, res.err
    assert f"--{named.replace('_', '-')}" in res.err, res.err
    assert not dest.exists()


@pytest.mark.parametrize("api_call", ["convert", "verify_manifest"])
def test_a_fix_is_worded_for_its_reader(ckpt, sources, tmp_path, api_call):
    if api_call == "convert":
        with pytest.raises(CkptError, match=r"pass overwrite=True to replace it$"):
            ckpt_cli.convert(sources / "m.safetensors", sources / "exists.safetensors", to="safetensors")
        res = ckpt("convert", sources / "m.safetensors", sources / "exists.safetensors", "--to", "safetensors")
    else:
        manifest = tmp_path / "m.json"
        manifest.write_text("{}")
        with pytest.raises(CkptError, match=r"pass overwrite=True to replace it$"):
            ckpt_cli.verify(sources / "m.safetensors", write_manifest=manifest)
        res = ckpt("verify", sources / "m.safetensors", "--write-manifest", manifest)
    assert res.err.rstrip().endswith("pass --overwrite to replace it"), res.err


def test_quoted_command_lines_and_names_stay_as_written():
    assert worded("give --num-shards/--max-shard-size") == "give num_shards/max_shard_size"
    quoted = "convert it (ckpt convert SRC DST --to dcp --world-size N)"
    assert worded(quoted) == quoted
    assert worded("`--dtype bf16` dequantizes") == "`--dtype bf16` dequantizes"
    assert worded("run--2/model--x.pt: truncated") == "run--2/model--x.pt: truncated"
