"""The edges a new user or an attacker reaches first: options outside the documented set, a file inside a
checkpoint given as the checkpoint, a destination inside its source. Each case is one row and fails on its own."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_fails

import ckpt_cli
from ckpt_cli.errors import Terminated, UsageError

BAD_DTYPES = ["int8", "uint8", "bool", "float8_e4m3fn", "float64", "int64", "nonsense", ""]


@pytest.mark.parametrize("dtype", BAD_DTYPES)
@pytest.mark.parametrize("command", ["merge", "convert", "split"])
def test_dtype_outside_the_documented_set_is_refused(ckpt, mixed_files, tmp_path, dtype, command):
    dest = tmp_path / ("out.safetensors" if command == "merge" else "out")
    args = {"merge": [], "convert": ["--to", "hf"], "split": []}[command]
    res = ckpt(command, mixed_files["hf"], dest, *args, "--dtype", dtype)
    assert res.code == 2 and "Traceback" not in res.err, res.err
    assert "keep, fp32, bf16, fp16" in res.err
    assert not dest.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", ["keep", "fp32", "bf16", "fp16", "float32", "BF16"])
def test_documented_dtypes_are_taken(ckpt, mixed_files, tmp_path, dtype):
    assert ckpt("merge", mixed_files["hf"], tmp_path / "out.safetensors", "--dtype", dtype).code == 0


def test_api_dtype_outside_the_set_raises_usage_error(mixed_files, tmp_path):
    with pytest.raises(UsageError, match="keep, fp32, bf16, fp16"):
        ckpt_cli.merge(mixed_files["hf"], tmp_path / "out.safetensors", dtype="int8")
    assert not (tmp_path / "out.safetensors").exists()


# ---- a file inside a checkpoint, ls, merge --all -------------------------------------------------------------


def _members(fsdp2_saves, ds_saves, tiny_llama) -> dict[str, tuple[Path, Path]]:
    """(a file inside a real checkpoint, the checkpoint folder that holds it)."""
    dcp, ds, hf = fsdp2_saves[2] / "ckpt", ds_saves[2] / "stage2-fp32" / "global_step3", tiny_llama[1] / "sharded"
    return {
        "dcp data file": (dcp / "__0_0.distcp", dcp),
        "dcp metadata": (dcp / ".metadata", dcp),
        "hf shard": (hf / "model-00001-of-00006.safetensors", hf),
        "hf index": (hf / "model.safetensors.index.json", hf),
        "deepspeed model states": (ds / "mp_rank_00_model_states.pt", ds),
        "deepspeed optimizer states": (ds / "zero_pp_rank_1_mp_rank_00_optim_states.pt", ds),
        "deepspeed latest": (ds.parent / "latest", ds.parent),
    }


MEMBERS = ["dcp data file", "dcp metadata", "hf shard", "hf index"]
MEMBERS += ["deepspeed model states", "deepspeed optimizer states", "deepspeed latest"]


@pytest.mark.parametrize("member", MEMBERS)
def test_a_file_inside_a_checkpoint_is_refused_naming_the_checkpoint(ckpt, tmp_path, member, fsdp2_saves, ds_saves, tiny_llama):
    path, holder = _members(fsdp2_saves, ds_saves, tiny_llama)[member]
    assert path.exists(), path
    for args in (["inspect", path], ["verify", path], ["merge", path, tmp_path / "out.safetensors"]):
        res = ckpt(*args)
        assert res.code == 2 and "Traceback" not in res.err, (args, res.err)
        assert "one file of the" in res.err and str(holder) in res.err, res.err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="not a checkpoint by itself"):
        ckpt_cli.open(path)


def test_format_reads_one_shard_alone(ckpt, tiny_llama):
    shard = tiny_llama[1] / "sharded" / "model-00001-of-00006.safetensors"
    assert ckpt("verify", shard, "--format", "safetensors").code == 0


@pytest.mark.parametrize("which", ["dcp", "hf", "deepspeed tag"])
def test_ls_of_a_checkpoint_folder_lists_the_checkpoint_not_its_files(ckpt, which, fsdp2_saves, ds_saves, tiny_llama):
    folders = {"dcp": fsdp2_saves[2] / "ckpt", "hf": tiny_llama[1] / "sharded"}
    folder = folders.get(which) or ds_saves[2] / "stage2-fp32" / "global_step3"
    res = ckpt("ls", folder, "--json")
    assert res.code == 0, res.err
    rows = json.loads(res.out)["checkpoints"]
    assert [(r["path"], r["newest"]) for r in rows] == [(".", True)]


def test_ls_of_a_deepspeed_folder_lists_its_tags(ckpt, ds_saves):
    rows = json.loads(ckpt("ls", ds_saves[2] / "stage2-fp32", "--json").out)["checkpoints"]
    assert [r["path"] for r in rows if r["format"] == "deepspeed"] == ["global_step3"]  # the producer also left reference.pt
    assert not any(r["path"].startswith("global_step3/") for r in rows)


@pytest.mark.parametrize("config", ["stage2-fp32", "stage1-bf16"])
def test_merge_all_of_deepspeed_writes_each_weight_once(ckpt, tmp_path, ds_saves, config):
    dest = tmp_path / "all.pt"
    res = ckpt("merge", ds_saves[2] / config, dest, "--all")
    assert res.code == 0 and "left out" in res.err, res.err
    merged = torch.load(dest, weights_only=True)
    flat = {k for k in merged if isinstance(merged[k], torch.Tensor)}
    assert not any(k.startswith("module.") for k in merged), sorted(merged)
    weights = json.loads(ckpt("inspect", ds_saves[2] / config, "--json").out)
    assert weights["num_params"] == json.loads(ckpt("inspect", dest, "--json").out)["num_params"]
    assert flat  # the weights are there, each once


# ---- a destination inside its source ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command,args",
    [
        ("convert", ["--to", "hf"]),
        ("convert", ["--to", "safetensors"]),
        ("reshard", ["--world-size", "1"]),
        ("merge", []),
        ("split", ["--num-shards", "2"]),
    ],
)
def test_a_destination_inside_the_source_is_refused(ckpt, tmp_path, fsdp2_saves, command, args):
    src = tmp_path / "ckpt"
    shutil.copytree(fsdp2_saves[2] / "ckpt", src)
    before = sorted(p.name for p in src.iterdir())
    dest = src / ("out.safetensors" if command in ("merge",) or args[-1] == "safetensors" else "sub") / "deeper"
    dest = dest.parent if dest.parent.suffix else dest
    res = ckpt(command, src, dest, *args)
    assert res.code == 2 and "inside the source" in res.err, res.err
    assert sorted(p.name for p in src.iterdir()) == before
    res = ckpt(command, src, dest, *args, "--dry-run")
    assert res.code == 0 and "the real run will refuse" in res.out + res.err


def test_a_sibling_of_a_single_file_source_is_fine(ckpt, tmp_path, mixed_files):
    src = tmp_path / "mixed.safetensors"
    shutil.copy(mixed_files["safetensors"], src)
    assert ckpt("merge", src, tmp_path / "copy.pt").code == 0


# ---- signals at any moment, start-up included ------------------------------------------------------------------


def test_a_sigterm_in_torch_code_is_sent_again_not_raised_there(monkeypatch):
    """An exception raised by the SIGTERM handler inside torch's import can cross pybind11's C++ frames and abort the
    process (exit -6, no word; 1 run in 60 of the start-up test below did). A signal landing in a frame of torch's
    code, however deep, is sent again 20 ms later (at most 100 times); one landing elsewhere is handled at once."""
    import os
    import types

    from ckpt_cli import interrupt

    def frame(path: str, back: object = None) -> object:
        return types.SimpleNamespace(f_code=types.SimpleNamespace(co_filename=path), f_back=back)

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(interrupt, "RESEND_S", 0.0)
    monkeypatch.setattr(interrupt, "_resent", [0])
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    ours = frame(str(Path(ckpt_cli.__file__).parent / "cli" / "app.py"))
    inner = frame("/usr/lib/python3/importlib/_bootstrap.py", frame(torch.__file__, ours))
    named_torch = frame(f"{os.sep}home{os.sep}torch{os.sep}ckpt_cli{os.sep}app.py")  # a folder called torch is not torch
    assert not interrupt.deferred(signal.SIGTERM, ours) and not interrupt.deferred(signal.SIGTERM, None)
    assert not interrupt.deferred(signal.SIGTERM, named_torch)
    assert interrupt.deferred(signal.SIGTERM, inner) is True
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [(os.getpid(), signal.SIGTERM)]
    monkeypatch.setattr(interrupt, "_resent", [interrupt.RESENDS])  # put off long enough: raised where it lands
    assert not interrupt.deferred(signal.SIGTERM, inner)


@pytest.mark.parametrize("sig,code,line", [(signal.SIGINT, 130, "ckpt: error: interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_signal_during_start_up_gives_one_line_and_the_exit_code(tmp_path, mixed_files, sig, code, line):
    """Signals from the first milliseconds of ckpt's own code on (imports of typer, numpy, torch) to the write itself.
    Before that the interpreter is still starting: no Python code can handle a signal there. `up` is printed once
    the entry module (3 ms of imports, no handler yet) is loaded, microseconds before main() installs them."""
    stopped = 0
    for delay in (0.01, 0.03, 0.06, 0.1, 0.2, 0.4, 0.8):
        dest = tmp_path / f"out{delay}.safetensors"
        args = ["merge", str(mixed_files["hf"]), str(dest), "--dtype", "bf16"]
        code_ = f"from ckpt_cli.cli.entry import main; print('up', flush=True); main({args!r})"
        # Ctrl-C as a terminal delivers it: to a process whose SIGINT is not ignored (a job started with `&` from a
        # script inherits it ignored, and Python then leaves it so)
        proc = subprocess.Popen(
            [sys.executable, "-c", code_],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        time.sleep(delay)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        assert "Traceback" not in err, (delay, err)
        if proc.returncode == 0:  # finished before the signal came
            continue
        assert proc.returncode == code and line in err and len(err.strip().splitlines()) == 1, (delay, proc.returncode, err)
        assert not dest.exists()
        stopped += 1
    assert stopped >= 3  # the early ones land during start-up


# ---- structured inputs: one loader, bounds, a schema per file kind ------------------------------------------------

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(9)
)
_MANIFEST_HEAD = '{"ckpt_manifest": 2, "hash": "blake3", "format": "hf", '
USER_FILES = {  # file kind -> (option, {case: text, needle})
    "name map": (
        "--name-map",
        {
            "alias bomb": (BOMB, "YAML aliases"),
            "nested": ("rename: " + "[" * 5000 + "]" * 5000, "nested deeper"),
            "wrong type": ("rename: [{from: 3, to: x}]", "rename[0].from must be a string"),
            "unknown key": ("renames: []", "unknown key 'renames'"),
            "huge integer": ("split: [{from: x, to: a, groups: " + "9" * 5000 + "}]", "integer of 5000 digits"),
            "not a mapping": ("- a\n- b\n", "must be a mapping"),
        },
    ),
    "policy": (
        "--policy",
        {
            "alias bomb": (BOMB, "YAML aliases"),
            "wrong type": ("min_params: ten", "min_params must be a non-negative integer"),
            "wrong nested type": ("tensors: {shapes: {w: [2, x]}}", "tensors.shapes.w[1]"),
            "tolerance": ("tolerance: {atol: -1}", "tolerance.atol must be a number >= 0"),
            "huge integer": ("max_params: " + "9" * 5000, "integer of 5000 digits"),
        },
    ),
    "manifest": (
        "--manifest",
        {
            "nested": ("[" * 100_000 + "]" * 100_000, "nested deeper"),
            "wrong type": ('{"ckpt_manifest": 2, "hash": "blake3", "format": "hf", "files": [], "tensors": {}}', "files must be a mapping"),
            "missing field": (_MANIFEST_HEAD + '"files": {}, "tensors": {"w": {"dtype": "float32"}}}', "tensors.w.shape is missing"),
            "escaping path": (_MANIFEST_HEAD + '"files": {"../x": {"bytes": 1, "blake3": "0"}}, "tensors": {}}', "outside"),
            "unknown hash": ('{"ckpt_manifest": 2, "hash": "md5"}', "sha256 and blake3"),
            "huge integer": ('{"ckpt_manifest": ' + "2" * 5000 + "}", "integer of 5000 digits"),
        },
    ),
}
USER_CASES = [(kind, case) for kind, (_, cases) in USER_FILES.items() for case in cases]


@pytest.mark.parametrize("kind,case", USER_CASES, ids=[f"{k}: {c}" for k, c in USER_CASES])
def test_a_bad_user_file_is_exit_2_naming_the_field(ckpt, tmp_path, mixed_files, kind, case):
    option, cases = USER_FILES[kind]
    text, needle = cases[case]
    path = tmp_path / ("file.json" if kind == "manifest" else "file.yaml")
    path.write_text(text)
    if kind == "name map":
        res = ckpt("convert", mixed_files["hf"], tmp_path / "out", "--to", "hf", option, path)
    else:
        res = ckpt("verify", mixed_files["hf"], option, path)
    assert res.code == 2 and "Traceback" not in res.err and "internal error" not in res.err, res.err
    assert str(path) in res.err and needle in res.err, res.err
    assert not (tmp_path / "out").exists()


def test_a_deepspeed_config_alias_bomb_is_refused(ckpt, tmp_path, fsdp2_saves):
    config = tmp_path / "ds.yaml"
    config.write_text(BOMB)
    res = ckpt("convert", fsdp2_saves[2] / "ckpt", tmp_path / "out", "--to", "deepspeed", "--world-size", "2", "--ds-config", config)
    assert res.code == 2 and "YAML aliases" in res.err, res.err


CHECKPOINT_FILES = {  # damage to a checkpoint's own JSON file -> what verify names (exit 1)
    "hf index nested": ("hf", "model.safetensors.index.json", "[" * 100_000 + "]" * 100_000, "nested deeper"),
    "hf index wrong type": ("hf", "model.safetensors.index.json", '{"weight_map": {"a": 5}}', "weight_map"),
    "trainer_state huge step": ("trainer", "trainer_state.json", '{"global_step": ' + "7" * 5000 + "}", "integer of 5000 digits"),
    "trainer_state wrong type": ("trainer", "trainer_state.json", '{"global_step": "four"}', "global_step must be a non-negative"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_FILES))
def test_a_damaged_checkpoint_json_file_is_exit_1_naming_it(ckpt, tmp_path, case, tiny_llama, run_folders):
    kind, name, text, needle = CHECKPOINT_FILES[case]
    if kind == "hf":
        folder = shutil.copytree(tiny_llama[1] / "sharded", tmp_path / "ckpt")
    else:
        folder = shutil.copytree(run_folders["trainer-plain"] / "checkpoint-4", tmp_path / "ckpt")
    (folder / name).write_text(text)
    res = ckpt("verify", folder)
    assert res.code == 1 and "Traceback" not in res.out + res.err and "internal error" not in res.err, res.out + res.err
    assert name in res.out + res.err and needle in res.out + res.err, res.out + res.err
    res = ckpt("merge", folder, tmp_path / "out.safetensors")
    assert res.code == 1 and not (tmp_path / "out.safetensors").exists(), res.err


def test_a_safetensors_shape_that_overflows_64_bits_is_refused(ckpt, tmp_path):
    header = json.dumps({"a": {"dtype": "F32", "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "overflow.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    res = ckpt("verify", path)
    assert res.code == 1 and "overflows 64 bits" in res.out + res.err
    assert ckpt("merge", path, tmp_path / "out.pt").code == 1 and not (tmp_path / "out.pt").exists()


def test_a_split_of_an_empty_tensor_is_bounded_by_its_elements(ckpt, tmp_path):
    from safetensors.torch import save_file

    save_file({"stack": torch.zeros(10**9, 0, 4)}, tmp_path / "empty.safetensors")  # a billion layers of nothing
    name_map = tmp_path / "m.yaml"
    name_map.write_text("split: [{from: stack, to: 'x.{layer}', layers: true, groups: 1000}]")
    started = time.monotonic()
    res = ckpt("convert", tmp_path / "empty.safetensors", tmp_path / "out", "--to", "hf", "--name-map", name_map)
    assert res.code == 2 and "nothing to split" in res.err, res.err
    assert time.monotonic() - started < 30


# ---- manifests ------------------------------------------------------------------------------------------------------


def test_a_manifest_catches_the_flipped_byte_deep_cannot(ckpt, tmp_path, mixed_files):
    folder = shutil.copytree(mixed_files["hf"], tmp_path / "hf")
    manifest = tmp_path / "m.json"
    assert ckpt("verify", folder, "--write-manifest", manifest).code == 0
    assert json.loads(manifest.read_text())["hash"] == "blake3"
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    res = ckpt("verify", folder, "--deep")
    assert res.code == 0 and "stores no checksums" in res.err and "--write-manifest" in res.err
    assert_fails(ckpt("verify", folder, "--manifest", manifest), shard.name, "differs from manifest")


def test_a_sha256_manifest_of_version_1_is_still_checked(ckpt, tmp_path, mixed_files):
    from safetensors import safe_open

    def _sha256(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def _name(t: torch.Tensor) -> str:
        return str(t.dtype).removeprefix("torch.")

    def _bytes(t: torch.Tensor) -> bytes:
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    path = mixed_files["safetensors"]
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    manifest = {
        "ckpt_manifest": 1,
        "format": "safetensors",
        "files": {path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path.read_bytes())}},
        "tensors": {k: {"dtype": _name(v), "shape": list(v.shape), "sha256": _sha256(_bytes(v))} for k, v in tensors.items()},
    }
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    res = ckpt("verify", path, "--manifest", tmp_path / "m.json")
    assert res.code == 0, res.out + res.err


@pytest.mark.parametrize("command,args", [("convert", ["--to", "hf"]), ("merge", []), ("split", ["--num-shards", "2"])])
def test_a_write_records_the_manifest_of_its_output(ckpt, tmp_path, mixed_files, command, args):
    dest = tmp_path / ("out.safetensors" if command == "merge" else "out")
    manifest = tmp_path / "out.json"
    res = ckpt(command, mixed_files["hf"], dest, *args, "--write-manifest", manifest)
    assert res.code == 0 and "wrote manifest" in res.err, res.err
    assert json.loads(manifest.read_text())["hash"] == "blake3"
    assert ckpt("verify", dest, "--manifest", manifest).code == 0
    other = tmp_path / ("other.safetensors" if command == "merge" else "other")
    res = ckpt(command, mixed_files["hf"], other, *args, "--write-manifest", manifest)  # an existing manifest: refused first
    assert res.code == 2 and "--overwrite" in res.err and not other.exists()


# ---- small CLI consistency items ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (["inspect", "{hf}", "--json", "--yaml"], "--json and --yaml"),
        (["inspect", "{hf}", "--tree", "--tensors"], "--tree and --tensors"),
        (["inspect", "{hf}", "--filter", "no.such.*"], "matches no tensor"),
        (["verify", "{hf}", "--against", "{hf}", "--atol", "-1"], "finite values >= 0"),
        (["diff", "{hf}", "{hf}", "--rtol", "-0.5"], "finite values >= 0"),
    ],
)
def test_contradictory_or_empty_options_are_exit_2(ckpt, mixed_files, args, needle):
    res = ckpt(*[a.format(hf=mixed_files["hf"]) for a in args])
    assert res.code == 2 and needle in res.err and "Traceback" not in res.err, res.err


def test_version_short_flag_and_help_points_at_the_demo(ckpt):
    res = ckpt("-V")
    assert res.code == 0 and res.out.startswith("ckpt ")
    assert "ckpt demo demo" in ckpt("--help").out


def test_json_on_a_write_reports_what_was_written(ckpt, mixed_files, tmp_path):
    res = ckpt("split", mixed_files["safetensors"], tmp_path / "out", "--num-shards", "2", "--json", "-q")
    doc = json.loads(res.out)
    assert res.code == 0 and doc["written"] is True and doc["seconds"] >= 0
    assert sorted(f["path"] for f in doc["files"]) == sorted(p.name for p in (tmp_path / "out").iterdir())
    dry = json.loads(ckpt("split", mixed_files["safetensors"], tmp_path / "o2", "--num-shards", "2", "--json", "--dry-run").out)
    assert dry["written"] is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nonfinite_from_bits_equals_torch(dtype):
    """Every bit pattern class: random words (NaN payloads, both infinities, subnormals, signed zeros)."""
    from ckpt_cli.ops.finite import NonFinite

    width = torch.finfo(dtype).bits
    ints = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    g = torch.Generator().manual_seed(width)
    words = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1) - 1, (200_000,), generator=g, dtype=torch.int64).to(ints)
    values = words.view(dtype)
    values[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0], dtype=dtype)
    counter = NonFinite(str(dtype).removeprefix("torch."))
    raw = values.view(torch.uint8).numpy().tobytes()
    for start in range(0, len(raw), 4096 * 8):  # element-aligned blocks, as reads hand them over
        counter.update(raw[start : start + 4096 * 8])
    wide = values.to(torch.float64) if dtype != torch.float64 else values
    assert (counter.nan, counter.inf) == (int(torch.isnan(wide).sum()), int(torch.isinf(wide).sum()))
    assert counter.nan > 0 and counter.inf >= 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nonfinite_quick_pass_misses_no_lone_special(dtype):
    """Finite blocks take the quick pass; a lone NaN or Inf in a later, shorter block is still counted."""
    from ckpt_cli.ops.finite import NonFinite

    counter = NonFinite(str(dtype).removeprefix("torch."))
    finite = torch.randn(10_000).to(dtype)
    raw = finite.view(torch.uint8).numpy().tobytes()
    for start in range(0, len(raw), 8192):
        counter.update(raw[start : start + 8192])
    assert (counter.nan, counter.inf) == (0, 0)
    for special, want in ((float("nan"), (1, 0)), (float("-inf"), (1, 1)), (float("inf"), (1, 2))):
        lone = finite[:37].clone()
        lone[36] = special
        counter.update(lone.view(torch.uint8).numpy().tobytes())
        assert (counter.nan, counter.inf) == want


WRAPPED_STOPS = [(KeyboardInterrupt, 130, "ckpt: error: interrupted"), (Terminated, 143, "terminated (SIGTERM)")]


@pytest.mark.parametrize("stop,code,line", WRAPPED_STOPS)
def test_a_signal_python_wrapped_is_still_the_signal(ckpt, mixed_files, monkeypatch, stop, code, line):
    """Python turns a KeyboardInterrupt raised inside __set_name__ (a dataclass made while a module imports, as a
    signal at start-up can land) into a RuntimeError: ckpt reports the signal and its exit code, not an internal error."""
    from ckpt_cli.ops import inspect as inspect_op

    def wrapped(*args, **kwargs):
        raise RuntimeError("Error calling __set_name__ on 'Field' instance 'required' in 'Policy'") from stop()

    monkeypatch.setattr(inspect_op, "summary", wrapped)
    res = ckpt("inspect", mixed_files["safetensors"])
    assert res.code == code and line in res.err and "internal error" not in res.err, res
