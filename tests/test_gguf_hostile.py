"""Damaged and malicious GGUF files: each gets one line naming the file and the problem, exit 1, no traceback, and a
conversion leaves nothing behind. The file is written by gguf-py's GGUFWriter (the library llama.cpp's converter
writes with), then its bytes are changed where gguf-py's GGUFReader says each field lies."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from conftest import assert_fails

from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.errors import DataError
from ckpt_cli.formats.gguf.reader import READER


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A GGUF of three tensors (F32, Q8_0, F16) and a few keys, as gguf-py writes it."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = gguf.GGUFWriter(path, "tiny")
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(8)])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((4, 32)).astype(np.float32))
    w.add_tensor(
        "b.weight",
        gguf.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor("c.weight", rng.standard_normal((2, 16)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fields(path):
    """Where things lie: each key's field offset, each tensor info's field offsets (name, dims, type, offset)."""
    import gguf

    r = gguf.GGUFReader(path)
    keys = {k: f.offset for k, f in r.fields.items()}
    infos = {}
    for t in r.tensors:
        start, name_len, n_dims = t.field.offset, len(t.name.encode()), len(t.shape)
        dims = start + 8 + name_len + 4
        infos[t.name] = {"start": start, "name": start + 8, "dims": dims, "type": dims + 8 * n_dims, "offset": dims + 8 * n_dims + 4}
    data_start = min(t.data_offset for t in r.tensors)
    return keys, infos, data_start


def put(raw: bytearray, at: int, fmt: str, value) -> bytearray:
    raw[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return raw


def damaged(src, dest, change):
    raw = bytearray(src.read_bytes())
    keys, infos, data_start = fields(src)
    dest.write_bytes(bytes(change(raw, keys, infos, data_start)))
    return dest


# (damage, what the message names, refused already by `read` (else found by verify's structural check))
CASES = {
    "bad-magic": (lambda r, k, i, d: put(r, 0, "4s", b"GGUX"), "not a GGUF file", True),
    "version-4": (lambda r, k, i, d: put(r, 4, "<I", 4), "GGUF version 4 is not supported", True),
    "version-1": (lambda r, k, i, d: put(r, 4, "<I", 1), "GGUF version 1 is not supported", True),
    "big-endian": (lambda r, k, i, d: put(r, 4, ">I", 3), "big-endian", True),
    "tensor-count-2^60": (lambda r, k, i, d: put(r, 8, "<Q", 1 << 60), "claims 1152921504606846976 tensors", True),
    "kv-count-2^60": (lambda r, k, i, d: put(r, 16, "<Q", 1 << 60), "claims 1152921504606846976 metadata keys", True),
    "key-length-4GB": (lambda r, k, i, d: put(r, 24, "<Q", 4 << 30), "a string of 4294967296 bytes at offset 24", True),
    "value-length-4GB": (lambda r, k, i, d: put(r, k["tokenizer.ggml.model"] + 8 + 20 + 4, "<Q", 4 << 30), "runs past the end", True),
    "array-count-2^40": (
        lambda r, k, i, d: put(r, k["tokenizer.ggml.tokens"] + 8 + 21 + 4 + 4, "<Q", 1 << 40),
        "claims an array of 1099511627776",
        True,
    ),
    "value-type-99": (lambda r, k, i, d: put(r, k["general.architecture"] + 8 + 20, "<I", 99), "value type 99", True),
    "duplicate-key": (lambda r, k, i, d: put(r, k["tokenizer.ggml.model"] + 8, "20s", b"general.architecture"), "appears twice", True),
    "tensor-type-99": (lambda r, k, i, d: put(r, i["b.weight"]["type"], "<I", 99), "type 99", True),
    "tensor-type-removed": (lambda r, k, i, d: put(r, i["b.weight"]["type"], "<I", 4), "ggml removed it", True),
    "duplicate-tensor": (lambda r, k, i, d: put(r, i["c.weight"]["name"], "8s", b"a.weight"), "'a.weight' appears twice", True),
    "partial-block": (lambda r, k, i, d: put(r, i["b.weight"]["dims"], "<Q", 48), "not a whole number of its blocks of 32", True),
    "five-dims": (lambda r, k, i, d: put(r, i["a.weight"]["dims"] - 4, "<I", 5), "5 dimensions", True),
    "dims-overflow": (lambda r, k, i, d: put(r, i["a.weight"]["dims"] + 8, "<Q", 1 << 62), "overflows 64 bits", True),
    "data-past-eof": (lambda r, k, i, d: put(r, i["c.weight"]["offset"], "<Q", 1 << 20), "truncated", True),
    "alignment-not-power-of-2": (lambda r, k, i, d: r, "", False),  # placeholder, replaced below
    "overlap": (lambda r, k, i, d: put(r, i["c.weight"]["offset"], "<Q", 0), "overlaps tensor", False),
    "misaligned": (lambda r, k, i, d: put(r, i["b.weight"]["offset"], "<Q", 512 + 1), "not aligned to 32 bytes", False),
    "out-of-place": (lambda r, k, i, d: put(r, i["c.weight"]["offset"], "<Q", 832) + bytes(64), "llama.cpp expects 800", False),
}
del CASES["alignment-not-power-of-2"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_file(small, tmp_path, ckpt, case):
    change, needle, at_read = CASES[case]
    path = damaged(small, tmp_path / "bad.gguf", change)
    res = ckpt("verify", path)
    assert_fails(res, str(path), needle)
    res = ckpt("inspect", path)
    if at_read:
        assert_fails(res, str(path), needle)
        assert len(res.err.strip().splitlines()) == 1, res.err
    else:
        assert res.code == 0, res.err
    dest = tmp_path / "out"
    res = ckpt("convert", path, dest, "--to", "safetensors")
    assert_fails(res, str(path), needle)
    assert len([line for line in res.err.strip().splitlines() if not line.startswith("note: ")]) == 1, res.err
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_truncated_anywhere(small, tmp_path):
    """Cut at every byte of the header (magic, counts, each key-value, each tensor info, the padding) and inside the
    data: one line naming the file, never an exception of another kind."""
    raw = small.read_bytes()
    _, _, data_start = fields(small)
    cut = tmp_path / "cut.gguf"
    for size in [*range(0, data_start + 1), data_start + 100, len(raw) - 1]:
        cut.write_bytes(raw[:size])
        with pytest.raises(DataError) as exc:
            READER.read(cut, ReadOptions())
        text = str(exc.value)
        assert text.startswith(f"{cut}:") and "\n" not in text, (size, text)


def test_truncated_cli(small, tmp_path, ckpt):
    raw = small.read_bytes()
    _, infos, data_start = fields(small)
    for size in (3, 20, 40, infos["b.weight"]["type"], data_start - 1, len(raw) - 10):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(raw[:size])
        res = ckpt("convert", cut, tmp_path / "out", "--to", "hf")
        assert_fails(res, str(cut))
        assert not (tmp_path / "out").exists()


def test_alignment_must_be_a_power_of_2(tmp_path, ckpt):
    import gguf

    path = tmp_path / "align.gguf"
    w = gguf.GGUFWriter(path, "tiny")
    w.add_uint32("general.alignment", 24)
    w.add_tensor("a.weight", np.ones((2, 8), dtype=np.float32))
    w.data_alignment = 32  # gguf-py would pad to the key's value; the file only claims it
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_fails(ckpt("inspect", path), str(path), "alignment 24 is not a power of 2")


def test_type_ckpt_does_not_dequantize(tmp_path, ckpt):
    """An IQ2_XXS tensor: inspect and verify read its layout (a note says it cannot be dequantized); verify --deep and a
    conversion stop at it with exit 1, naming the type, and leave nothing."""
    import gguf

    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(path, "tiny")
    w.add_tensor("a.weight", np.zeros((2, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    res = ckpt("inspect", path, "--json")
    assert res.code == 0 and "IQ2_XXS" in res.out and "cannot be dequantized" in res.out, res.err
    assert ckpt("verify", path).code == 0
    assert_fails(ckpt("verify", path, "--deep"), "IQ2_XXS, which ckpt does not dequantize")
    dest = tmp_path / "out.safetensors"
    res = ckpt("convert", path, dest, "--to", "safetensors")
    assert_fails(res, str(path), "IQ2_XXS, which ckpt does not dequantize")
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_nonfinite_scale_found_by_deep_verify(small, tmp_path, ckpt):
    """A Q8_0 block whose fp16 scale is inf: the structure is whole, verify --deep names the tensor and block (as
    ggml_validate_row_data does)."""
    _, _, data_start = fields(small)
    import gguf

    r = gguf.GGUFReader(small)
    b = next(t for t in r.tensors if t.name == "b.weight")
    raw = bytearray(small.read_bytes())
    put(raw, b.data_offset + 34, "<H", 0x7C00)  # block 1's d = +inf
    path = tmp_path / "inf.gguf"
    path.write_bytes(bytes(raw))
    assert ckpt("verify", path).code == 0
    assert_fails(ckpt("verify", path, "--deep"), str(path), "'b.weight' (Q8_0): block 1 has inf")


def test_manifest_finds_a_changed_quantized_value(small, tmp_path, ckpt):
    """GGUF has no checksums: a flipped bit inside a Q8_0 block's values passes verify --deep (the structure and
    every scale are fine); a manifest recorded before finds it."""
    import gguf

    manifest = tmp_path / "m.json"
    assert ckpt("verify", small, "--write-manifest", manifest).code == 0
    b = next(t for t in gguf.GGUFReader(small).tensors if t.name == "b.weight")
    raw = bytearray(small.read_bytes())
    raw[b.data_offset + 10] ^= 0x01
    path = tmp_path / "small.gguf"
    path.write_bytes(bytes(raw))
    res = ckpt("verify", path, "--deep")
    assert res.code == 0 and "stores no checksums" in res.err, res.out + res.err
    assert_fails(ckpt("verify", path, "--manifest", manifest), "b.weight")


def test_the_api_raises_ckpt_errors_only(small, tmp_path):
    """test_api_errors.py's damages (truncations, flipped bits in the header and anywhere, garbage, a folder, a FIFO),
    and 200 more bit flips in the header: `ckpt_cli.open`, `inspect` and `verify(deep=True)` raise CkptError or pass."""
    import random

    from test_api_errors import BINARY_DAMAGE, _calls

    from ckpt_cli.errors import CkptError

    _, _, data_start = fields(small)
    rng = random.Random(0)
    damages = dict(BINARY_DAMAGE)
    for i in range(200):
        flips = [(rng.randrange(data_start), rng.randrange(8)) for _ in range(rng.randrange(1, 5))]
        damages[f"header flips {i}"] = lambda p, flips=flips: p.write_bytes(bytes(_flipped(p.read_bytes(), flips)))
    failures = []
    for label, damage in damages.items():
        copy = tmp_path / "case.gguf"
        copy.unlink(missing_ok=True) if not copy.is_dir() else copy.rmdir()
        copy.write_bytes(small.read_bytes())
        damage(copy)
        for call, run in _calls(copy):
            try:
                run()
            except CkptError:
                pass
            except BaseException as exc:  # noqa: BLE001 - the point: anything else is a failure
                failures.append(f"{call} with {label}: {type(exc).__name__}: {str(exc)[:160]}")
    copy.unlink() if copy.is_file() or copy.is_fifo() else copy.rmdir()
    assert not failures, "\n".join(failures)


def _flipped(data: bytes, flips) -> bytearray:
    out = bytearray(data)
    for at, bit in flips:
        out[at] ^= 1 << bit
    return out
