"""Checkpoints on object storage, against real servers of two stores: S3 (moto in server mode, spoken to by s3fs and
boto3) and Azure Blob (Azurite, the Azure Storage emulator, spoken to by adlfs and azure-storage-blob), each on a free
port with credentials and endpoint from the environment. The tests that take `store` run on both.

Every format's inspect in the store equals inspect of the local copy (but for paths); verify --deep passes and fails
after one flipped byte; writes store -> store, store -> local and local -> store are byte-identical to the local run,
in one process and under torchrun; a failed, interrupted or killed write leaves no commit marker, and the unfinished
uploads it leaves are named by verify and dropped by --overwrite; inspect of a >= 200 MB checkpoint transfers < 1 MB.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port, run_folder_checkpoint, run_subprocess, torchrun, torchrun_command
from s3_proxy import Flaky

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

import az_store  # noqa: E402
from s3_store import BUCKET, ISOLATED, local_files, same_but_paths  # noqa: E402

from ckpt_cli.ops.source import open_checkpoint  # noqa: E402
from ckpt_cli.store import azure as az_backend  # noqa: E402
from ckpt_cli.store import clients as filesystems  # noqa: E402
from ckpt_cli.store import s3 as s3_backend  # noqa: E402


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Real training saves, one torchrun each: FSDP2 + dcp.save at W=2, DeepSpeed ZeRO-2 fp32 and ZeRO-3 bf16 at W=2."""
    root = tmp_path_factory.mktemp("s3_trained")
    torchrun(2, "fsdp2.py", "save", root / "fsdp2")
    torchrun(2, "deepspeed_train.py", "save", root / "ds", "stage2-fp32", "stage3-bf16")
    return {"dcp": root / "fsdp2" / "ckpt", "deepspeed": root / "ds" / "stage2-fp32", "deepspeed3": root / "ds" / "stage3-bf16"}


@pytest.fixture(params=["s3", "az"])
def store(request):
    """The object store a test runs against: S3 on a moto server, Azure Blob on Azurite (conftest's fixtures)."""
    return request.getfixturevalue(request.param)


_uploaded: dict[tuple[str, str], object] = {}  # (store, what) -> its copy there, made once per session


def _once(store, what: str, upload):
    if (store.protocol, what) not in _uploaded:
        _uploaded[store.protocol, what] = upload()
    return _uploaded[store.protocol, what]


@pytest.fixture(scope="session")
def local_sources(mixed_files, tiny_llama, trained) -> dict[str, Path]:
    """Every format, saved locally."""
    _, llama = tiny_llama
    return {
        "safetensors": mixed_files["safetensors"],
        "torch": mixed_files["torch"],
        "hf": mixed_files["hf"],
        "llama": llama / "sharded",
        **trained,
    }


