"""Object storage beyond the five base formats: the folders the frameworks write (Trainer, accelerate and Lightning run
roots and checkpoints), DeepSpeed MoE, per-rank DTensor files, DCP with safetensors serialization, DCP from FSDP2 +
tensor parallel and Megatron-Core torch_dist, each saved by the real producer (the session's fixtures), copied to a
bucket on a moto server and read there: inspect (text and JSON) and verify --deep print what they print for the local
copy, and a weights export from the bucket is byte-identical to the local one."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_folder_checkpoint

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

from s3_store import local_files, same_but_paths  # noqa: E402

CASES = {  # id: (fixture, the checkpoint inside what it returns)
    "trainer-ds2-run": ("run_folders", lambda f: f["trainer-ds2"]),
    "trainer-fsdp2-checkpoint": ("run_folders", lambda f: run_folder_checkpoint(f["trainer-fsdp2"])),
    "trainer-plain-run": ("run_folders", lambda f: f["trainer-plain"]),
    "accelerate-ds-checkpoint": ("run_folders", lambda f: run_folder_checkpoint(f["accelerate-ds"])),
    "accelerate-fsdp2-run": ("run_folders", lambda f: f["accelerate-fsdp2"]),
    "lightning-ds3-ckpt": ("run_folders", lambda f: run_folder_checkpoint(f["lightning-ds3"])),
    "lightning-plain-ckpt": ("run_folders", lambda f: run_folder_checkpoint(f["lightning-plain"])),
    "deepspeed-moe": ("ds_moe", lambda f: f / "w2" / "stage2-bf16-ep2"),
    "dtensor-fsdp2": ("dtensor_saves_2", lambda f: f / "fsdp2"),
    "dtensor-tp": ("dtensor_saves_4", lambda f: f / "tp"),
    "dcp-safetensors": ("dtensor_saves_2", lambda f: f / "dcp-st"),
    "dcp-hf": ("dtensor_saves_2", lambda f: f / "dcp-hf"),
    "dcp-fsdp2-tp": ("dcp_tp", lambda f: f / "tp"),
    "megatron": ("mcore", lambda f: f / "stacked"),
}


@pytest.fixture
def source(request, s3) -> tuple[Path, str]:
    fixture, inside = CASES[request.param]
    local = inside(request.getfixturevalue(fixture))
    return local, s3.upload(local, f"readers/{request.param}/{local.name}")


@pytest.mark.parametrize("source", sorted(CASES), indirect=True)
def test_inspect_and_verify_deep_match_the_local_copy(ckpt, source):
    local, url = source
    for command in (["inspect"], ["inspect", "--json"], ["inspect", "--tensors"], ["verify", "--deep"]):
        on_s3, here = ckpt(*command, url), ckpt(*command, local)
        assert on_s3.code == here.code == 0, (command, on_s3.out + on_s3.err, here.err)
        same_but_paths(on_s3.out, url, here.out, local)


@pytest.mark.parametrize("source", sorted(CASES), indirect=True)
def test_weights_export_from_the_bucket_is_byte_identical(ckpt, source, tmp_path):
    local, url = source
    here, there = tmp_path / "here.safetensors", tmp_path / "there.safetensors"
    assert ckpt("merge", local, here, "--quiet").code == 0
    res = ckpt("merge", url, there, "--quiet")
    assert res.code == 0, res.err
    assert local_files(there) == local_files(here)
