"""verify catches broken checkpoints with exit 1 and a one-line reason naming the file."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from conftest import Evil, assert_fails, ckpt_quiet, run_folder_checkpoint
from safetensors.torch import save_file

from ckpt_cli.core.pickles.zipio import read_records


@pytest.fixture
def hf_copy(mixed_files, tmp_path):
    dest = tmp_path / "hf"
    shutil.copytree(mixed_files["hf"], dest)
    return dest


def shards(folder):
    return sorted(folder.glob("*.safetensors"))


def test_clean_checkpoints_pass(ckpt, mixed_files):
    for path in mixed_files.values():
        res = ckpt("verify", path, "--deep", "--finite")
        assert res.code == 0, res.out + res.err
        assert res.out.startswith("OK")


def test_truncated_shard(ckpt, hf_copy):
    shard = shards(hf_copy)[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 3)
    assert_fails(ckpt("verify", hf_copy), shard.name, "truncated")


def test_flipped_byte_found_with_manifest(ckpt, hf_copy, tmp_path):
    manifest = tmp_path / "manifest.json"
    assert ckpt("verify", hf_copy, "--deep", "--write-manifest", manifest).code == 0
    doc = json.loads(manifest.read_text())
    assert len(doc["files"]) == len(shards(hf_copy)) + 1 and "fp32" in doc["tensors"]
    shard = next(s for s in shards(hf_copy) if b'"fp32"' in s.read_bytes()[:4096])
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    assert ckpt("verify", hf_copy).code == 0  # structure alone cannot see it
    assert_fails(ckpt("verify", hf_copy, "--deep", "--manifest", manifest), shard.name, "differs from manifest")


def test_index_names_missing_file(ckpt, hf_copy):
    shard = shards(hf_copy)[1]
    shard.unlink()
    assert_fails(ckpt("verify", hf_copy), shard.name, "missing")


def test_index_points_at_wrong_shard(ckpt, hf_copy):
    index_path = hf_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    index_path.write_text(json.dumps(index))
    assert_fails(ckpt("verify", hf_copy), files[1], f"'{name}'", "absent from the shard")


def test_malformed_index_json(ckpt, hf_copy):
    (hf_copy / "model.safetensors.index.json").write_text("{ not json")
    assert_fails(ckpt("verify", hf_copy), "model.safetensors.index.json", "JSON")
    assert_fails(ckpt("inspect", hf_copy), "model.safetensors.index.json")


def write_raw_safetensors(path, header: dict, data: bytes) -> None:
    """A hand-made file for malformed-header cases (the real writer cannot produce them)."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_overlapping_offsets(ckpt, tmp_path):
    path = tmp_path / "bad.safetensors"
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    write_raw_safetensors(path, header, bytes(12))
    assert_fails(ckpt("verify", path), "bad.safetensors", "overlaps")


