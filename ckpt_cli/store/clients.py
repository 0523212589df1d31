"""The clients behind object-storage locations: one per protocol and environment, made by the protocol's backend
(the BACKENDS table, imported when first used), with its failures worded as one line and a count of every request
and byte.

A backend (store/s3.py's S3, store/azure.py's Azure, store/fsspec_any.py's AnyFsspec) is one class implementing the
`ObjectBackend` protocol (store/backend.py). What this module asks of it is the `Client` half declared here: which
environment variables configure it (`ENVIRONMENT`: a change gets a new client), how to make its fsspec filesystem
(`make`), and how its errors read (`CREDENTIALS`, `INSTALL_HINT`, `translate`). The rest (its object writer, the
destination rule, unfinished writes) is what store/objects.py's ObjectStore asks. Local storage is the one backend
that is not here (store/local.py's LOCAL).
"""

from __future__ import annotations

import errno
import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from ckpt_cli.errors import DataError, UsageError

# protocol -> "module:class" of its backend; any other fsspec protocol is read through store/fsspec_any.py
BACKENDS = {
    "s3": "ckpt_cli.store.s3:S3",
    "s3a": "ckpt_cli.store.s3:S3",
    "az": "ckpt_cli.store.azure:Azure",
    "abfs": "ckpt_cli.store.azure:Azure",
    "abfss": "ckpt_cli.store.azure:Azure",
}
ANY = "ckpt_cli.store.fsspec_any:AnyFsspec"
T = TypeVar("T")


@runtime_checkable
class Client(Protocol):
    """What an object store's backend says about its client (the part of store/backend.py's ObjectBackend that this
    module uses; declared here, below location.py, which makes filesystems through `filesystem`)."""

    INSTALL_HINT: str  # what to install for the protocol (a missing client library)
    CREDENTIALS: str  # what to check when access is denied
    ENVIRONMENT: tuple[str, ...]  # the variables that configure the client: a change gets a new one

    def make(self, protocol: str) -> Any:
        """The fsspec filesystem for `protocol`, from the environment (UsageError where it cannot be made)."""
        ...

    def translate(self, exc: BaseException, where: object) -> Exception | None:
        """The one-line error for a failure this store knows (credentials, endpoint, throttling); None otherwise."""
        ...


_backends: dict[str, Client] = {}  # "module:class" -> its one instance


def backend(protocol: str) -> Client:
    """The backend of an object-storage protocol (its module imported, and the backend made, when first asked)."""
    name = BACKENDS.get(protocol, ANY)
    found = _backends.get(name)
    if found is None:
        module, _, cls = name.partition(":")
        found = _backends.setdefault(name, getattr(importlib.import_module(module), cls)())
    return found


def call(where: object, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args)` against the store, its failures as one line naming `where`: a missing object is a
    FileNotFoundError (callers word it as for a local file), bad or missing credentials and an unreachable
    endpoint are UsageError (exit 2), anything else left after the retries a DataError (exit 1)."""
    try:
        return fn(*args, **kwargs)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(where)) from None
    except PermissionError as exc:
        hint = backend(_protocol(where)).CREDENTIALS
        raise UsageError(f"{where}: access denied ({reason(exc)}); check {hint}") from None
    except (UsageError, DataError):
        raise
    except Exception as exc:
        raise translate(exc, where) from None


def translate(exc: BaseException, where: object) -> Exception:
    """The one-line error for a failed request: the backend's words where it knows the failure, else a DataError."""
    store = backend(_protocol(where))
    known = store.translate(exc, where)
    if known is not None:
        return known
    if isinstance(exc, ImportError):
        return UsageError(f"{where}: {_protocol(where)}:// needs {store.INSTALL_HINT} ({exc})")
    return DataError(f"{where}: object store request failed after retries ({type(exc).__name__}: {reason(exc)})")


def _protocol(where: object) -> str:
    return str(where).split(":", 1)[0]


def reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def names_of(exc: BaseException) -> set[str]:
    """The class names of an exception and of what caused it (a backend's errors arrive wrapped)."""
    return {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}


# ---- clients and request counts -----------------------------------------------------------------------------


@dataclass
class Stats:
    requests: int = 0
    bytes_in: int = 0  # response bodies (a GET's bytes; HEAD responses carry none)
    bytes_out: int = 0  # request bodies uploaded (parts, blocks, small objects)
    bytes_copied: int = 0  # bytes the store copied on its side (never through this process: store/parts.py)


_stats = Stats()
_stats_lock = threading.Lock()
_fs_lock = threading.Lock()
_filesystems: dict[tuple[Any, ...], Any] = {}


def stats() -> Stats:
    with _stats_lock:
        return Stats(_stats.requests, _stats.bytes_in, _stats.bytes_out, _stats.bytes_copied)


def reset_stats() -> None:
    with _stats_lock:
        _stats.requests = _stats.bytes_in = _stats.bytes_out = _stats.bytes_copied = 0


def count_request(bytes_in: int) -> None:
    with _stats_lock:
        _stats.requests += 1
        _stats.bytes_in += bytes_in


def count_sent(nbytes: int) -> None:
    with _stats_lock:
        _stats.bytes_out += nbytes


def count_copied(nbytes: int) -> None:
    with _stats_lock:
        _stats.bytes_copied += nbytes


def filesystem(protocol: str) -> Any:
    """The fsspec filesystem for `protocol`, one per protocol and environment (a changed endpoint or key gets a new one)."""
    store = backend(protocol)
    key = (protocol, *(os.environ.get(k) for k in store.ENVIRONMENT))
    with _fs_lock:
        if key not in _filesystems:
            _return_large_buffers()
            _filesystems[key] = store.make(protocol)
        return _filesystems[key]


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_BYTES = 1 << 20


def _return_large_buffers() -> None:
    """Have glibc map each buffer of MMAP_BYTES or more on its own and unmap it when freed. Reads and writes in object
    storage pass through thousands of short-lived 4-16 MiB buffers on 32 threads; under glibc's default the threshold
    rises to the largest buffer freed, they are then carved from the threads' heaps, and the process keeps the peak
    of them all (S3 dcp -> hf of 1 GB: 592 MB peak RSS; 407 MB with a fixed threshold). Elsewhere (no glibc) nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)
    except (OSError, AttributeError):
        pass


def made() -> list[Any]:
    """The filesystems made so far (to drop their cached listings)."""
    with _fs_lock:
        return list(_filesystems.values())
