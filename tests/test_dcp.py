"""DCP: checkpoints saved by real FSDP2 + dcp.save under torchrun; results loaded by dcp.load,
dcp_to_torch_save, FSDP2 set_state_dict (under torchrun) and transformers."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Evil, assert_fails, assert_same_tensors, ckpt_quiet, torchrun
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

RESHARDS = [(2, 3), (3, 2), (2, 1), (1, 4)]


def flat_state(path) -> dict:
    """Everything a single-process dcp.load gives (via dcp_to_torch_save), flattened to dotted keys."""
    out = path.parent / f"{path.name}.full.pt"
    if not out.exists():
        dcp_to_torch_save(path, out)
    flat: dict = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                walk(v, f"{prefix}.{i}")
        else:
            flat[prefix] = value

    walk(torch.load(out, weights_only=False), "")
    return flat


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def raw_metadata(path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # our own test output and torch's: trusted here


@pytest.fixture(scope="session")
def resharded(fsdp2_saves, tmp_path_factory):
    root = tmp_path_factory.mktemp("resharded")
    out = {}
    for src, dst in RESHARDS:
        out[(src, dst)] = root / f"{src}to{dst}"
        ckpt_quiet("reshard", fsdp2_saves[src] / "ckpt", out[(src, dst)], "--world-size", dst)
    return out


@pytest.fixture(scope="session")
def released(fsdp2_saves, tmp_path_factory):
    """Model weights exported to hf, then brought back as DCP for 3 ranks (fine-tuning from a release)."""
    root = tmp_path_factory.mktemp("released")
    ckpt_quiet("convert", fsdp2_saves[2] / "ckpt", root / "hf", "--to", "hf", "--weights-only", "--strip-prefix", "model.")
    ckpt_quiet("merge", root / "hf", root / "weights.safetensors")
    ckpt_quiet("convert", root / "hf", root / "from_hf", "--to", "dcp", "--world-size", 3, "--add-prefix", "model.")
    ckpt_quiet("convert", root / "weights.safetensors", root / "from_st", "--to", "dcp", "--world-size", 3, "--add-prefix", "model.")
    torch.save({"model": load_file(root / "weights.safetensors")}, root / "weights.pt")
    ckpt_quiet("convert", root / "weights.pt", root / "from_pt", "--to", "dcp", "--world-size", 3)
    return root


def test_inspect_reads_metadata_only(ckpt, fsdp2_saves):
    src = fsdp2_saves[2] / "ckpt"
    doc = json.loads(ckpt("inspect", src, "--json").out)
    assert doc["format"] == "dcp" and doc["world_size"] == 2 and doc["step"] == 3
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["model.embed.weight"] == {
        "name": "model.embed.weight",
        "dtype": "float32",
        "shape": [37, 12],
        "role": "model",
        "pieces": 2,
    }
    assert tensors["optim.state.head.bias.exp_avg_sq"]["role"] == "optimizer"
    assert tensors["optim.state.head.bias.step"]["shape"] == [] and tensors["rng"]["role"] == "other"
    state = doc["training_state"]
    assert state["optimizer"]["kind"] == "Adam/AdamW" and state["optimizer"]["param_groups"] == 2
    assert state["dataloader"] == {"epoch": 0, "offset": 12} and state["rng"]
    assert doc["details"]["key_layout"] == "get_state_dict" and doc["details"]["sharded_tensors"] == 45
    assert doc["num_params"] == sum(t.numel() for k, t in flat_state(src).items() if k.startswith("model."))
    # No tensor data and not even torch is needed to inspect.
    code = (
        "import sys; from ckpt_cli.ops.inspect import summary; from ckpt_cli.ops.source import open_checkpoint; "
        f"summary(open_checkpoint({str(src)!r})); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("src,dst", RESHARDS)
def test_reshard_writes_the_layout_fsdp2_saves(fsdp2_saves, resharded, src, dst):
    ours, real = raw_metadata(resharded[(src, dst)]), raw_metadata(fsdp2_saves[dst] / "ckpt")
    assert ours.state_dict_metadata == real.state_dict_metadata
    assert ours.planner_data == real.planner_data
    assert ours.version == real.version == "1.0.0"
    assert sorted(p.name for p in resharded[(src, dst)].glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(dst)]


@pytest.mark.parametrize("src,dst", RESHARDS)
def test_reshard_loads_bit_exactly_in_one_process(fsdp2_saves, resharded, src, dst):
    assert_same_state(flat_state(resharded[(src, dst)]), flat_state(fsdp2_saves[src] / "ckpt"))


def test_fsdp2_loads_resharded_and_released_checkpoints(fsdp2_saves, resharded, released):
    """At every new world size FSDP2 + AdamW load with set_state_dict: shards, lr, step, RNG and dataloader equal
    the source; one more step equals the source run's next step (to float32 rounding: gradients are averaged in
    another order). At 3 ranks, the weights converted from hf, safetensors and torch load into FSDP2 for fine-tuning."""
    weights = released / "weights.safetensors"
    for (src, dst), path in resharded.items():
        tasks = [f"load:{path}:{fsdp2_saves[src] / 'reference.pt'}"]
        if dst == 3:
            tasks += [f"finetune:{released / name}:{weights}" for name in ("from_hf", "from_st", "from_pt")]
        out = torchrun(dst, "fsdp2.py", "check", *tasks)
        assert out.count("LOAD-OK") == 1 and out.count("FINETUNE-OK") == (3 if dst == 3 else 0)


def test_convert_to_hf_equals_dcp_to_torch_save(ckpt, fsdp2_saves, tmp_path):
    src = fsdp2_saves[2] / "ckpt"
    res = ckpt("convert", src, tmp_path / "hf", "--to", "hf", "--weights-only", "--strip-prefix", "model.", "-q")
    assert res.code == 0, res.err
    ours = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        ours.update(load_file(shard))
    reference = {k.removeprefix("model."): v for k, v in flat_state(src).items() if k.startswith("model.")}
    assert_same_tensors(ours, reference)


def test_fsdp2_trained_transformer_loads_with_from_pretrained(ckpt, fsdp2_saves, tmp_path):
    from transformers import LlamaForCausalLM

    src = fsdp2_saves[2] / "llama"
    out = tmp_path / "release"
    assert ckpt("convert", src, out, "--to", "hf", "--weights-only", "--strip-prefix", "model.", "--max-shard-size", "40KB", "-q").code == 0
    for f in (fsdp2_saves[2] / "llama_config").iterdir():
        shutil.copy(f, out / f.name)
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    reference = {k.removeprefix("model."): v for k, v in flat_state(src).items() if k.startswith("model.")}
    assert_same_tensors(model.state_dict(), reference)


def test_dcp_roundtrips_through_torch_and_back(ckpt, fsdp2_saves, tmp_path):
    """Everything (weights, moments, param groups, step, RNG, dataloader) survives dcp -> torch -> dcp."""
    src = fsdp2_saves[3] / "ckpt"
    assert ckpt("convert", src, tmp_path / "all.pt", "--to", "torch", "-q").code == 0
    loaded = torch.load(tmp_path / "all.pt", weights_only=True)
    assert loaded["step"] == 3 and loaded["optim"]["param_groups"][1]["weight_decay"] == 0.0
    assert ckpt("convert", tmp_path / "all.pt", tmp_path / "back", "--to", "dcp", "--world-size", "3", "-q").code == 0
    assert_same_state(flat_state(tmp_path / "back"), flat_state(src))
    assert raw_metadata(tmp_path / "back").state_dict_metadata == raw_metadata(src).state_dict_metadata


def test_dcp_load_into_plain_tensors(resharded, fsdp2_saves):
    """dcp.load without a process group, into preallocated tensors, as a script would."""
    path = resharded[(2, 3)]
    reference = flat_state(fsdp2_saves[2] / "ckpt")
    state = {"model": {k.removeprefix("model."): torch.empty_like(v) for k, v in reference.items() if k.startswith("model.")}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for k, v in state["model"].items():
        assert torch.equal(v, reference[f"model.{k}"]), k


# ---- verify: broken checkpoints --------------------------------------------------------------


@pytest.fixture
def copy_w2(fsdp2_saves, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(fsdp2_saves[2] / "ckpt", dest)
    return dest


def rewrite_metadata(path, change):
    meta = raw_metadata(path)
    change(meta)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def test_verify_passes_real_and_resharded(ckpt, fsdp2_saves, resharded):
    for path in [fsdp2_saves[w] / "ckpt" for w in (1, 2, 3, 4)] + list(resharded.values()):
        res = ckpt("verify", path, "--deep")
        assert res.code == 0, res.out + res.err


def test_verify_missing_distcp(ckpt, copy_w2):
    (copy_w2 / "__1_0.distcp").unlink()
    assert_fails(ckpt("verify", copy_w2), "__1_0.distcp", "missing")


def test_verify_truncated_distcp(ckpt, copy_w2):
    path = copy_w2 / "__0_0.distcp"
    os.truncate(path, path.stat().st_size - 500)
    os.utime(copy_w2 / ".metadata")
    assert_fails(ckpt("verify", copy_w2), "__0_0.distcp")


def test_verify_deep_finds_a_flipped_byte(ckpt, copy_w2):
    meta = raw_metadata(copy_w2)
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "model.embed.weight" and k.offset[0] == 0)
    path = copy_w2 / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length - 900] ^= 0x10  # inside the chunk's data record
    path.write_bytes(bytes(data))
    os.utime(copy_w2 / ".metadata")
    assert ckpt("verify", copy_w2).code == 0  # structure alone cannot see it
    assert_fails(ckpt("verify", copy_w2, "--deep"), info.relative_path, "CRC32")


@pytest.mark.parametrize("start,problem", [(20, "no piece covers"), (18, "overlap")])
def test_verify_chunks_that_do_not_tile(ckpt, copy_w2, start, problem):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def shift(meta):
        chunk = meta.state_dict_metadata["model.embed.weight"].chunks[1]
        old = MetadataIndex("model.embed.weight", chunk.offsets)
        chunk.offsets = torch.Size([start, 0])
        meta.storage_data[MetadataIndex("model.embed.weight", chunk.offsets)] = meta.storage_data.pop(old)

    rewrite_metadata(copy_w2, shift)
    assert_fails(ckpt("verify", copy_w2), "model.embed.weight", problem)


def test_verify_metadata_past_the_end_of_a_file(ckpt, copy_w2):
    def stretch(meta):
        key = next(k for k in meta.storage_data if k.fqn == "model.head.bias")
        meta.storage_data[key].length += 100_000

    rewrite_metadata(copy_w2, stretch)
    assert_fails(ckpt("verify", copy_w2), "model.head.bias", "truncated")


def test_verify_two_items_stored_in_one_byte_range(ckpt, copy_w2):
    """Two storage entries naming the same bytes (each a valid archive of the right shape): dcp.load would read one
    tensor's data for the other."""

    def alias(meta):
        weight = next(k for k in meta.storage_data if k.fqn == "model.embed.weight" and k.offset[0] == 0)
        moment = next(k for k in meta.storage_data if k.fqn.endswith("embed.weight.exp_avg") and k.offset == weight.offset)
        meta.storage_data[moment] = copy.copy(meta.storage_data[weight])

    rewrite_metadata(copy_w2, alias)
    assert_fails(ckpt("verify", copy_w2), "byte ranges", "overlap")


