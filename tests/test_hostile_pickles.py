"""Hostile and broken pickles (issue 11): the allow list cannot be bent, a pickle cannot make ckpt hang or
exhaust memory, tensor views stay inside their storage, and a pickled value the allow list rejects is never
copied into an output. Hand-made pickles (built from opcodes) test the unpickler itself; the rest damage
checkpoints the real producers wrote (torch.save, DeepSpeed, FSDP2 + dcp.save) and run the CLI on them.

Every refusal: exit 1 (or 2), one line on stderr, no traceback, nothing run (no canary file), nothing
written (no DST, no stray file), well under 20 s; the resource cases run in a subprocess and stay under 1 GB.
"""

from __future__ import annotations

import collections
import datetime
import io
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Evil

from ckpt_cli.core.dtypes import BY_NAME
from ckpt_cli.core.pickles import pickler
from ckpt_cli.core.pickles.safe_pickle import safe_loads
from ckpt_cli.errors import DataError
from ckpt_cli.formats.dcp.reader import METADATA_GLOBALS
from ckpt_cli.formats.deepspeed.rank_files import DS_GLOBALS

LIMIT_S = 20
LIMIT_RSS = 1 << 30
EXTRA = {**METADATA_GLOBALS, **DS_GLOBALS}

# ---- pickles from opcodes ----------------------------------------------------------------------------


def op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(s: str) -> bytes:
    raw = s.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def build_on(module: str, name: str, slot_state: bool, key: str = "itemsize", value: bytes = b"K\x08") -> bytes:
    """GLOBAL module.name, then BUILD with a state setting `key` (as a dict state or a (None, dict) slot state)."""
    state = b"}" + text(key) + value + b"s"
    return op_global(module, name) + (b"N" + state + b"\x86" if slot_state else state) + b"b"


def laughs_list(depth: int) -> bytes:
    """x = []; then depth times x = (x, x): 2**depth leaves from a few bytes."""
    return b"\x80\x02]" + b"q\x00h\x00\x86" * depth + b"."


def laughs_tuple_key(depth: int) -> bytes:
    """{t: 1} where t = (t', t') nested `depth` deep: hashing t takes 2**depth steps."""
    return b"\x80\x02})" + b"q\x00h\x00\x86" * depth + b"K\x01s."


def call_on_laughs(module: str, name: str) -> bytes:
    """module.name(x) for x = (x', x') nested 64 deep, then the result dropped: the callable sees the bomb."""
    return b"\x80\x02" + op_global(module, name) + b"]" + b"q\x00h\x00\x86" * 64 + b"\x85R0N."


def copied_over_and_over() -> bytes:
    """_codecs.encode(a 100 kB text) called 20000 times on the same memoized arguments: 2 GB from 100 kB."""
    call = op_global("_codecs", "encode") + b"q\x01" + text("a" * 100_000) + b"q\x02" + text("latin1") + b"\x86q\x03"
    return b"\x80\x02" + call + b"]q\x04" + b"h\x04h\x01h\x03Ra" * 20_000 + b"."


def numpy_dtype_with_fields() -> bytes:
    """dtype('V2') given a field through BUILD (fields can nest dtypes whose hash takes exponential time)."""
    dtype = op_global("numpy", "dtype") + text("V2") + b"\x89\x88\x87R"
    field = b"}" + text("a") + op_global("numpy", "dtype") + text("i1") + b"\x89\x88\x87RK\x00\x86s"
    state = b"(K\x03" + text("|") + b"N" + text("a") + b"\x85" + field + b"K\x02K\x01K\x10t"
    return b"\x80\x02" + dtype + state + b"b."


