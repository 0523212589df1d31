"""Store backends behind one typed Protocol (store/backend.py), no server needed: every backend of store/clients.py's
BACKENDS (and the fsspec fallback) is an ObjectBackend, local storage (store/local.py's LOCAL) a Backend; each method
takes the protocol's parameters; `ckpt_cli.store` finds a path's backend once (`backend_of`) and every public function
dispatches through it, with no `is_remote` branch left (13 before); and a new store is one class plus a row in
BACKENDS (a store over fsspec's memory filesystem, written and read through `ckpt_cli.store` alone).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt_cli import store
from ckpt_cli.errors import UsageError
from ckpt_cli.store import clients
from ckpt_cli.store.backend import Backend, ObjectBackend
from ckpt_cli.store.local import LOCAL, Local
from ckpt_cli.store.location import Location
from ckpt_cli.store.objects import ObjectStore

INIT = Path(store.__file__)


def _members(protocol: type) -> list[str]:
    """The members a protocol declares (its own and those of the protocols it extends)."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls is object or cls.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return sorted(names)


def _classes() -> dict[str, type]:
    named = {*clients.BACKENDS.values(), clients.ANY}
    found = {}
    for name in sorted(named):
        module, _, cls = name.partition(":")
        found[name] = getattr(importlib.import_module(module), cls)
    return found


@pytest.mark.parametrize("name", sorted({*clients.BACKENDS.values(), clients.ANY}))
def test_every_object_store_is_an_object_backend(name):
    cls = _classes()[name]
    made = cls()
    assert isinstance(made, ObjectBackend) and isinstance(made, Backend)
    missing = [m for m in _members(ObjectBackend) if not hasattr(made, m)]
    assert not missing, missing
    assert made.mappable is False and made.renames is False
    assert isinstance(made.INSTALL_HINT, str) and made.INSTALL_HINT and isinstance(made.CREDENTIALS, str) and made.CREDENTIALS
    assert isinstance(made.ENVIRONMENT, tuple) and all(isinstance(v, str) for v in made.ENVIRONMENT)
    if made.Writer is not None:  # a store ckpt writes to says how a killed write reads
        assert made.UNFINISHED


def test_local_storage_is_a_backend_and_no_object_store():
    assert isinstance(LOCAL, Local) and isinstance(LOCAL, Backend)
    assert not isinstance(LOCAL, ObjectBackend)  # no client, no object writer: only the Backend half
    missing = [m for m in _members(Backend) if not hasattr(LOCAL, m)]
    assert not missing, missing
    assert LOCAL.mappable is True and LOCAL.renames is True


@pytest.mark.parametrize("backend", [LOCAL, *(cls() for cls in _classes().values())], ids=lambda b: type(b).__name__)
def test_each_method_takes_the_protocols_parameters(backend):
    protocol = ObjectBackend if isinstance(backend, ObjectBackend) else Backend
    for name in _members(protocol):
        declared = inspect.getattr_static(protocol, name, None)
        if not callable(declared) or isinstance(declared, property):
            continue
        want = list(inspect.signature(declared).parameters)[1:]
        got = list(inspect.signature(getattr(backend, name)).parameters)
        assert got == want, (type(backend).__name__, name, got, want)


@pytest.mark.parametrize(
    ("path", "cls"),
    [
        ("/tmp/ckpt", "Local"),
        ("relative/ckpt.safetensors", "Local"),
        (Path("/tmp/x"), "Local"),
        ("s3://bucket/key", "S3"),
        (Path("s3://bucket/key"), "S3"),  # what argument parsing makes of a URL: s3:/bucket/key
        ("s3a://bucket/key", "S3"),
        ("az://container/key", "Azure"),
        ("abfs://container/key", "Azure"),
        ("abfss://container/key", "Azure"),
        ("gs://bucket/key", "AnyFsspec"),
        ("memory://bucket/key", "AnyFsspec"),
    ],
)
def test_backend_of_finds_the_backend_once(path, cls):
    found = store.backend_of(path)
    assert type(found).__name__ == cls
    assert store.backend_of(path) is found  # one instance per backend class
    assert store.mappable(path) is found.mappable and store.renames(path) is found.renames


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_store_init_dispatches_once_with_no_is_remote_branch():
    """store/__init__.py had 13 `is_remote` checks (local storage their else-branch); it has none, asks for a protocol
    in `backend_of` only, and each public function about a path is one call through `backend_of`."""
    source = INIT.read_text()
    tree = ast.parse(source)
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert "is_remote" not in names
    functions = _functions(tree)
    asking = [name for name, fn in functions.items() for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == "protocol_of"]
    assert asking == ["backend_of"]
    dispatched = {"mappable", "renames", "is_bucket", "size", "exists", "lexists", "present", "open_read", "check_writable"}
    dispatched |= {"begin", "join", "put", "unfinished", "files_under", "tensorstore_kvstore"}
    for name in sorted(dispatched):
        fn = functions[name]
        assert name in store.__all__
        branches = [n for n in ast.walk(fn) if isinstance(n, (ast.If, ast.IfExp, ast.Match))]
        assert not branches, f"{name} branches: {ast.unparse(branches[0])}"
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "backend_of"]
        assert len(calls) == 1, name
    # every function the Backend protocol declares is dispatched by the function of that name
    assert {m for m in _members(Backend)} - {"mappable", "renames"} <= dispatched