def test_verify_leftovers(ckpt, copy_w2):
    shutil.copy(copy_w2 / "__1_0.distcp", copy_w2 / "__5_0.distcp")
    (copy_w2 / ".metadata.tmp").write_bytes(b"")
    os.utime(copy_w2 / ".metadata")
    assert_fails(ckpt("verify", copy_w2), "__5_0.distcp", "not referenced", ".metadata.tmp")


def test_malicious_metadata_is_refused_and_never_runs(ckpt, copy_w2, tmp_path):
    marker = tmp_path / "pwned"
    (copy_w2 / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Evil(marker)}))
    for command in ("inspect", "verify"):
        assert_fails(ckpt(command, copy_w2), ".metadata", "posix.system")
    assert_fails(ckpt("convert", copy_w2, tmp_path / "o", "--to", "hf"), "posix.system")
    assert not marker.exists() and not (tmp_path / "o").exists()


# ---- variants ----------------------------------------------------------------------------------


def test_unsupported_variants_are_named(ckpt, tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    sd = {"w": torch.randn(4, 3), "step": 3}
    with pytest.warns(UserWarning):
        dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "st", serialization_format=SerializationFormat.SAFETENSORS), no_dist=True)
        dcp.save(sd, checkpoint_id=tmp_path / "local", no_dist=True, use_collectives=False)
    res = ckpt("inspect", tmp_path / "st")  # read since issue 13 (tests/test_dcp_safetensors.py)
    assert res.code == 0 and "serialization=safetensors" in res.out
    res = ckpt("inspect", tmp_path / "local")
    assert res.code == 2 and "use_collectives=False" in res.err
    dcp.save(sd, checkpoint_id=tmp_path / "zstd", no_dist=True)
    rewrite_metadata(tmp_path / "zstd", lambda m: [setattr(v, "transform_descriptors", ["stream.zstd/1"]) for v in m.storage_data.values()])
    res = ckpt("inspect", tmp_path / "zstd")
    assert res.code == 2 and "stream.zstd" in res.err