HOSTILE = {
    # the allow list bent: BUILD on what find_class hands out
    "dtype dict state": (b"\x80\x02" + build_on("torch", "float32", False) + b".", "may not change dtype float32"),
    "dtype slot state": (b"\x80\x02" + build_on("torch", "float32", True) + b".", "may not change dtype float32"),
    "storage class": (b"\x80\x02" + build_on("torch", "FloatStorage", True, "dtype") + b".", "may not change"),
    "tensor class": (b"\x80\x02" + build_on("torch", "Tensor", True, "is_parameter", b"\x88") + b".", "may not change"),
    "function defaults": (
        b"\x80\x02" + build_on("torch._utils", "_rebuild_tensor_v2", True, "__defaults__", b"K\x07\x85") + b".",
        "may not change the allow list's torch._utils._rebuild_tensor_v2",
    ),
    "builtin wrapper": (b"\x80\x02" + build_on("collections", "OrderedDict", True, "x") + b".", "may not change"),
    "dcp record class": (
        b"\x80\x02" + build_on("torch.distributed.checkpoint.metadata", "TensorProperties", True, "dtype") + b".",
        "TypeError",
    ),
    "dcp record class, dict": (b"\x80\x02" + build_on("torch.distributed.checkpoint.metadata", "Metadata", False, "x") + b".", "TypeError"),
    "deepspeed stub class": (b"\x80\x02" + build_on("deepspeed.runtime.fp16.loss_scaler", "LossScaler", True, "x") + b".", "TypeError"),
    "deepspeed enum class": (b"\x80\x02" + build_on("deepspeed.runtime.zero.config", "ZeroStageEnum", True, "x") + b".", "read-only"),
    # resources
    "list laughs": (laughs_list(64), "too many nested references"),
    "tuple-key laughs": (laughs_tuple_key(64), "too long to hash"),
    "laughs over a list changed late": (  # the scan cannot size it exactly: the built value is counted
        b"\x80\x02]q\x00h\x00h\x00\x86q\x01" + b"h\x01h\x01\x86q\x01" * 64 + b"h\x00K\x01a0.",
        "too many nested references",
    ),
    "frozenset of laughs": (
        b"\x80\x02" + op_global("builtins", "frozenset") + b")" + b"q\x00h\x00\x86" * 64 + b"\x85\x85R0N.",
        "rebuilds far more data",
    ),
    "huge memo index": (b"\x80\x02Nr\xff\xff\xff\x7f.", "memo index out of range"),
    "bytearray(n)": (b"\x80\x02" + op_global("builtins", "bytearray") + b"J\x00\x00\x00\x40\x85R.", "bytearray of something"),
    "numpy ndarray(n)": (b"\x80\x02" + op_global("numpy", "ndarray") + b"J\x00\x00\x00\x40\x85\x85R.", "numpy.ndarray called directly"),
    "str of laughs": (call_on_laughs("torch.serialization", "_get_layout"), "layout"),
    "device of laughs": (call_on_laughs("torch", "device"), "numbers and text"),
    "copied over and over": (copied_over_and_over(), "rebuilds far more data"),
    "nested 100000 deep": (b"\x80\x02N" + b"\x85" * 100_000 + b".", "more than 100 deep"),
    "recursive list": (b"\x80\x02]q\x00h\x00a.", "recursive reference"),
    "storage key": (
        b"\x80\x02(" + text("storage") + op_global("torch", "FloatStorage") + text("\x1b[2J../x") + text("cpu") + b"K\x01tQ.",
        "storage key that is not a plain name",
    ),
    "numpy dtype with fields": (numpy_dtype_with_fields(), "fields"),
    "truncated": (b"\x80\x02]q\x00(K\x01K\x02", "unreadable pickle"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hand_made_pickles_are_refused(name):
    data, needle = HOSTILE[name]
    start = time.monotonic()
    with pytest.raises(DataError, match="unreadable pickle") as info:
        safe_loads(data, "f.pt", EXTRA)
    assert needle in str(info.value) and len(str(info.value).splitlines()) == 1
    assert time.monotonic() - start < LIMIT_S
    assert BY_NAME["float32"].itemsize == 4 and BY_NAME["float32"].name == "float32"
    properties = METADATA_GLOBALS[("torch.distributed.checkpoint.metadata", "TensorProperties")]
    assert isinstance(properties.__dict__.get("dtype"), types.MemberDescriptorType)  # still the slot, not a value


def test_trust_pickle_does_not_unlock_the_allow_list_objects():
    with pytest.raises(DataError, match="may not change dtype"):
        safe_loads(b"\x80\x02" + build_on("torch", "float32", False) + b".", "f.pt", None, trust=True)
    with pytest.raises(DataError, match="too many nested references"):
        safe_loads(laughs_list(64), "f.pt", None, trust=True)


def test_messages_quote_no_raw_bytes():
    with pytest.raises(DataError) as info:
        safe_loads(b"\x80\x02" + op_global("os\x1b[31m" + "x" * 5000, "system") + b".", "f.pt")
    message = str(info.value)
    assert "\x1b" not in message and len(message) < 300 and "os?[31m" in message
    with pytest.raises(DataError) as info:  # a ValueError raised on the file's text: named, not quoted
        safe_loads(b"\x80\x02" + op_global("torch", "Size") + text("\x1b]0;pwned\x07") + b"\x85R.", "f.pt")
    assert "\x1b" not in str(info.value) and "pwned" not in str(info.value)


LEGIT = {
    "numpy rng state": np.random.RandomState(0).get_state(),
    "numpy scalars": [np.float64(1.5), np.int32(-3), np.bool_(True)],
    "numpy arrays": [
        np.arange(5, dtype=">i4"),
        np.zeros((2, 3), dtype=np.float16),
        np.array(["ab", "c"]),
        np.array([1, "x"], dtype=object),
    ],
    "builtins": [{1, 2}, frozenset({"a"}), bytearray(b"xy"), complex(1, 2), slice(1, None, 2), collections.OrderedDict(a=1)],
    "shared tuple keys": (lambda t: {t: 1, (t, t): 2, "betas": [t, t, t]})((0.9, 0.999)),
    "100 deep": (lambda: [x := [], *[(x := [x]) for _ in range(98)]][-1])(),
}


@pytest.mark.parametrize("name", list(LEGIT))
@pytest.mark.parametrize("protocol", [0, 2, 4])  # torch.save writes protocol 2
def test_real_pickles_still_load(name, protocol):
    data = pickle.dumps(LEGIT[name], protocol=protocol)
    assert repr(safe_loads(data, "f.pt")) == repr(pickle.loads(data))  # numpy reads big-endian arrays as native


# ---- helpers for real checkpoints ----------------------------------------------------------------------


def assert_refused(res, *needles: str, code: int = 1, report: bool = False) -> None:
    """Exit code, no traceback, every needle named: on one line of stderr, or (`report`: verify) in its report
    on stdout with nothing on stderr."""
    lines = res.err.strip().splitlines()
    assert res.code == code and "Traceback" not in res.out + res.err, (res.code, res.out, res.err)
    assert len(lines) == (0 if report else 1), (res.out, res.err)
    for needle in needles:
        assert needle in (res.out if report else res.err), (needle, res.out, res.err)


def refused(run, args: list, *needles: str) -> None:
    assert_refused(run(*args), *needles, report=args[0] == "verify")


def files_under(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.fixture
def timed(ckpt):
    """The in-process CLI, each call under LIMIT_S."""

    def run(*args):
        start = time.monotonic()
        res = ckpt(*args)
        assert time.monotonic() - start < LIMIT_S, args
        return res

    return run


# The process's own peak: VmHWM of its address space. ru_maxrss would also count the test process it was forked
# from (Linux carries the pre-exec high-water mark over exec), and a pytest worker may hold a GB after other tests.
MEASURE = """
import resource, sys
from ckpt_cli.cli.app import main
try:
    main(sys.argv[2:])
finally:
    try:
        with open("/proc/self/status") as status:
            peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(sys.argv[1], "w") as f:
        f.write(str(peak))
"""


def bounded(tmp_path: Path, *args) -> tuple[subprocess.CompletedProcess, int]:
    """The CLI in a fresh process under a 20 s timeout and a 6 GB address-space cap (so a failure cannot take
    the machine down); returns the process and its peak resident memory in bytes."""
    rss_file = tmp_path / "rss.txt"

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, rss_file, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        preexec_fn=cap,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    rss = int(rss_file.read_text())
    rss_file.unlink()
    return proc, rss


def assert_bounded_refusal(tmp_path: Path, *args, needle: str) -> None:
    proc, rss = bounded(tmp_path, *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    assert needle in proc.stderr, proc.stderr
    assert rss < LIMIT_RSS, rss


def data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def replace_data_pkl(path: Path, data: bytes) -> None:
    """Rewrite a torch.save archive with another data.pkl (every other record as torch wrote it)."""
    with zipfile.ZipFile(path) as z:
        records = [(info.filename, z.read(info)) for info in z.infolist()]
    tmp = path.with_name(path.name + ".rewrite")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for name, payload in records:
            z.writestr(name, data if name.endswith("/data.pkl") else payload)
    os.replace(tmp, path)


def with_prefix(data: bytes, ops: bytes) -> bytes:
    """The same pickle, with `ops` run first (right after its PROTO opcode)."""
    assert data[:1] == b"\x80"
    return data[:2] + ops + data[2:]


POISON_FLOAT32 = build_on("torch", "float32", False) + b"0"  # BUILD on torch.float32, then POP


# ---- the allow list bent, on real checkpoints ------------------------------------------------------------


@pytest.fixture
def torch_file(mixed_files, tmp_path):
    path = tmp_path / "src" / "mixed.pt"
    path.parent.mkdir()
    shutil.copy(mixed_files["torch"], path)
    return path


def test_torch_file_that_rewrites_a_dtype(timed, torch_file, mixed_files, tmp_path):
    replace_data_pkl(torch_file, with_prefix(data_pkl(torch_file), POISON_FLOAT32))
    before = files_under(tmp_path)
    for args in (["inspect", torch_file], ["verify", torch_file, "--deep"], ["convert", torch_file, tmp_path / "o", "--to", "hf"]):
        refused(timed, args, "mixed.pt", "may not change dtype float32")
    assert files_under(tmp_path) == before
    # The table is untouched: a clean file read next, in the same process, keeps its dtypes.
    res = timed("inspect", mixed_files["torch"], "--json", "--tensors")
    dtypes = {t["name"]: t["dtype"] for t in json.loads(res.out)["tensors"]}
    assert dtypes["fp32"] == "float32" and dtypes["int64"] == "int64"
    assert BY_NAME["float32"].itemsize == 4


@pytest.fixture
def ds_copy(ds_saves, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(ds_saves[2] / "stage2-fp32", dest)
    return dest


def test_deepspeed_file_that_rewrites_a_class(timed, ds_copy, tmp_path):
    path = ds_copy / "global_step3" / "mp_rank_00_model_states.pt"
    ops = build_on("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", True, "cur_scale") + b"0"
    replace_data_pkl(path, with_prefix(data_pkl(path), ops))
    before = files_under(tmp_path)
    for args in (["inspect", ds_copy], ["verify", ds_copy], ["merge", ds_copy, tmp_path / "m.safetensors"]):
        refused(timed, args, "mp_rank_00_model_states.pt")
    assert files_under(tmp_path) == before


@pytest.fixture
def dcp_copy(fsdp2_saves, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(fsdp2_saves[2] / "ckpt", dest)
    return dest


def test_dcp_metadata_that_rewrites_a_class(timed, dcp_copy, tmp_path):
    meta = dcp_copy / ".metadata"
    ops = build_on("torch.distributed.checkpoint.metadata", "TensorProperties", True, "dtype", op_global("torch", "int8")) + b"0"
    meta.write_bytes(with_prefix(meta.read_bytes(), ops))
    before = files_under(tmp_path)
    for args in (["inspect", dcp_copy], ["verify", dcp_copy], ["reshard", dcp_copy, tmp_path / "o", "--world-size", "1"]):
        refused(timed, args, ".metadata")
    assert files_under(tmp_path) == before


# ---- resources, on real checkpoints -----------------------------------------------------------------------


def laughs(depth: int) -> list:
    """A real Python value whose pickle is small and whose tree has 2**depth leaves (shared references)."""
    value: list = [0]
    for _ in range(depth):
        value = [value, value]
    return value


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda pkl: laughs_list(64), "too many nested references"),
        (lambda pkl: laughs_tuple_key(64), "too long to hash"),
        (lambda pkl: with_prefix(pkl, b"Nr\xff\xff\xff\x7f0"), "memo index out of range"),
        (lambda pkl: with_prefix(pkl, b"N" + b"\x85" * 200_000 + b"0"), "more than 100 deep"),
    ],
    ids=["list laughs", "tuple-key laughs", "memo index", "deep nesting"],
)
def test_torch_file_data_pkl_bounded(torch_file, tmp_path, damage, needle):
    replace_data_pkl(torch_file, damage(data_pkl(torch_file)))
    assert_bounded_refusal(tmp_path, "inspect", torch_file, needle=needle)
    assert_bounded_refusal(tmp_path, "convert", torch_file, tmp_path / "o.safetensors", "--to", "safetensors", needle=needle)
    assert not (tmp_path / "o.safetensors").exists()


def test_torch_file_with_a_shared_reference_bomb(tmp_path):
    path = tmp_path / "bomb.pt"
    torch.save({"w": torch.ones(2), "extra": laughs(60)}, path)  # torch.save memoizes: a few hundred bytes
    assert path.stat().st_size < 10_000
    assert_bounded_refusal(tmp_path, "inspect", path, needle="too many nested references")
    assert_bounded_refusal(tmp_path, "merge", path, tmp_path / "o.pt", "--all", needle="too many nested references")
    assert not (tmp_path / "o.pt").exists()


def test_deepspeed_client_state_bomb(ds_copy, tmp_path):
    path = ds_copy / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    state["client_bomb"] = laughs(60)
    torch.save(state, path)
    assert_bounded_refusal(tmp_path, "inspect", ds_copy, needle="too many nested references")
    assert_bounded_refusal(tmp_path, "reshard", ds_copy, tmp_path / "o", "--world-size", "1", needle="too many nested references")
    assert not (tmp_path / "o").exists()


def test_expanded_tensor_is_refused_not_materialised(tmp_path):
    path = tmp_path / "expanded.pt"
    torch.save({"x": torch.arange(4, dtype=torch.float32).expand(10**9, 4)}, path)  # 16 bytes of storage, 16 GB as a view
    assert path.stat().st_size < 10_000
    assert_bounded_refusal(tmp_path, "inspect", path, needle="repeats storage elements")
    assert_bounded_refusal(tmp_path, "convert", path, tmp_path / "o.safetensors", "--to", "safetensors", needle="repeats storage elements")
    assert not (tmp_path / "o.safetensors").exists()


def test_position_ids_buffer_still_converts(ckpt, tmp_path):
    """HF models keep `arange(n).expand((1, -1))` buffers: stride 0 on a dim of size 1 is a plain tensor."""
    from safetensors.torch import load_file

    ids = torch.arange(64).expand((1, -1))
    zero_stride = torch.arange(64).as_strided((1, 64), (0, 1))  # how older torch versions expanded it
    torch.save({"position_ids": ids, "zero_stride": zero_stride, "w": torch.randn(3, 2).t()}, tmp_path / "m.pt")
    res = ckpt("convert", tmp_path / "m.pt", tmp_path / "m.safetensors", "--to", "safetensors")
    assert res.code == 0, res.err
    out = load_file(tmp_path / "m.safetensors")
    assert torch.equal(out["position_ids"], ids) and torch.equal(out["zero_stride"], ids) and out["w"].shape == (2, 3)


def _view_pickle(storage_offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """The data.pkl of {'x': a view of storage '0' (7*5 float32 elements)}, as torch would write it."""
    from ckpt_cli.formats import torch_save

    storage = torch_save.Storage("0", BY_NAME["float32"], 35)
    view = pickler.Reduce(
        pickler.Global("torch._utils", "_rebuild_tensor_v2"),
        (storage, storage_offset, shape, stride, False, pickler.Reduce(pickler.Global("collections", "OrderedDict"), ())),
    )
    return pickler.dumps({"x": view}, torch_save.storage_id)


@pytest.mark.parametrize(
    "view,needle",
    [
        ((-5, (5,), (1,)), "negative offset or stride"),
        ((34, (5,), (-1,)), "negative offset or stride"),
        ((30, (7,), (1,)), "runs past the end of its storage"),
        ((0, (5, 8), (1, 5)), "runs past the end of its storage"),
        ((0, (10**9, 5), (0, 1)), "repeats storage elements"),
        ((0, (10, 10), (1, 1)), "repeats storage elements"),
    ],
    ids=["negative offset", "negative stride", "past the end", "strides past the end", "stride 0", "overlapping"],
)
def test_views_outside_their_storage(timed, tmp_path, view, needle):
    path = tmp_path / "src" / "v.pt"
    path.parent.mkdir()
    torch.save({"x": torch.randn(7, 5)}, path)  # the storage record data/0 holds 35 float32 elements
    replace_data_pkl(path, _view_pickle(*view))
    before = files_under(tmp_path)
    for args in (["inspect", path], ["verify", path, "--deep"], ["convert", path, tmp_path / "o", "--to", "hf"]):
        refused(timed, args, "v.pt", needle)
    assert files_under(tmp_path) == before


def test_dcp_chunk_view_past_its_storage(timed, dcp_copy, tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta = pickle.loads((dcp_copy / ".metadata").read_bytes())  # torch's own output: trusted here
    info = meta.storage_data[MetadataIndex("model.embed.weight", torch.Size([0, 0]))]
    path = dcp_copy / info.relative_path
    data = bytearray(path.read_bytes())
    archive = bytes(data[info.offset : info.offset + info.length])
    start = archive.index(b"_rebuild_tensor_v2")
    at = archive.index(b"K\x00", start)  # storage_offset 0, as BININT1
    data[info.offset + at + 1] = 5
    path.write_bytes(bytes(data))
    os.utime(dcp_copy / ".metadata")
    before = files_under(tmp_path)
    for args in (["verify", dcp_copy], ["verify", dcp_copy, "--deep"], ["convert", dcp_copy, tmp_path / "o", "--to", "hf"]):
        refused(timed, args, "model.embed.weight", "runs past the end of its storage")
    assert files_under(tmp_path) == before
    # inspect reports what .metadata says and reads no chunk archive (issue 20: cost proportional to what it reports)
    res = timed("inspect", dcp_copy)
    assert res.code == 0 and "Traceback" not in res.err, (res.out, res.err)


# ---- laundering: a pickled value inside a .distcp -----------------------------------------------------------


def put_byte_item(folder: Path, fqn: str, value) -> str:
    """Replace the BYTE_IO item `fqn` with torch.save(value) appended to its rank file (the framing DCP uses),
    pointing .metadata at it; returns the rank file's name."""
    meta = pickle.loads((folder / ".metadata").read_bytes())  # torch's own output: trusted here
    key = next(k for k in meta.storage_data if k.fqn == fqn)
    info = meta.storage_data[key]
    buf = io.BytesIO()
    torch.save(value, buf)
    path = folder / info.relative_path
    info.offset, info.length = path.stat().st_size, len(buf.getvalue())
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return info.relative_path


def test_dcp_payload_value_is_reported_and_never_copied(timed, dcp_copy, tmp_path):
    marker = tmp_path / "pwned"
    rank_file = put_byte_item(dcp_copy, "dataloader.offset", Evil(marker))
    before = files_under(tmp_path)
    res = timed("inspect", dcp_copy, "--json")
    assert res.code == 0 and "Traceback" not in res.err, res.err
    assert json.loads(res.out)["details"]["refused_pickles"] == {"dataloader.offset": "posix.system"}
    res = timed("inspect", dcp_copy)  # the text output names it too
    assert res.code == 0 and "refused: 'dataloader.offset' is a pickle that needs global 'posix.system'" in res.out, res.out
    for args in (["verify", dcp_copy], ["verify", dcp_copy, "--deep"]):
        res = timed(*args)
        assert res.code == 1 and "Traceback" not in res.out + res.err, res.out + res.err
        assert f"{rank_file}: 'dataloader.offset' is a pickle that needs global 'posix.system'" in res.out + res.err
    for args in (
        ["reshard", dcp_copy, tmp_path / "o", "--world-size", "1"],
        ["convert", dcp_copy, tmp_path / "o", "--to", "dcp", "--world-size", "2"],
        ["convert", dcp_copy, tmp_path / "o.pt", "--to", "torch"],
        ["convert", dcp_copy, tmp_path / "o", "--to", "hf"],
        ["reshard", dcp_copy, tmp_path / "o", "--world-size", "1", "--dry-run"],
    ):
        refused(timed, args, rank_file, "posix.system")
    assert files_under(tmp_path) == before
    assert not marker.exists()


def test_dcp_value_outside_the_allow_list_copies_with_trust(timed, dcp_copy, tmp_path):
    """A harmless class outside the allow list: refused by default, copied verbatim with --trust-pickle."""
    import torch.distributed.checkpoint as dcp

    put_byte_item(dcp_copy, "dataloader.offset", datetime.date(2024, 1, 2))
    assert_refused(timed("reshard", dcp_copy, tmp_path / "o", "--world-size", "1"), "datetime.date")
    assert not (tmp_path / "o").exists()
    res = timed("reshard", dcp_copy, tmp_path / "o", "--world-size", "1", "--trust-pickle")
    assert res.code == 0, res.err
    state = {"dataloader": {"offset": None}}
    dcp.load(state, checkpoint_id=tmp_path / "o", no_dist=True)
    assert state["dataloader"]["offset"] == datetime.date(2024, 1, 2)


def test_dcp_value_bomb(dcp_copy, tmp_path):
    put_byte_item(dcp_copy, "dataloader.offset", laughs(60))
    assert_bounded_refusal(tmp_path, "inspect", dcp_copy, needle="too many nested references")
    assert_bounded_refusal(tmp_path, "reshard", dcp_copy, tmp_path / "o", "--world-size", "1", needle="too many nested references")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["torch", "deepspeed", "deepspeed-protocol4"])
def test_payload_in_other_formats_never_runs(timed, fmt, torch_file, ds_saves, tmp_path):
    """Rank 1's optimizer file is not parsed by inspect (rank 0's tells the layout); its globals are checked all
    the same, and at protocol 4 (STACK_GLOBAL, which only unpickling resolves) it is parsed."""
    marker = tmp_path / "pwned"
    if fmt == "torch":
        src = torch_file
        torch.save({**torch.load(src), "payload": Evil(marker)}, src)
    else:
        src = tmp_path / "run"
        shutil.copytree(ds_saves[2] / "stage2-fp32", src)
        path = src / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        state = torch.load(path, weights_only=False)
        state["optimizer_state_dict"]["loss_scaler"] = Evil(marker)
        torch.save(state, path, pickle_protocol=4 if fmt.endswith("4") else 2)
    before = files_under(tmp_path)
    for args in (["inspect", src], ["verify", src, "--deep"], ["convert", src, tmp_path / "o", "--to", "hf"]):
        refused(timed, args, "posix.system", "--trust-pickle")
    assert files_under(tmp_path) == before
    assert not marker.exists()
