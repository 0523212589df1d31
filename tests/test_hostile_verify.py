"""Checkpoints the frameworks themselves refuse, and damage a copy would carry: verify says FAILED, every
writing command refuses (exit 1, one line, nothing written), on real-producer checkpoints with targeted
damage, and on hand-made files where no producer makes the case (a duplicate zip member)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import time
import zipfile

import pytest
import torch
from conftest import assert_fails
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ckpt_cli.core.pickles.zipio import read_records
from ckpt_cli.ops.source import open_checkpoint

TAG = "global_step3"
RANK1_OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.fixture
def copy_s2(ds_saves, tmp_path):
    """DeepSpeed ZeRO-2, fp32, 2 ranks, as DeepSpeed saved it."""
    dest = tmp_path / "run"
    shutil.copytree(ds_saves[2] / "stage2-fp32", dest)
    return dest


@pytest.fixture
def copy_w2(fsdp2_saves, tmp_path):
    """FSDP2 + dcp.save on 2 ranks."""
    dest = tmp_path / "ckpt"
    shutil.copytree(fsdp2_saves[2] / "ckpt", dest)
    return dest


@pytest.fixture
def hf_copy(mixed_files, tmp_path):
    dest = tmp_path / "hf"
    shutil.copytree(mixed_files["hf"], dest)
    return dest


def assert_refused(res, dest, *needles) -> None:
    """Exit 1, one error line naming `needles` (beside the plan's notes, printed before the write), no traceback,
    and nothing at (or beside) the destination."""
    assert_fails(res, *needles)
    assert len([line for line in res.err.strip().splitlines() if not line.startswith("note: ")]) == 1, res.err
    assert not dest.exists(), dest
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}")]


def assert_verify_fails(res, *needles) -> None:
    """Exit 1: the FAILED line, then one line per problem."""
    assert_fails(res, *needles)
    lines = res.out.strip().splitlines()
    assert lines[0].startswith("FAILED") and all(line.startswith("  ") for line in lines[1:]), res.out


@pytest.fixture(autouse=True)
def quick():
    """Every case under 20 s."""
    start = time.monotonic()
    yield
    assert time.monotonic() - start < 20


# ---- zip archives: duplicate and foreign member names ---------------------------------------------


def rezip(src, dest, extra_first=(), extra_last=()) -> None:
    """The archive `src` written again member by member, with extra (name, bytes) members before and after."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zipfile warns about the duplicate names we add on purpose
            for name, data in extra_first:
                zout.writestr(name, data)
            for info in zin.infolist():
                zout.writestr(info.filename, zin.read(info.filename))
            for name, data in extra_last:
                zout.writestr(name, data)


HIDDEN = pickle.dumps({"w": "not what verify read"}, protocol=2)


@pytest.mark.parametrize("where", ["first", "last"])
def test_torch_file_with_a_duplicate_data_pkl(ckpt, tmp_path, where):
    """torch's reader takes whichever of two equal names its search meets first: ckpt refuses both orders."""
    torch.save({"w": torch.arange(6.0)}, tmp_path / "good.pt")
    extra = [("good/data.pkl", HIDDEN)]
    rezip(tmp_path / "good.pt", tmp_path / "dup.pt", **({"extra_first": extra} if where == "first" else {"extra_last": extra}))
    assert_verify_fails(ckpt("verify", tmp_path / "dup.pt", "--deep"), "dup.pt", "data.pkl", "appears twice")
    assert_fails(ckpt("inspect", tmp_path / "dup.pt"), "appears twice")
    assert_refused(ckpt("convert", tmp_path / "dup.pt", tmp_path / "out.safetensors", "--to", "safetensors"), tmp_path / "out.safetensors")


@pytest.mark.parametrize("name", ["data.pkl", "other/data/0", "good/../good/data/0", "good//data/0", "good/data/./0"])
def test_torch_file_with_a_member_torch_would_not_write(ckpt, tmp_path, name):
    torch.save({"w": torch.arange(6.0)}, tmp_path / "good.pt")
    rezip(tmp_path / "good.pt", tmp_path / "odd.pt", extra_last=[(name, b"\x00" * 24)])
    assert_verify_fails(ckpt("verify", tmp_path / "odd.pt"), "odd.pt", "not a plain name inside the archive folder")


def test_torch_file_whose_first_member_is_not_in_a_folder(ckpt, tmp_path):
    torch.save({"w": torch.arange(6.0)}, tmp_path / "good.pt")
    rezip(tmp_path / "good.pt", tmp_path / "odd.pt", extra_first=[("loose", b"x")])
    assert_verify_fails(ckpt("verify", tmp_path / "odd.pt"), "odd.pt", "not inside a folder")


def test_deepspeed_rank_file_with_a_duplicate_member(ckpt, copy_s2, tmp_path):
    path = copy_s2 / TAG / RANK1_OPTIM
    top = zipfile.ZipFile(path).namelist()[0].split("/")[0]
    rezip(path, tmp_path / "dup.pt", extra_first=[(f"{top}/data.pkl", HIDDEN)])
    shutil.move(tmp_path / "dup.pt", path)
    assert_verify_fails(ckpt("verify", copy_s2), RANK1_OPTIM, "appears twice")
    assert_refused(ckpt("reshard", copy_s2, tmp_path / "out", "--world-size", "1"), tmp_path / "out", "appears twice")


def test_distcp_chunk_archive_with_a_duplicate_member(ckpt, copy_w2, tmp_path):
    """The last archive of a .distcp rewritten with a second data/0; .metadata updated to its new length."""
    meta = raw_metadata(copy_w2)
    index, info = max(((k, v) for k, v in meta.storage_data.items() if v.relative_path == "__1_0.distcp"), key=lambda kv: kv[1].offset)
    path = copy_w2 / info.relative_path
    data = path.read_bytes()
    (tmp_path / "chunk.zip").write_bytes(data[info.offset : info.offset + info.length])
    top = zipfile.ZipFile(tmp_path / "chunk.zip").namelist()[0].split("/")[0]
    record = zipfile.ZipFile(tmp_path / "chunk.zip").read(f"{top}/data/0")
    rezip(tmp_path / "chunk.zip", tmp_path / "dup.zip", extra_first=[(f"{top}/data/0", bytes(len(record)))])
    archive = (tmp_path / "dup.zip").read_bytes()
    path.write_bytes(data[: info.offset] + archive + data[info.offset + info.length :])
    meta.storage_data[index].length = len(archive)
    write_metadata(copy_w2, meta)
    assert_verify_fails(ckpt("verify", copy_w2), "__1_0.distcp", "appears twice")
    assert_refused(ckpt("reshard", copy_w2, tmp_path / "out", "--world-size", "3"), tmp_path / "out", "appears twice")


# ---- DeepSpeed: what its own loaders refuse ---------------------------------------------------------


def test_deepspeed_dp_world_size_disagrees_with_the_partition_count(ckpt, copy_s2, tmp_path):
    """load_checkpoint opens dp_world_size rank files and checks it against the live world size."""
    path = copy_s2 / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    state["dp_world_size"] = 4
    torch.save(state, path)
    assert_verify_fails(ckpt("verify", copy_s2), "mp_rank_00_model_states.pt", "dp_world_size is 4", "partitioned for 2 ranks")
    assert_refused(ckpt("merge", copy_s2, tmp_path / "m.safetensors"), tmp_path / "m.safetensors", "dp_world_size", "ckpt verify")


def test_deepspeed_leftover_rank_file_from_a_larger_run(ckpt, copy_s2, tmp_path):
    """zero_to_fp32 globs '*_optim_states.pt' and refuses a count other than partition_count."""
    shutil.copy(copy_s2 / TAG / RANK1_OPTIM, copy_s2 / TAG / "zero_pp_rank_3_mp_rank_00_optim_states.pt")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(ValueError, match="Expected 2"):
        get_fp32_state_dict_from_zero_checkpoint(str(copy_s2))
    assert_verify_fails(ckpt("verify", copy_s2), "zero_pp_rank_3_mp_rank_00_optim_states.pt", "leftover")
    for args in (["reshard", copy_s2, tmp_path / "r", "--world-size", "1"], ["merge", copy_s2, tmp_path / "r.pt"]):
        assert_refused(ckpt(*args), args[2], "rank 3")


def test_deepspeed_two_optimizer_files_for_one_rank(ckpt, copy_s2, tmp_path):
    shutil.copy(copy_s2 / TAG / RANK1_OPTIM, copy_s2 / TAG / f"bf16_{RANK1_OPTIM}")
    assert_verify_fails(ckpt("verify", copy_s2), "2 optimizer files for rank 1")
    assert_refused(ckpt("convert", copy_s2, tmp_path / "o.pt", "--to", "torch"), tmp_path / "o.pt", "rank 1")


def test_deepspeed_stage3_partition_shorter_than_its_parameters(ckpt, ds_saves, tmp_path):
    """Stage 3 pieces are made by arithmetic, not enumerated by verify: the reader checks each rank's flat partition
    holds exactly what its parameters take, which DeepSpeed and zero_to_fp32 require too."""
    run = tmp_path / "run"
    shutil.copytree(ds_saves[2] / "stage3-fp32", run)
    path = run / TAG / RANK1_OPTIM
    state = torch.load(path, weights_only=False)
    flat = state["optimizer_state_dict"]["fp32_flat_groups"]
    flat[0] = flat[0][:-1].clone()
    torch.save(state, path)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises((ValueError, RuntimeError)):  # the last parameter's gathered slices fall short of its shape
        get_fp32_state_dict_from_zero_checkpoint(str(run))
    assert_verify_fails(ckpt("verify", run), RANK1_OPTIM, "fp32 weights partition of sub-group 0 holds", "take")
    assert_refused(ckpt("merge", run, tmp_path / "m.safetensors"), tmp_path / "m.safetensors", RANK1_OPTIM)


# ---- safetensors: what the library refuses -------------------------------------------------------------


def write_raw_safetensors(path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def library_refuses(path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                f.get_tensor(key)
    except SafetensorError:
        return True
    return False


A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
A_HALF = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}  # the library keeps the last of two equal names
HEADERS = {
    "metadata int": (json.dumps({"__metadata__": {"step": 3}, "a": A}).encode(), 8, "__metadata__"),
    "metadata null value": (json.dumps({"__metadata__": {"k": None}, "a": A}).encode(), 8, "__metadata__"),
    "metadata list": (json.dumps({"__metadata__": ["x"], "a": A}).encode(), 8, "__metadata__"),
    "float shape": (json.dumps({"a": {**A, "shape": [2.0]}}).encode(), 8, "shape"),
    "bool shape": (json.dumps({"a": {**A, "shape": [True, 2]}}).encode(), 8, "shape"),
    "string offset": (json.dumps({"a": {**A, "data_offsets": ["0", 8]}}).encode(), 8, "data_offsets"),
    "three offsets": (json.dumps({"a": {**A, "data_offsets": [0, 8, 8]}}).encode(), 8, "data_offsets"),
    "repeated name": (b'{"a":' + json.dumps(A).encode() + b',"a":' + json.dumps(A_HALF).encode() + b"}", 8, "twice"),
    "NaN": (b'{"a":' + json.dumps({**A, "x": float("nan")}).encode() + b"}", 8, "not valid JSON"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_safetensors_header_the_library_refuses(ckpt, tmp_path, case):
    header, data_len, needle = HEADERS[case]
    path = tmp_path / "bad.safetensors"
    write_raw_safetensors(path, header, bytes(data_len))
    assert library_refuses(path)
    assert_verify_fails(ckpt("verify", path), "bad.safetensors", needle)
    assert_fails(ckpt("inspect", path), "bad.safetensors")
    assert_refused(ckpt("convert", path, tmp_path / "o.pt", "--to", "torch"), tmp_path / "o.pt", "bad.safetensors")


def test_safetensors_metadata_with_non_string_values_in_a_real_file(ckpt, mixed_files, tmp_path):
    """save_file's own output, its __metadata__ rewritten with a number (same header length: spaces pad it)."""
    data = mixed_files["safetensors"].read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + n].replace(b'"__metadata__":{"format":"pt"}', b'"__metadata__":{"format":1}   ')
    assert len(header) == n
    path = tmp_path / "mixed.safetensors"
    path.write_bytes(data[:8] + header + data[8 + n :])
    assert library_refuses(path)
    assert_verify_fails(ckpt("verify", path), "mixed.safetensors", "__metadata__ must map strings to strings")
    assert_refused(ckpt("split", path, tmp_path / "out", "--num-shards", "2"), tmp_path / "out", "__metadata__")


@pytest.mark.parametrize("damage", ["trailing", "gap"])
def test_safetensors_gaps_and_trailing_bytes(ckpt, mixed_files, tmp_path, damage):
    """The library requires the tensors to tile the data buffer exactly; ckpt reports it and refuses to convert."""
    path = tmp_path / "t.safetensors"
    if damage == "trailing":
        path.write_bytes(mixed_files["safetensors"].read_bytes() + b"\x00" * 16)
    else:
        write_raw_safetensors(path, json.dumps({"a": {**A, "data_offsets": [8, 16]}}).encode(), bytes(16))
    assert library_refuses(path)
    assert_verify_fails(ckpt("verify", path), "t.safetensors", "library refuses")
    assert_refused(ckpt("convert", path, tmp_path / "o.pt", "--to", "torch"), tmp_path / "o.pt", "t.safetensors", "verify rejects")


def test_hf_shard_the_library_refuses(ckpt, hf_copy, tmp_path):
    shard = sorted(hf_copy.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes() + b"\x00" * 8)
    assert library_refuses(shard)
    assert_verify_fails(ckpt("verify", hf_copy), shard.name)
    assert_refused(ckpt("reshard", hf_copy, tmp_path / "o", "--num-shards", "1"), tmp_path / "o", shard.name)


# ---- DCP: negative sizes, offsets and lengths in .metadata ------------------------------------------------


def raw_metadata(path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # torch's own output: trusted here


def write_metadata(path, meta) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def _negative_size(meta) -> None:
    t = meta.state_dict_metadata["model.embed.weight"]
    t.size = torch.Size([-t.size[0], t.size[1]])


def _negative_chunk(meta) -> None:
    chunk = meta.state_dict_metadata["model.embed.weight"].chunks[0]
    chunk.sizes = torch.Size([-chunk.sizes[0], chunk.sizes[1]])


def _negative_offset(meta) -> None:
    meta.storage_data[next(k for k in meta.storage_data if k.fqn == "model.head.bias")].offset = -64


def _negative_length(meta) -> None:
    meta.storage_data[next(k for k in meta.storage_data if k.fqn == "model.head.bias")].length = -5


@pytest.mark.parametrize(
    "change,needle",
    [(_negative_size, "has size (-"), (_negative_chunk, "non-negative"), (_negative_offset, "offset -64"), (_negative_length, "length -5")],
)
def test_dcp_negative_sizes_offsets_lengths(ckpt, copy_w2, tmp_path, change, needle):
    meta = raw_metadata(copy_w2)
    change(meta)
    write_metadata(copy_w2, meta)
    assert_verify_fails(ckpt("verify", copy_w2), ".metadata", needle)
    assert_refused(ckpt("reshard", copy_w2, tmp_path / "o", "--world-size", "3"), tmp_path / "o", ".metadata")


# ---- writing commands refuse what verify rejects -------------------------------------------------------


def test_writes_refuse_a_dcp_source_verify_rejects(ckpt, copy_w2, tmp_path):
    shutil.copy(copy_w2 / "__1_0.distcp", copy_w2 / "__5_0.distcp")  # a leftover of another save
    os.utime(copy_w2 / ".metadata")
    assert_verify_fails(ckpt("verify", copy_w2), "__5_0.distcp", "not referenced")
    for args in (["reshard", copy_w2, tmp_path / "r", "--world-size", "3"], ["convert", copy_w2, tmp_path / "c", "--to", "hf"]):
        assert_refused(ckpt(*args), args[2], "__5_0.distcp", "verify rejects")
    assert_refused(ckpt("merge", copy_w2, tmp_path / "m.safetensors", "--dry-run"), tmp_path / "m.safetensors", "__5_0.distcp")


def test_writes_refuse_an_hf_source_verify_rejects(ckpt, hf_copy, tmp_path):
    index = hf_copy / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"]["total_size"] += 1
    index.write_text(json.dumps(doc))
    assert_verify_fails(ckpt("verify", hf_copy), "total_size")
    assert_refused(ckpt("merge", hf_copy, tmp_path / "m.safetensors"), tmp_path / "m.safetensors", "total_size")


def test_structure_check_adds_little_to_a_write(ckpt, copy_w2, tmp_path):
    """The refusal check reads metadata only: a dry run costs about what inspect does."""
    start = time.perf_counter()
    assert ckpt("inspect", copy_w2).code == 0
    inspect = time.perf_counter() - start
    start = time.perf_counter()
    assert ckpt("reshard", copy_w2, tmp_path / "o", "--world-size", "3", "--dry-run").code == 0
    assert time.perf_counter() - start < 3 * inspect + 0.5


# ---- conversions check every zip record they copy --------------------------------------------------------


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def deepspeed_weight_record(folder):
    """The record of rank 1's fp32 master weights (the bytes merge, reshard and convert all copy)."""
    ckpt = open_checkpoint(folder, None, None, False)
    records = {p.data.record for t in ckpt.tensors.values() if t.role == "model" for p in t.pieces if p.data.path.endswith(RANK1_OPTIM)}
    return max((r for r in records if r is not None), key=lambda r: r.size)


def test_deepspeed_flipped_byte_is_not_copied(ckpt, copy_s2, tmp_path):
    path = copy_s2 / TAG / RANK1_OPTIM
    rec = deepspeed_weight_record(copy_s2)
    flip(path, rec.data_offset + rec.size // 2)
    assert ckpt("verify", copy_s2).code == 0  # the structure is intact; only the bytes changed
    for args in (
        ["reshard", copy_s2, tmp_path / "r", "--world-size", "3"],
        ["convert", copy_s2, tmp_path / "d", "--to", "dcp", "--world-size", "2"],
        ["merge", copy_s2, tmp_path / "m.safetensors"],
        ["convert", copy_s2, tmp_path / "h", "--to", "hf", "--dtype", "bf16"],
    ):
        assert_refused(ckpt(*args), args[2], RANK1_OPTIM, rec.name, "CRC32")


def test_distcp_flipped_byte_is_not_copied(ckpt, copy_w2, tmp_path):
    meta = raw_metadata(copy_w2)
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "model.embed.weight" and k.offset[0] == 0)
    path = copy_w2 / info.relative_path
    with open(path, "rb") as f:
        rec = read_records(f, path.name, info.offset, info.length)["data/0"]
    flip(path, rec.data_offset + rec.size // 2)
    os.utime(copy_w2 / ".metadata")
    assert ckpt("verify", copy_w2).code == 0
    for args in (
        ["reshard", copy_w2, tmp_path / "r", "--world-size", "3"],
        ["convert", copy_w2, tmp_path / "h", "--to", "hf"],
        ["merge", copy_w2, tmp_path / "m.pt", "--all"],
        ["convert", copy_w2, tmp_path / "ds", "--to", "deepspeed", "--zero-stage", "2", "--world-size", "2"],
    ):
        assert_refused(ckpt(*args), args[2], info.relative_path, "CRC32")


def test_distcp_flipped_byte_in_a_value_copied_verbatim(ckpt, copy_w2, tmp_path):
    """DCP -> DCP copies a pickled value's archive byte for byte: its records are checked too."""
    obj = next(o for o in open_checkpoint(copy_w2, None, None, False).objects.values() if o.raw is not None)
    path, offset, length = obj.raw
    with open(path, "rb") as f:
        rec = read_records(f, path, offset, length)["byteorder"]  # not read to parse the value: only a copy sees it
    flip(copy_w2 / os.path.basename(path), rec.data_offset)
    os.utime(copy_w2 / ".metadata")
    assert ckpt("inspect", copy_w2).code == 0
    assert_refused(ckpt("reshard", copy_w2, tmp_path / "r", "--world-size", "3"), tmp_path / "r", os.path.basename(path), "CRC32")


def test_torch_file_flipped_byte_outside_the_copied_view(ckpt, tmp_path):
    """A view saves its whole storage but only the viewed bytes are copied: the rest of the record is read
    to check its CRC32 all the same; a strided (transposed) tensor is checked through its memory map."""
    base = torch.arange(64.0)
    torch.save({"view": base[8:16], "t": torch.arange(12.0).reshape(3, 4).t()}, tmp_path / "v.pt")
    assert ckpt("convert", tmp_path / "v.pt", tmp_path / "ok.safetensors", "--to", "safetensors", "-q").code == 0
    with open(tmp_path / "v.pt", "rb") as f:
        records = read_records(f, "v.pt")
    for key, offset in (("data/0", 4), ("data/1", 20)):  # element 1 of the unviewed head; inside the transposed storage
        damaged = tmp_path / f"{key.replace('/', '_')}.pt"
        shutil.copy(tmp_path / "v.pt", damaged)
        flip(damaged, records[key].data_offset + offset)
        out = tmp_path / f"{damaged.stem}.safetensors"
        assert_refused(ckpt("convert", damaged, out, "--to", "safetensors"), out, damaged.name, key, "CRC32")


def test_clean_sources_convert_with_the_check(ckpt, copy_s2, copy_w2, mixed_files, tmp_path):
    for args in (
        ["reshard", copy_s2, tmp_path / "r", "--world-size", "3"],
        ["reshard", copy_w2, tmp_path / "w", "--world-size", "3"],
        ["convert", mixed_files["torch"], tmp_path / "t.safetensors", "--to", "safetensors"],
    ):
        res = ckpt(*args, "-q")
        assert res.code == 0, res.err
    save_file({"x": torch.ones(3)}, tmp_path / "x.safetensors")
    assert ckpt("convert", tmp_path / "x.safetensors", tmp_path / "x.pt", "--to", "torch", "-q").code == 0
