"""Bytes that pass unchanged between objects of one store are copied by the store (store/parts.py,
core/write/object_copies.py): S3 on a moto server (CopyObject, UploadPartCopy), Azure Blob on Azurite (Copy Blob From
URL). Sources are saved by the real libraries (the hub's sharder, safetensors.save_file, torch.save), outputs loaded by
safetensors and compared bit for bit; the request counts of ckpt_cli.store.clients show which bytes passed through this
process. A source changed between the plan and the copy fails the write (exit 1) and leaves nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from s3_store import local_files  # noqa: E402

from ckpt_cli.store import (
    clients,  # noqa: E402
    parts,  # noqa: E402
)
from ckpt_cli.store import s3 as s3_backend  # noqa: E402

MiB = 1 << 20


@pytest.fixture(params=["s3", "az"])
def store(request):
    return request.getfixturevalue(request.param)


def state_dict() -> dict[str, torch.Tensor]:
    """Three 6 MiB layers, a 20 MiB embedding and a small norm: two hub shards at 20 MB, each range long enough for
    S3 to copy as parts."""
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.empty(1536, 1024).uniform_(generator=g) for i in range(3)}
    sd["embed.weight"] = torch.empty(2560, 2048).uniform_(generator=g)
    sd["norm.weight"] = torch.rand(1024, generator=g)
    return sd


@pytest.fixture(scope="session")
def saved(tmp_path_factory) -> dict[str, Path]:
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("copies")
    sd = state_dict()
    (root / "hf").mkdir()
    save_torch_state_dict(sd, root / "hf", max_shard_size="20MB")
    save_file(sd, root / "one.safetensors", metadata={"format": "pt"})
    torch.save(sd, root / "one.pt")
    return {"hf": root / "hf", "safetensors": root / "one.safetensors", "torch": root / "one.pt"}


_uploaded: dict[tuple[str, str], str] = {}


def uploaded(store, saved, name: str) -> str:
    if (store.protocol, name) not in _uploaded:
        _uploaded[store.protocol, name] = store.upload(saved[name], f"copies/src/{name}/{saved[name].name}")
    return _uploaded[store.protocol, name]


def loads_as_saved(objects: dict[str, bytes]) -> None:
    """The real consumer: every safetensors object loads, and the tensors are bit-equal to what was saved."""
    from safetensors.torch import load

    got: dict[str, torch.Tensor] = {}
    for name, data in objects.items():
        if not name.endswith(".json"):
            got.update(load(data))
    want = state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


WHOLE = {  # command, source, destination name: every output object equals a source object byte for byte
    "hf": (["convert", "--to", "hf", "--max-shard-size", "20MB"], "hf", "hf"),
    "safetensors": (["convert", "--to", "safetensors"], "safetensors", "one.safetensors"),
}


@pytest.mark.parametrize("case", sorted(WHOLE))
def test_an_unchanged_file_is_copied_by_the_store(ckpt, store, saved, case):
    """The output equals the source object by object; its data never passed through this process (bytes received and
    sent are the headers compared and the index), every data byte was copied by the store."""
    args, source, name = WHOLE[case]
    url = uploaded(store, saved, source)
    key = f"copies/whole/{case}/{name}"
    clients.reset_stats()
    res = ckpt(args[0], url, store.url(key), *args[1:], "--quiet")
    assert res.code == 0, res.err
    stats = clients.stats()
    got, want = store.objects(key), local_files(saved[source])
    assert got == want
    loads_as_saved(got)
    data = sum(len(v) for k, v in want.items() if not k.endswith(".json"))
    assert stats.bytes_copied == data
    assert stats.bytes_in < 256 << 10 and stats.bytes_out < 64 << 10, stats


def test_a_merge_copies_long_ranges_in_s3(ckpt, s3, saved, tmp_path):
    """Two shards merged into one file: S3 copies each shard's data range as parts (UploadPartCopy); what passes
    through this process is the new header and the bytes that fill its part to S3's 5 MiB minimum."""
    url = uploaded(s3, saved, "hf")
    local = tmp_path / "merged.safetensors"
    assert ckpt("merge", saved["hf"], local, "--quiet").code == 0
    clients.reset_stats()
    res = ckpt("merge", url, s3.url("copies/merged.safetensors"), "--quiet")
    assert res.code == 0, res.err
    stats = clients.stats()
    got = s3.get("copies/merged.safetensors")
    assert got == local.read_bytes()
    loads_as_saved({"": got})
    assert stats.bytes_copied > 30 * MiB
    assert stats.bytes_in < 6 * MiB and stats.bytes_out < 6 * MiB, stats


def test_a_merge_asks_its_sources_entity_tags_at_once(ckpt, s3, saved, monkeypatch):
    """Before the merged object is completed, every shard it copied from is asked for its ETag again: all at once on the
    copy threads (a merge of 22 shards asked them one after another), each once, and the merge still commits."""
    asked: list[tuple[str, str]] = []
    real = s3_backend.Writer._current_etag

    def current(self, source):
        import threading

        asked.append((str(source), threading.current_thread().name))
        return real(self, source)

    monkeypatch.setattr(s3_backend.Writer, "_current_etag", current)
    url = uploaded(s3, saved, "hf")
    res = ckpt("merge", url, s3.url("copies/merged-etags.safetensors"), "--quiet")
    assert res.code == 0, res.err
    shards = sorted(k for k in s3.keys("copies/src/hf/") if k.endswith(".safetensors"))
    assert sorted(src.rsplit("/", 1)[1] for src, _ in asked) == [k.rsplit("/", 1)[1] for k in shards]
    assert len(shards) == 2 and all(thread.startswith("ckpt-copy") for _, thread in asked), asked