def test_offsets_past_the_end(ckpt, tmp_path):
    path = tmp_path / "bad.safetensors"
    write_raw_safetensors(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    assert_fails(ckpt("verify", path), "bad.safetensors", "past the end")


@pytest.mark.parametrize(
    "header",
    [
        b"{garbage",
        b'{"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}',
        b'["x"]',
        b'{"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}',
    ],
)
def test_malformed_headers(ckpt, tmp_path, header):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    assert_fails(ckpt("verify", path), "bad.safetensors")
    assert_fails(ckpt("convert", path, tmp_path / "out.pt", "--to", "torch"), "bad.safetensors")
    assert not (tmp_path / "out.pt").exists()


def test_header_length_beyond_file(ckpt, tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    assert_fails(ckpt("inspect", path, "--format", "safetensors"), "bad.safetensors", "header length")


def test_torch_file_flipped_byte_fails_crc(ckpt, mixed_files, tmp_path):
    path = tmp_path / "mixed.pt"
    with open(mixed_files["torch"], "rb") as f:
        record = read_records(f, "mixed.pt")["data/3"]
    data = bytearray(mixed_files["torch"].read_bytes())
    data[record.data_offset + record.size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert_fails(ckpt("verify", path, "--deep"), "mixed.pt", "CRC32")


def test_truncated_torch_file(ckpt, mixed_files, tmp_path):
    path = tmp_path / "mixed.pt"
    path.write_bytes(mixed_files["torch"].read_bytes()[:-300])
    assert_fails(ckpt("verify", path), "mixed.pt")
    assert_fails(ckpt("merge", path, tmp_path / "m.safetensors"), "mixed.pt")
    assert not (tmp_path / "m.safetensors").exists()


def test_malicious_pickle_is_refused_and_never_runs(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "payload": Evil(marker)}, tmp_path / "evil.pt")
    for command in (["inspect"], ["verify", "--deep"], ["merge"]):
        args = [*command, tmp_path / "evil.pt"] + ([tmp_path / "x.safetensors"] if command == ["merge"] else [])
        assert_fails(ckpt(*args), "evil.pt", "posix.system", "--trust-pickle")
    assert not marker.exists()


def test_finite_counts_nan_and_inf(ckpt, tmp_path):
    save_file({"ok": torch.ones(3), "bad": torch.tensor([1.0, float("nan"), float("inf"), float("-inf")])}, tmp_path / "n.safetensors")
    assert ckpt("verify", tmp_path / "n.safetensors").code == 0
    res = ckpt("verify", tmp_path / "n.safetensors", "--finite", "--json")
    assert res.code == 1
    report = json.loads(res.out)
    assert report["nonfinite"] == {"bad": {"nan": 1, "inf": 2}}


def test_against_across_formats_with_tolerances(ckpt, mixed_files, tmp_path):
    assert ckpt("verify", mixed_files["hf"], "--against", mixed_files["torch"]).code == 0
    sd = {"w": torch.arange(10.0)}
    save_file(sd, tmp_path / "a.safetensors")
    torch.save({"w": torch.arange(10.0) + 1e-4}, tmp_path / "b.pt")
    assert_fails(ckpt("verify", tmp_path / "a.safetensors", "--against", tmp_path / "b.pt"), "'w'", "differ")
    assert ckpt("verify", tmp_path / "a.safetensors", "--against", tmp_path / "b.pt", "--atol", "1e-3").code == 0
    torch.save({"w": torch.arange(10.0), "extra": torch.ones(1)}, tmp_path / "c.pt")
    assert_fails(ckpt("verify", tmp_path / "a.safetensors", "--against", tmp_path / "c.pt"), "'extra'", "missing")


def test_policy(ckpt, tmp_path):
    torch.save({"model": {"w": torch.ones(2, 2), "b": torch.ones(2).half()}, "optimizer": {"state": {}}, "step": 1}, tmp_path / "c.pt")
    good = tmp_path / "good.yaml"
    good.write_text(
        "tensors:\n  required: ['model.w']\n  dtypes: {'model.w': [float32]}\n  shapes: {'model.w': [2, 2]}\nfinite: true\nmin_params: 4\n"
    )
    assert ckpt("verify", tmp_path / "c.pt", "--policy", good).code == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("tensors:\n  required: ['lm_head.*']\n  dtypes: {'model.*': bf16}\ntraining_state: [lr_scheduler]\nmax_params: 3\n")
    res = ckpt("verify", tmp_path / "c.pt", "--policy", bad)
    assert_fails(res, "lm_head.*", "model.b", "lr_scheduler", "max_params")
    broken = tmp_path / "broken.yaml"
    broken.write_text("tensor: {}\n")
    res = ckpt("verify", tmp_path / "c.pt", "--policy", broken)
    assert res.code == 2 and "unknown key 'tensor'" in res.err


# --------------------------------------------------------------- verify --against pairs tensors as diff does

DEMO_FORMATS = ["model.safetensors", "training_state.pt", "hf", "dcp", "deepspeed"]  # one run in ckpt demo's formats
PERTURBABLE = ["model.safetensors", "hf", "training_state.pt", "dcp"]  # rewritten by their own library below
PERTURBED = "blocks.0.1.weight"  # a weight of the demo model (float32 [128, 32]), untied
PERTURBATIONS = {
    "value": lambda t: t.clone().index_put_((torch.tensor(0), torch.tensor(0)), t[0, 0] + 0.5),  # one element
    "missing": lambda t: None,
    "reshaped": lambda t: t.reshape(t.shape[1], t.shape[0]).clone(),
    "dtype": lambda t: t.to(torch.bfloat16),  # within --atol 1e-2 by value, not bit-exact
}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from ckpt_cli.ops.demo import write_demo

    folder = tmp_path_factory.mktemp("against") / "demo"
    write_demo(folder)
    return folder


def weight(name: str) -> bool:
    """A model tensor, not training state (optimizer.state.* by parameter, a producer's own optim.*, RNG states)."""
    return name.split(".")[0] not in ("optimizer", "optim", "rng", "lr_scheduler", "dataloader")


def diff_finds_a_model_difference(d: dict) -> bool:
    """What diff --json reports that a copy of the model must not have: a value outside the tolerance, a shape change,
    a dtype change without a tolerance, a weight only on one side or under another name."""
    exact = d["atol"] == 0 and d["rtol"] == 0
    one_sided = d["only_in_a"] + d["only_in_b"] + [r["a"] for r in d["renamed"]] + [r["b"] for r in d["renamed"]]
    return bool(
        any(not t["equal"] for t in d["tensors"])
        or d["shape_changed"]
        or (exact and d["dtype_changed"])
        or any(weight(n) for n in one_sided)
    )


def assert_agrees_with_diff(ckpt, a, b, *tolerance: str) -> dict:
    """verify A --against B exits 0 exactly when diff A B finds no model difference; the verdict, as JSON."""
    res = ckpt("verify", a, "--against", b, "--json", *tolerance)
    v = json.loads(res.out)
    d = json.loads(ckpt("diff", a, b, "--json", *tolerance).out)
    assert res.code == (1 if diff_finds_a_model_difference(d) else 0) and v["ok"] == (res.code == 0), (v, d)
    return v


def perturbed_copy(src, dest, how: str, name: str = PERTURBED):
    """A copy of a checkpoint whose weight `name` is changed by PERTURBATIONS[how], written by the format's own library
    (safetensors, torch.save, torch.distributed.checkpoint)."""
    from safetensors.torch import load_file

    change = PERTURBATIONS[how]

    def apply(sd: dict, key: str) -> None:
        new = change(sd.pop(key))
        if new is not None:
            sd[key] = new

    if src.suffix == ".safetensors":
        sd = load_file(src)
        apply(sd, name)
        save_file(sd, dest, metadata={"format": "pt"})
    elif src.suffix == ".pt":
        state = torch.load(src, weights_only=False)
        apply(state["model"], name)
        torch.save(state, dest)
    elif (src / "model.safetensors.index.json").exists():
        shutil.copytree(src, dest)
        index_path = dest / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        shard = dest / index["weight_map"][name]
        sd = load_file(shard)
        apply(sd, name)
        save_file(sd, shard, metadata={"format": "pt"})
        if name not in sd:
            del index["weight_map"][name]
        shards = {dest / f for f in index["weight_map"].values()}  # the index as the writer would have made it
        index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for f in shards for t in load_file(f).values())
        index_path.write_text(json.dumps(index))
    else:  # DCP: through torch's own format utilities
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

        flat = dest.parent / f"{dest.name}.pt"
        dcp_to_torch_save(src, flat)
        state = torch.load(flat, weights_only=False)
        apply(state["model"], name)
        torch.save(state, flat)
        torch_save_to_dcp(flat, dest)
    return dest


@pytest.fixture(scope="module")
def demo_perturbed(demo_run, tmp_path_factory):
    """(format, perturbation) -> the perturbed copy, made once."""
    out = tmp_path_factory.mktemp("perturbed")
    return {(fmt, how): perturbed_copy(demo_run / fmt, out / f"{how}-{fmt}", how) for fmt in PERTURBABLE for how in PERTURBATIONS}


@pytest.mark.parametrize("a,b", [(a, b) for a in DEMO_FORMATS for b in DEMO_FORMATS if a != b])
def test_against_pairs_every_demo_format_as_diff_does(ckpt, demo_run, demo_perturbed, a, b):
    """Every two formats of one run (weights exports, training checkpoints, DeepSpeed): verify --against passes as diff
    matches them (prefixes, optimizer state by parameter name, the tied head saved twice), states what one side cannot
    hold, and fails on a changed value, a missing weight, a reshaped one, a dtype change without a tolerance."""
    v = assert_agrees_with_diff(ckpt, demo_run / a, demo_run / b)
    assert v["ok"], v["problems"]
    holds_optimizer = {"training_state.pt", "dcp", "deepspeed"}
    if (a in holds_optimizer) != (b in holds_optimizer):
        assert any("optimizer tensors that" in n and "not compared" in n for n in v["notes"]), v["notes"]
    side = b if b in PERTURBABLE else a
    for how in PERTURBATIONS:
        bad = demo_perturbed[(side, how)]
        pair = (demo_run / a, bad) if side == b else (bad, demo_run / b)
        v = assert_agrees_with_diff(ckpt, *pair)
        assert not v["ok"] and any(f"{PERTURBED}'" in p for p in v["problems"]), (how, v["problems"])
        if how in ("value", "dtype"):  # by value within a tolerance: 0.5 is outside 0.1, bfloat16 rounding inside
            v = assert_agrees_with_diff(ckpt, *pair, "--atol", "0.1")
            assert v["ok"] == (how == "dtype"), (how, v["problems"])


CUTS = {  # the bytes kept of a file of `size` bytes
    "emptied": lambda size: 0,
    "one byte short": lambda size: size - 1,
    "half": lambda size: size // 2,
    "inside its header": lambda size: 20,
    "a few KB short": lambda size: max(size - 4096, 1),
}


def _victims(mixed_files, tiny_llama, tmp_path):
    """(what inspect is given, the file cut): safetensors.save_file, torch.save, the hub's and transformers' shards."""
    out = {}
    for name in ("safetensors", "torch"):
        out[name] = tmp_path / mixed_files[name].name
        shutil.copy(mixed_files[name], out[name])
    for name, src in (("hub-shards", mixed_files["hf"]), ("transformers-shards", tiny_llama[1] / "sharded")):
        shutil.copytree(src, tmp_path / name)
        out[f"{name} first"] = out[f"{name} last"] = tmp_path / name
    return out


@pytest.mark.parametrize("cut", list(CUTS))
def test_inspect_of_a_truncated_file_says_so(ckpt, mixed_files, tiny_llama, tmp_path, cut):
    """inspect of a checkpoint whose file is shorter than its header says (a full disk): exit 1, one line naming the
    file, nothing on stdout, whatever the output form."""
    for name, given in _victims(mixed_files, tiny_llama, tmp_path).items():
        victim = given if given.is_file() else shards(given)[-1 if name.endswith("last") else 0]
        data = victim.read_bytes()
        victim.write_bytes(data[: CUTS[cut](len(data))])
        for args in ((), ("--json",)):
            res = ckpt("inspect", given, *args)
            if name == "torch" and cut == "emptied":  # no magic bytes left: no format to name, a wrong call (exit 2)
                assert res.code == 2 and victim.name in res.err, res.err
            else:
                assert_fails(res, victim.name)
            assert res.out == "" and len(res.err.strip().splitlines()) == 1, (name, args, res.out, res.err)
        victim.write_bytes(data)


@pytest.fixture(scope="module")
def producer_exports(fsdp2_saves, run_folders, tmp_path_factory):
    """Real producers' training checkpoints and the weights exports ckpt makes of them: name -> (checkpoint, export)."""
    out = tmp_path_factory.mktemp("exports")
    dcp, ds = fsdp2_saves[2] / "ckpt", run_folder_checkpoint(run_folders["trainer-ds2"])
    ckpt_quiet("convert", dcp, out / "fsdp2-hf", "--to", "hf", "--weights-only", "--strip-prefix", "model.")
    ckpt_quiet("merge", dcp, out / "fsdp2.safetensors")  # keeps the DCP's own names (model.x): matched by name
    ckpt_quiet("merge", ds, out / "trainer-ds2.safetensors")  # DeepSpeed's module. prefix dropped: by parameter name
    return {
        "fsdp2-dcp-vs-hf": (dcp, out / "fsdp2-hf"),
        "fsdp2-dcp-vs-merged": (dcp, out / "fsdp2.safetensors"),
        "trainer-ds2-vs-merged": (ds, out / "trainer-ds2.safetensors"),
    }


def a_matrix(export) -> str:
    """A 2-D weight of an export that no other is tied to (not the embedding or the head)."""
    from safetensors import safe_open

    files = [export] if export.suffix == ".safetensors" else sorted(export.glob("*.safetensors"))
    names = []
    for f in files:
        with safe_open(f, "pt") as h:
            names += [n for n in h.keys() if len(h.get_slice(n).get_shape()) == 2]
    return sorted(n for n in names if "embed" not in n and "head" not in n)[0]


@pytest.mark.parametrize("case", ["fsdp2-dcp-vs-hf", "fsdp2-dcp-vs-merged", "trainer-ds2-vs-merged"])
def test_against_pairs_producer_checkpoints_with_their_exports(ckpt, producer_exports, tmp_path, case):
    """FSDP2's DCP save and DeepSpeed ZeRO-2 (Trainer) against the weights exports made of them, both ways: OK as diff
    matches them (the optimizer state only in the checkpoint is a note), and a changed, missing, reshaped or recast
    weight of the export fails, as diff finds it."""
    src, export = producer_exports[case]
    for a, b in ((src, export), (export, src)):
        v = assert_agrees_with_diff(ckpt, a, b)
        assert v["ok"] and any("optimizer" in n and "not compared" in n for n in v["notes"]), v
    name = a_matrix(export)
    for how in PERTURBATIONS:
        bad = perturbed_copy(export, tmp_path / f"{how}-{export.name}", how, name)
        for pair in ((src, bad), (bad, src)):
            v = assert_agrees_with_diff(ckpt, *pair)
            assert not v["ok"] and any(f"{name.removeprefix('model.')}'" in p for p in v["problems"]), (how, v["problems"])
            if how in ("value", "dtype"):
                assert assert_agrees_with_diff(ckpt, *pair, "--atol", "0.1")["ok"] == (how == "dtype"), how


def test_against_one_run_in_two_frameworks_with_tolerances(ckpt, run_folders):
    """Trainer on DeepSpeed ZeRO-2 and on FSDP2: matched by parameter name; float32 reduction order differs, so bit-exact
    fails and a tolerance passes, as diff says."""
    ds, fsdp = run_folder_checkpoint(run_folders["trainer-ds2"]), run_folder_checkpoint(run_folders["trainer-fsdp2"])
    assert not assert_agrees_with_diff(ckpt, ds, fsdp)["ok"]
    assert assert_agrees_with_diff(ckpt, ds, fsdp, "--rtol", "1e-5", "--atol", "1e-8")["ok"]