def test_single_process_save_converts(ckpt, tmp_path):
    """A plain dcp.save without a process group (one rank, no planner nesting) converts to safetensors."""
    sd = {"a": torch.randn(5, 3), "b": torch.arange(7), "t": torch.randn(4, 6).t()}
    dcp.save(sd, checkpoint_id=tmp_path / "c", no_dist=True)
    assert ckpt("merge", tmp_path / "c", tmp_path / "m.safetensors", "-q").code == 0
    assert_same_tensors(load_file(tmp_path / "m.safetensors"), sd)


def _records(path, rel):
    return sorted((i for i in raw_metadata(path).storage_data.values() if i.relative_path == rel), key=lambda i: i.offset)


TRUNCATIONS = {  # the bytes kept of a data file of `size` bytes
    "emptied": lambda path, rel, size: 0,
    "one byte short": lambda path, rel, size: size - 1,
    "half": lambda path, rel, size: size // 2,
    "inside its last record": lambda path, rel, size: _records(path, rel)[-1].offset + _records(path, rel)[-1].length // 2,
    "inside its first record": lambda path, rel, size: _records(path, rel)[0].offset + 100,
    "at a record boundary": lambda path, rel, size: _records(path, rel)[-1].offset,
}


@pytest.mark.parametrize("cut", list(TRUNCATIONS))
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 2), (4, 3)], ids=["w2-first", "w2-last", "w4-middle", "w4-last"])
def test_inspect_of_a_truncated_data_file_says_incomplete(ckpt, fsdp2_saves, tmp_path, cut, world, rank):
    """A data file shorter than the records `.metadata` places in it (a full disk): inspect exits 1 with one line
    naming the file, in every output form; nothing printed as if it were whole."""
    dest = tmp_path / "ckpt"
    shutil.copytree(fsdp2_saves[world] / "ckpt", dest)
    rel = f"__{rank}_0.distcp"
    size = (dest / rel).stat().st_size
    keep = TRUNCATIONS[cut](dest, rel, size)
    assert 0 <= keep < size
    os.truncate(dest / rel, keep)
    for args in ((), ("--json",), ("--yaml",), ("--tensors",), ("--tree",)):
        res = ckpt("inspect", dest, *args)
        assert_fails(res, rel)
        assert res.out == "" and len(res.err.strip().splitlines()) == 1, (args, res.out, res.err)
    assert_fails(ckpt("verify", dest), rel)