# ---- a new store: one class and a row in BACKENDS ---------------------------------------------------------


class BufferWriter:
    """One object buffered and put whole on commit (a real store sends parts: store/parts.py's PartWriter)."""

    fd = None

    def __init__(self, path: Location, total: int, progress: Callable[[int], None] | None = None) -> None:
        self.path, self.buffer = path, io.BytesIO()

    def write(self, data: object) -> None:
        self.buffer.write(memoryview(data).cast("B"))  # type: ignore[arg-type]

    def commit(self) -> None:
        self.path.fs.pipe_file(self.path.key, self.buffer.getvalue())

    def abort(self) -> None:
        self.buffer = io.BytesIO()


class Folder(ObjectStore):
    """Buckets as folders under `ROOT` (fsspec's DirFileSystem over the local one)."""

    ROOT = ""
    INSTALL_HINT = "fsspec"
    CREDENTIALS = "the folder's permissions"
    UNFINISHED = "never finished"
    Writer = BufferWriter

    def make(self, protocol: str) -> object:
        dirfs = pytest.importorskip("fsspec.implementations.dirfs")
        from fsspec.implementations.local import LocalFileSystem

        return dirfs.DirFileSystem(path=self.ROOT, fs=LocalFileSystem(auto_mkdir=True))

    def check_key(self, path: Location) -> None:
        if len(path.parts) < 3:
            raise UsageError(f"{path}: a destination needs a key")


def test_a_new_store_is_one_class_and_a_row(monkeypatch, tmp_path):
    """A store of folders, given as one class and one row, written and read through the store's functions. URLs as
    strings: Path's `mem:/b` spelling is known only for the rows BACKENDS had at import (store/location.py)."""
    monkeypatch.setitem(clients.BACKENDS, "mem", f"{__name__}:Folder")
    monkeypatch.setattr(Folder, "ROOT", str(tmp_path))
    monkeypatch.setattr(clients, "_backends", {})
    monkeypatch.setattr(clients, "_filesystems", {})
    assert isinstance(store.backend_of("mem://b/k"), Folder) and isinstance(store.backend_of("mem://b/k"), ObjectBackend)
    one, ckpt, member = "mem://b/one.bin", "mem://b/ckpt", "mem://b/ckpt/model.bin"
    with pytest.raises(UsageError, match="needs a key"):
        store.check_writable("mem://b")
    try:
        store.put(one, b"0123456789")
        assert store.exists(one) and store.lexists(one) and store.present(one)
        assert store.size(one) == 10 and store.is_bucket("mem://b") and not store.is_bucket(one)
        with store.open_read(one) as f:
            assert f.read() == b"0123456789"
        write = store.begin(ckpt, is_dir=True, overwrite=False, guard=store.Guard())
        out = write.create(member, 3)
        out.write(b"abc")
        out.commit()
        write.sync()
        write.commit()
        store.fresh()
        assert store.size(member) == 3 and not store.mappable(member) and not store.renames(member)
        with pytest.raises(UsageError, match="already exists"):
            store.begin(ckpt, is_dir=True, overwrite=False, guard=store.Guard())
        replace = store.Guard(is_checkpoint=lambda path: True)
        store.begin(ckpt, is_dir=True, overwrite=True, guard=replace).abort()  # --overwrite cleared the old
        store.fresh()
        assert not store.exists(member)
        assert store.unfinished(ckpt) == []
        assert (tmp_path / "b" / "one.bin").read_bytes() == b"0123456789"
    finally:
        store.fresh()