def _sources_in(store, local: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    return _once(store, "sources", lambda: {name: (path, store.upload(path, f"src/{name}/{path.name}")) for name, path in local.items()})


@pytest.fixture
def sources(store, local_sources) -> dict[str, tuple[Path, str]]:
    """Every format, local path and its copy in the store."""
    return _sources_in(store, local_sources)


@pytest.fixture
def s3_sources(s3, local_sources) -> dict[str, tuple[Path, str]]:
    return _sources_in(s3, local_sources)


FORMATS = ["safetensors", "torch", "hf", "llama", "dcp", "deepspeed", "deepspeed3"]


@pytest.mark.parametrize("name", FORMATS)
def test_inspect_matches_the_local_copy(ckpt, sources, name):
    local, url = sources[name]
    for args in ([], ["--json"]):
        on_s3, here = ckpt("inspect", url, *args), ckpt("inspect", local, *args)
        assert on_s3.code == here.code == 0, on_s3.err
        same_but_paths(on_s3.out, url, here.out, local)
    assert json.loads(ckpt("inspect", url, "--json").out)["path"] == url


CHECKSUMMED = {"torch", "dcp", "deepspeed", "deepspeed3"}  # zip records with CRC32s; safetensors files carry none


@pytest.mark.parametrize("name", FORMATS)
def test_verify_deep_passes_then_fails_after_one_flipped_byte(ckpt, store, sources, name):
    local, url = sources[name]
    res = ckpt("verify", "--deep", url)
    assert res.code == 0 and res.out.startswith(f"OK {url} "), res.out + res.err
    copy = store.upload(local, f"flipped/{name}/{local.name}")
    big = max(open_checkpoint(copy).tensors.values(), key=lambda t: t.nbytes)
    where = big.pieces[0].data.path  # the object holding it
    # inside the tensor's bytes where a CRC32 covers them; in the JSON header where nothing does
    offset = big.pieces[0].data.offset + 3 if name in CHECKSUMMED else 8
    key = where.removeprefix(store.url(""))
    data = bytearray(store.get(key))
    data[offset] ^= 0xFF
    store.put(key, bytes(data))
    res = ckpt("verify", "--deep", copy)
    assert res.code == 1, res.out + res.err
    assert where in res.out + res.err


def test_inspect_of_a_large_checkpoint_reads_metadata_only(ckpt, store, large):
    """A 208 MB DCP save (64 tensors in 8 files): inspect and structural verify transfer < 5 MB."""
    local, url = large
    assert sum(len(v) for v in local_files(local).values()) >= 200 << 20
    for command in (["inspect", url], ["verify", url]):
        filesystems.reset_stats()
        res = ckpt(*command)
        moved = filesystems.stats()
        assert res.code == 0, res.out + res.err
        assert 0 < moved.bytes_in < 1 << 20 and moved.requests < 100, (command, moved)  # 64 items: one request per item boundary
    same_but_paths(ckpt("inspect", url).out, url, ckpt("inspect", local).out, local)


def test_detection_asks_about_each_path_once(ckpt, s3_sources, monkeypatch):
    """Format detection probes a path many times (is it a folder? a file?); each answer is a round trip (HEAD, LIST),
    asked once per command. The bucket itself, whose listing may hold any number of keys, is never listed."""
    from ckpt_cli.store import Location

    listed, real = [], Location.iterdir
    monkeypatch.setattr(Location, "iterdir", lambda self: (listed.append(str(self)), real(self))[1])
    for name, most in (("safetensors", 16), ("hf", 16), ("deepspeed", 22)):  # 36 / 14 / 19 when each probe was asked again
        filesystems.reset_stats()
        assert ckpt("inspect", s3_sources[name][1]).code == 0
        assert filesystems.stats().requests <= most, (name, filesystems.stats())
    assert listed and f"s3://{BUCKET}" not in listed, listed


@pytest.fixture(scope="session")
def large_local(tmp_path_factory) -> Path:
    """208 MB saved by dcp.save in one process, its FileSystemWriter spreading the tensors over 8 files."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("s3_large") / "dcp"
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.empty(1024, 832).uniform_(generator=g) for i in range(64)}  # 64 x 3.25 MiB
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(root, thread_count=8), no_dist=True)
    return root


@pytest.fixture
def large(store, large_local) -> tuple[Path, str]:
    return large_local, _once(store, "large", lambda: store.upload(large_local, "large/dcp"))


# ---- writes ---------------------------------------------------------------------------------------------------

WRITES = {  # command, source, destination name
    "merge": (["merge"], "dcp", "merged.safetensors"),
    "convert-hf": (["convert", "--to", "hf", "--num-shards", "3"], "dcp", "hf"),
    "reshard-dcp": (["reshard", "--world-size", "3"], "dcp", "dcp3"),
    "reshard-deepspeed": (["reshard", "--world-size", "3"], "deepspeed", "ds3"),
    "convert-torch": (["convert", "--to", "torch"], "deepspeed3", "full.pt"),
    "split": (["split", "--num-shards", "2"], "llama", "split"),
    "cast": (["convert", "--to", "safetensors", "--dtype", "bf16"], "dcp", "bf16.safetensors"),  # through torch, window by window
}


def same_output(got: dict[str, bytes], want: dict[str, bytes]) -> None:
    """Byte for byte, but DCP's .metadata, which records where it was written (StorageMeta.checkpoint_id)."""
    import pickle

    assert sorted(got) == sorted(want)
    for name in want:
        if name.endswith(".metadata"):
            a, b = pickle.loads(got[name]), pickle.loads(want[name])
            assert a.storage_meta.save_id == b.storage_meta.save_id
            a.storage_meta.checkpoint_id = b.storage_meta.checkpoint_id = None
            assert a == b, name
        else:
            assert got[name] == want[name], name


@pytest.mark.parametrize("mode", ["store-to-store", "store-to-local", "local-to-store"])
@pytest.mark.parametrize("case", sorted(WRITES))
def test_writes_are_byte_identical_to_the_local_run(ckpt, store, sources, tmp_path, case, mode):
    args, source, name = WRITES[case]
    local, url = sources[source]
    want = tmp_path / "local" / name
    assert ckpt(*args, local, want, "--quiet").code == 0
    src = local if mode == "local-to-store" else url
    if mode == "store-to-local":
        dest = tmp_path / "out" / name
        res = ckpt(*args, src, dest)
        got = local_files(dest)
    else:
        key = f"writes/{mode}/{case}/{name}"
        res = ckpt(*args, src, store.url(key))
        got = store.objects(key)
        assert f"wrote {ckpt_format(args, source)} {store.url(key)} " in res.err
        assert not store.uploads(key)
    assert res.code == 0, res.err
    same_output(got, local_files(want))


def _torchrun_ckpt(*args: str) -> subprocess.CompletedProcess:
    cmd = [*torchrun_command(2), "-m", "ckpt_cli", *args, "--quiet"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("case", ["reshard-dcp", "convert-hf", "reshard-deepspeed"])
def test_torchrun_writes_store_to_store_without_a_shared_folder(ckpt, store, sources, tmp_path, case):
    """Two ranks share the uploads, rank 0 uploads the markers last: byte-identical to one local process."""
    args, source, name = WRITES[case]
    local, url = sources[source]
    assert ckpt(*args, local, tmp_path / name, "--quiet").code == 0
    key = f"torchrun/{case}/{name}"
    proc = _torchrun_ckpt(*args, url, store.url(key))
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_output(store.objects(key), local_files(tmp_path / name))
    assert not store.uploads(key)


def test_torchrun_failure_on_one_rank_leaves_nothing(ckpt, store, sources):
    """A flipped byte in one chunk fails the rank that copies it (CRC32): every rank deletes what it completed."""
    local, _ = sources["dcp"]
    url = store.upload(local, "torchrun-damaged/dcp")
    big = max(open_checkpoint(url).tensors.values(), key=lambda t: t.nbytes)
    key = big.pieces[0].data.path.removeprefix(store.url(""))
    data = bytearray(store.get(key))
    data[big.pieces[0].data.offset + 3] ^= 0xFF
    store.put(key, bytes(data))
    proc = _torchrun_ckpt("reshard", url, store.url("torchrun-out/dcp3"), "--world-size", "3")
    assert proc.returncode != 0 and "CRC" in proc.stderr, proc.stderr[-3000:]
    assert not store.keys("torchrun-out/") and not store.uploads("torchrun-out/")


def ckpt_format(args: list[str], source: str) -> str:
    if args[0] == "merge":
        return "safetensors"
    if "--to" in args:
        return args[args.index("--to") + 1]
    return "hf" if args[0] == "split" else {"dcp": "dcp", "deepspeed": "deepspeed"}[source]


# ---- what a write leaves when it does not finish ----------------------------------------------------------------


def test_a_failed_write_leaves_nothing(ckpt, store, large, monkeypatch):
    """A part (S3) or block (Azure) upload that fails midway: the unfinished uploads are dropped, completed objects
    deleted, no marker."""
    backend, size = {"s3": (s3_backend, "PART_BYTES"), "az": (az_backend, "BLOCK_BYTES")}[store.protocol]
    send = "_upload_part"
    monkeypatch.setattr(backend, size, 5 << 20)
    real, calls = getattr(backend.Writer, send), []

    def flaky(self, number, body):
        calls.append(number)
        if len(calls) == 12:
            raise OSError("injected: connection reset")
        return real(self, number, body)

    monkeypatch.setattr(backend.Writer, send, flaky)
    _, url = large
    res = ckpt("convert", url, store.url("failed/hf"), "--to", "hf", "--num-shards", "4", "--workers", "2", "--quiet")
    assert res.code == 1 and "injected" in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1
    assert store.keys("failed/") == [] and store.uploads("failed/") == []


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckpt_cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_write_leaves_no_commit_marker(ckpt, store, large, how):
    """Killed outright, a write leaves data objects (and unfinished uploads) but never the index; verify calls the
    prefix incomplete. SIGTERM is a stop request: uploads aborted, completed objects deleted, exit 143."""
    _, url = large
    key = f"killed/{how}"
    proc = _cli("convert", url, store.url(key), "--to", "hf", "--num-shards", "6", "--workers", "1", "--quiet")
    try:
        _wait_for(lambda: any(k.endswith(".safetensors") for k in store.keys(key + "/")) or proc.poll() is not None)
        assert proc.poll() is None, "the write finished before it could be killed"
        proc.send_signal(getattr(signal, how))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    names = [k.rsplit("/", 1)[-1] for k in store.keys(key + "/")]
    assert "model.safetensors.index.json" not in names
    if how == "SIGTERM":
        assert proc.returncode == 143, err
        assert names == [] and store.uploads(key) == []
        return
    assert names  # a killed process cannot clean up: its data objects stay, without a marker
    res = ckpt("verify", store.url(key))
    assert res.code == 1 and "incomplete Hugging Face checkpoint" in res.out + res.err, res.out + res.err
    res = ckpt("convert", url, store.url(key), "--to", "hf", "--num-shards", "6", "--quiet")
    assert res.code == 2 and "already exists" in res.err
    assert ckpt("convert", url, store.url(key), "--to", "hf", "--num-shards", "6", "--overwrite", "--quiet").code == 0
    assert ckpt("verify", store.url(key)).code == 0
    assert store.uploads(key) == []  # --overwrite aborted what the killed write had in flight


def test_verify_names_an_upload_that_never_completed(ckpt, store, sources):
    local, _ = sources["hf"]
    url = store.upload(local, "stray/hf")
    store.start_unfinished("stray/hf/model-00009-of-00009.safetensors")
    res = ckpt("verify", url)
    unfinished = {"s3": "an upload that never completed", "az": "blocks staged but never committed"}[store.protocol]
    assert res.code == 1 and f"{url}/model-00009-of-00009.safetensors: {unfinished}" in res.out, res.out
    assert ckpt("convert", url, url + "-copy", "--to", "hf", "--quiet").code == 0
    assert ckpt("convert", url + "-copy", url, "--to", "hf", "--overwrite", "--quiet").code == 0
    assert store.uploads("stray/hf/") == [] and ckpt("verify", url).code == 0


def test_incomplete_dcp_and_deepspeed_prefixes(ckpt, store, sources):
    for name, marker in (("dcp", ".metadata"), ("deepspeed", "latest")):
        local, _ = sources[name]
        url = store.upload(local, f"incomplete/{name}")
        store.delete(f"incomplete/{name}/{marker}")  # as if the write had stopped before it
        res = ckpt("verify", url)
        assert res.code == 1 and "incomplete" in res.out + res.err and marker in res.out + res.err, res.out + res.err


def test_overwrite_in_object_storage(ckpt, store, sources, tmp_path):
    local, url = sources["dcp"]
    dest = store.url("overwrite/hf")
    assert ckpt("convert", url, dest, "--to", "hf", "--num-shards", "3", "--quiet").code == 0
    res = ckpt("convert", url, dest, "--to", "hf", "--quiet")
    assert res.code == 2 and "already exists; pass --overwrite" in res.err
    assert ckpt("convert", url, dest, "--to", "hf", "--overwrite", "--quiet").code == 0  # one shard now: stale ones go
    assert ckpt("convert", local, tmp_path / "hf", "--to", "hf", "--quiet").code == 0
    assert store.objects("overwrite/hf") == local_files(tmp_path / "hf")
    res = ckpt("convert", url, store.url("src"), "--to", "hf", "--overwrite")
    assert res.code == 2 and "never replaces what is being read" in res.err
    before = store.keys("src/")
    res = ckpt("convert", url, f"{url}/sub", "--to", "hf")
    assert res.code == 2 and "inside the source" in res.err and store.keys("src/") == before
    store.put("overwrite/notes/readme.txt", b"not a checkpoint")
    res = ckpt("convert", url, store.url("overwrite/notes"), "--to", "hf", "--overwrite")
    assert res.code == 2 and "neither empty nor a checkpoint" in res.err
    assert store.keys("overwrite/notes/") == ["overwrite/notes/readme.txt"]


# ---- errors ---------------------------------------------------------------------------------------------------------


def test_missing_bucket_and_key_are_one_line_usage_errors(ckpt, store):
    for url in (f"{store.protocol}://no-such-bucket/ckpt", store.url("no/such/key.safetensors")):
        for command in ("inspect", "verify"):
            res = ckpt(command, url)
            assert res.code == 2 and res.err == f"ckpt: error: {url}: no such file or folder\n", res.err


def test_credentials_and_endpoint_errors(s3, s3_sources, tmp_path):
    _, url = s3_sources["safetensors"]
    plain = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | ISOLATED
    cases = {
        "no usable credentials": {**plain, "AWS_ENDPOINT_URL": s3.endpoint},
        "cannot reach the object store": {**s3.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "2"},
    }
    for needle, env in cases.items():
        proc = subprocess.run([sys.executable, "-m", "ckpt_cli", "inspect", url], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_azure_credentials_and_endpoint_errors(az, mixed_files):
    """Azure's failures as one line, exit 2: a wrong account key (Azurite checks the signature), an endpoint nobody
    listens on, no credentials at all."""
    url = _once(az, "credentials", lambda: az.upload(mixed_files["safetensors"], "credentials/model.safetensors"))
    plain = {k: v for k, v in os.environ.items() if not k.startswith("AZURE_")}
    wrong_key = az.conn.replace(az_store.KEY, "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo=")
    no_server = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{free_port()}", az.conn)
    cases = {
        "access denied or no usable credentials": {**plain, "AZURE_STORAGE_CONNECTION_STRING": wrong_key},
        "cannot reach the object store": {**plain, "AZURE_STORAGE_CONNECTION_STRING": no_server},
        "unable to connect to account": plain,
    }
    for needle, env in cases.items():
        proc = subprocess.run([sys.executable, "-m", "ckpt_cli", "inspect", url], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert proc.stderr.startswith("ckpt: error: az://") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_wrong_credentials(tmp_path):
    """A server that checks signatures (moto with authentication on): a key it does not know is refused, exit 2."""
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-p", str(port)], env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_for(lambda: _listening(port), 60)
        res = run_subprocess(
            "inspect",
            "s3://ckpt/model.safetensors",
            env={"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "wrong", "AWS_SECRET_ACCESS_KEY": "wrong", **ISOLATED},
        )
        assert res.code == 2 and "access denied" in res.err, res.err
        assert len(res.err.strip().splitlines()) == 1
    finally:
        server.terminate()
        server.wait(30)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---- the other commands, the Python API, transient errors ---------------------------------------------------------


def test_ls_diff_and_the_python_api_in_object_storage(ckpt, store, sources, tmp_path):
    import ckpt_cli

    local, url = sources["hf"]
    root = tmp_path / "run"
    for step in (1, 2):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        for p in local.iterdir():
            (root / f"checkpoint-{step}" / p.name).write_bytes(p.read_bytes())
    remote = store.upload(root, "run")
    on_s3, here = ckpt("ls", remote), ckpt("ls", root)
    assert on_s3.code == here.code == 0 and on_s3.out == here.out, on_s3.err
    res = ckpt("diff", url, local)
    assert res.code == 0, res.out + res.err
    with ckpt_cli.open(url) as remote_ckpt, ckpt_cli.open(local) as local_ckpt:
        for name in local_ckpt.tensors:
            a, b = remote_ckpt.tensor(name), local_ckpt.tensor(name)
            assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


def test_hostile_keys_never_become_paths_outside_the_destination(ckpt, store, run_folders, tmp_path):
    """A Trainer checkpoint on S3 beside keys a listing turns into `..`, `.` and empty names: a convert to a local folder
    writes what it writes from the clean checkpoint, and nothing outside the destination."""
    local = run_folder_checkpoint(run_folders["trainer-plain"])
    url = store.upload(local, "hostile/checkpoint-4")
    stored = []
    for name in ("../../evil.json", "sub/../../../evil.json", "./dot.json", "/empty.json", "../checkpoint-4/x.json"):
        try:
            store.put(f"hostile/checkpoint-4/{name}", b'{"evil": 1}')
            stored.append(name)
        except Exception:  # Azure: a name with dot segments does not survive the request URL (no client can store it)
            assert store.protocol == "az", name
    assert stored and (store.protocol == "az" or len(stored) == 5), stored
    want, got = tmp_path / "clean" / "hf", tmp_path / "a" / "b" / "hf"
    assert ckpt("convert", local, want, "--to", "hf", "--quiet").code == 0
    res = ckpt("convert", url, got, "--to", "hf", "--quiet")
    assert res.code == 0, res.err
    assert local_files(got) == local_files(want)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        [f"clean/hf/{n}" for n in local_files(want)] + [f"a/b/hf/{n}" for n in local_files(want)]
    )


def test_manifests_and_policies_in_object_storage(ckpt, store, sources, tmp_path, monkeypatch):
    """--write-manifest s3://... writes one object (never a local folder named 's3:'), --manifest and --policy read
    objects, and --overwrite replaces only a previous manifest, as locally."""
    monkeypatch.chdir(tmp_path)
    _, url = sources["safetensors"]
    manifest = store.url("manifests/mixed.json")
    res = ckpt("verify", url, "--write-manifest", manifest)
    assert res.code == 0 and f"wrote manifest {manifest};" in res.out, res.out + res.err
    assert json.loads(store.get("manifests/mixed.json"))["ckpt_manifest"] == 2 and not list(tmp_path.iterdir())
    again = ckpt("verify", url, "--write-manifest", manifest)
    assert again.err == f"ckpt: error: {manifest} already exists; pass --overwrite to replace it\n"
    assert "is not a ckpt manifest" in ckpt("verify", url, "--write-manifest", url, "--overwrite").err
    assert ckpt("verify", url, "--write-manifest", manifest, "--overwrite").code == 0
    res = ckpt("verify", url, "--manifest", manifest)
    assert res.code == 0 and "manifest;" in res.out, res.out + res.err
    missing = store.url("manifests/none.json")
    assert ckpt("verify", url, "--manifest", missing).err == f"ckpt: error: {missing}: manifest not found\n"
    store.put("manifests/policy.yaml", b"min_params: 1000000000\n")
    res = ckpt("verify", url, "--policy", store.url("manifests/policy.yaml"))
    assert res.code == 1 and "min_params" in res.out + res.err, res.out + res.err
    assert not list(tmp_path.iterdir())


def test_name_maps_and_deepspeed_configs_in_object_storage(ckpt, store, sources, tmp_path):
    """--name-map and --ds-config name objects as well as local files."""
    from ckpt_cli.formats.deepspeed.template import read_config

    local, url = sources["safetensors"]
    rules = b"rename:\n  - {from: '^(.*)$', to: 'model.\\1'}\n"
    (tmp_path / "map.yaml").write_bytes(rules)
    store.put("maps/map.yaml", rules)
    args = ["convert", "--to", "hf", "--quiet"]
    assert ckpt(*args, local, tmp_path / "want", "--name-map", tmp_path / "map.yaml").code == 0
    res = ckpt(*args, url, tmp_path / "got", "--name-map", store.url("maps/map.yaml"))
    assert res.code == 0, res.err
    assert local_files(tmp_path / "got") == local_files(tmp_path / "want")
    assert any(b"model." in data for data in local_files(tmp_path / "got").values())
    store.put("maps/ds.json", b'{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}')
    assert read_config(Path(store.url("maps/ds.json")))["zero_optimization"] == {"stage": 2}
    res = ckpt(*args, url, tmp_path / "none", "--name-map", store.url("maps/none.yaml"))
    assert res.code == 2 and res.err.startswith(f"ckpt: error: {store.url('maps/none.yaml')}: cannot read the name map"), res.err


def test_throttling_is_retried_with_backoff(ckpt, s3, s3_sources, tmp_path, monkeypatch):
    """Every fourth request refused with 503 SlowDown: reads and a multipart write still succeed, byte-identical."""
    from safetensors.torch import save_file

    _, url = s3_sources["dcp"]
    g = torch.Generator().manual_seed(1)
    save_file({"a": torch.randn(1 << 20, generator=g), "b": torch.randn(3, 1 << 20, generator=g)}, tmp_path / "w.safetensors")
    big = s3.upload(tmp_path / "w.safetensors", "throttled/w.safetensors")  # 16 MiB: four parts of 5 MiB (the last smaller)
    flaky = Flaky(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", flaky.url)
    monkeypatch.setattr(s3_backend, "PART_BYTES", 5 << 20)
    try:
        assert ckpt("verify", "--deep", url).code == 0
        res = ckpt("convert", big, s3.url("throttled/copy.pt"), "--to", "torch", "--quiet")
        assert res.code == 0, res.err
    finally:
        flaky.server.shutdown()
    assert flaky.refused > 5
    assert ckpt("convert", tmp_path / "w.safetensors", tmp_path / "copy.pt", "--to", "torch", "--quiet").code == 0
    assert s3.objects("throttled/copy.pt") == local_files(tmp_path / "copy.pt")


def test_throttling_that_outlasts_the_retries_is_one_line(ckpt, s3, s3_sources, tmp_path, monkeypatch):
    """A store that answers every request with 503 SlowDown: after the retries, one line naming the object, exit 1,
    and a write leaves nothing behind."""
    _, url = s3_sources["safetensors"]
    flaky = Flaky(s3.endpoint, every=1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", flaky.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setattr(s3_backend, "RETRIES", 1)
    try:
        res = ckpt("inspect", url)
        assert res.code == 1 and res.err.startswith(f"ckpt: error: {url}") and "throttling requests (503 SlowDown)" in res.err, res.err
        assert len(res.err.strip().splitlines()) == 1, res.err
        res = ckpt("convert", s3_sources["safetensors"][0], s3.url("throttled-out/copy.pt"), "--to", "torch", "--quiet")
        assert res.code == 1 and len(res.err.strip().splitlines()) == 1, res.err
    finally:
        flaky.server.shutdown()
    assert flaky.refused > 2
    assert not s3.keys("throttled-out/") and not s3.uploads("throttled-out/")


def test_other_fsspec_protocols_read(ckpt, s3_sources):
    """Reads go through fsspec: the same checkpoints in its in-memory filesystem (memory://) read as the local copies."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in ("torch", "hf", "dcp", "deepspeed"):
        local, _ = s3_sources[name]
        url = f"memory://ckpt-test/{name}/{local.name}"
        fs.put(str(local), url, recursive=local.is_dir())
        on_memory, here = ckpt("inspect", url), ckpt("inspect", local)
        assert on_memory.code == 0, on_memory.err
        same_but_paths(on_memory.out, url, here.out, local)
        assert ckpt("verify", "--deep", url).code == 0


def test_the_readme_test_command_finds_azurite(monkeypatch):
    """The README's test command runs the az:// tests with nothing set: Azurite comes from npm through the suite itself."""
    import shutil

    from conftest import NO_AZURITE, azurite_command

    monkeypatch.delenv("CKPT_AZURITE", raising=False)
    if shutil.which("npm") is None:
        pytest.skip(NO_AZURITE)
    found = azurite_command()
    assert found is not None and os.access(found, os.X_OK)