def test_data_with_a_crc_to_check_is_read_not_copied(ckpt, store, saved, tmp_path):
    """A torch zip's records carry CRC32s: its data is read (and checked) on the way, never copied unseen."""
    url = uploaded(store, saved, "torch")
    local = tmp_path / "from-torch.safetensors"
    assert ckpt("convert", saved["torch"], local, "--to", "safetensors", "--quiet").code == 0
    clients.reset_stats()
    res = ckpt("convert", url, store.url("copies/from-torch.safetensors"), "--to", "safetensors", "--quiet")
    assert res.code == 0, res.err
    assert clients.stats().bytes_copied == 0
    assert store.get("copies/from-torch.safetensors") == local.read_bytes()


def _changes_source_first(monkeypatch, store, key: str) -> None:
    """The first `copy` a writer is handed rewrites the source object first (same size, one byte flipped): a source
    changed after the plan read it."""
    real, done = parts.PartWriter.copy, []

    def copy(self, url, offset, nbytes):
        if not done:
            data = bytearray(store.get(key))
            data[-1] ^= 0xFF
            store.put(key, bytes(data))
            done.append(url)
        return real(self, url, offset, nbytes)

    monkeypatch.setattr(parts.PartWriter, "copy", copy)


@pytest.mark.parametrize("case", ["whole", "ranges"])
def test_a_source_changed_between_plan_and_copy_fails_and_leaves_nothing(ckpt, store, saved, monkeypatch, case):
    if case == "ranges" and store.protocol == "az":
        pytest.skip("Azure copies whole blobs only (Azurite has no Put Block From URL)")
    src = store.upload(saved["hf"], f"copies/changed-{case}/hf")  # its own copy: this test rewrites it
    shard = next(k for k in store.keys(f"copies/changed-{case}/hf/") if k.endswith("-of-00002.safetensors"))
    _changes_source_first(monkeypatch, store, shard)
    args = ["convert", src, store.url(f"copies/out-{case}/hf"), "--to", "hf", "--max-shard-size", "20MB"]
    if case == "ranges":
        args = ["merge", src, store.url(f"copies/out-{case}/merged.safetensors")]
    res = ckpt(*args, "--quiet")
    assert res.code == 1, res.err
    assert "changed since it was read" in res.err and len(res.err.strip().splitlines()) == 1, res.err
    assert store.keys(f"copies/out-{case}/") == [] and store.uploads(f"copies/out-{case}/") == []


def test_azure_itself_refuses_a_changed_source(ckpt, az, saved, monkeypatch):
    """With ckpt's own check before the copy taken away, the copy's source condition (the ETag the plan read) is
    what refuses it: Azurite answers 412, as Azure does. (moto ignores S3's CopySourceIfMatch: on S3 only the check
    before the commit is tested here.)"""
    src = az.upload(saved["safetensors"], "copies/changed-by-service/one.safetensors")
    monkeypatch.setattr(parts.PartWriter, "_check_source", lambda self, url, planned: None)
    _changes_source_first(monkeypatch, az, "copies/changed-by-service/one.safetensors")
    res = ckpt("convert", src, az.url("copies/out-service/one.safetensors"), "--to", "safetensors", "--quiet")
    assert res.code == 1, res.err
    assert "changed since it was read" in res.err and len(res.err.strip().splitlines()) == 1, res.err
    assert az.keys("copies/out-service/") == []


def test_a_failed_copy_leaves_nothing(ckpt, s3, saved, monkeypatch):
    """A copied part that fails: the multipart upload is aborted, nothing is committed."""

    def fail(self, number, source, start, end, etag):
        raise OSError("injected: connection reset")

    monkeypatch.setattr(s3_backend.Writer, "_copy_part", fail)
    url = uploaded(s3, saved, "hf")
    res = ckpt("merge", url, s3.url("copies/failed/merged.safetensors"), "--quiet")
    assert res.code == 1 and "injected" in res.err, res.err
    assert s3.keys("copies/failed/") == [] and s3.uploads("copies/failed/") == []


@pytest.mark.parametrize("damage", ["truncated", "header-past-end"])
def test_a_damaged_source_is_refused_before_any_copy(ckpt, store, saved, tmp_path, damage):
    """What the copy path would copy unseen is still checked: a source object cut short, or whose header names data
    past its end, fails with one line (exit 1) and leaves nothing."""
    data = saved["safetensors"].read_bytes()
    if damage == "truncated":
        data = data[: len(data) - 4096]
    else:  # the last tensor's end offset moved past the object's end (same digits: the header keeps its length)
        n = int.from_bytes(data[:8], "little")
        end = max(v["data_offsets"][1] for k, v in json.loads(data[8 : 8 + n]).items() if k != "__metadata__")
        assert len(str(end)) == len(str(end + 4))
        data = data[:8] + data[8 : 8 + n].replace(f"{end}]".encode(), f"{end + 4}]".encode()) + data[8 + n :]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data)
    url = store.upload(bad, f"copies/damaged-{damage}/bad.safetensors")
    res = ckpt("convert", url, store.url(f"copies/out-damaged-{damage}/x.safetensors"), "--to", "safetensors", "--quiet")
    assert res.code == 1, res.err
    assert len(res.err.strip().splitlines()) == 1 and "bad.safetensors" in res.err, res.err
    assert store.keys(f"copies/out-damaged-{damage}/") == [] and store.uploads(f"copies/out-damaged-{damage}/") == []
