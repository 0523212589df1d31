"""Checkpoints on object storage (`s3://bucket/prefix`, or another fsspec URL): locations, listings, ranged reads.

A remote location is a `RemotePath`: a PurePosixPath whose first part is the protocol (`s3:`), so format modules
keep using `/`, `.name`, `.suffix`, `.parent` and the few filesystem calls they make (`is_dir`, `iterdir`, `glob`,
`stat`, `exists`, `open`), and `str()` gives the URL back. `Path("s3://b/k")` (what argument parsing makes of a
URL: `s3:/b/k`) is the same location; `location()` turns either into a RemotePath, never into a local path.

Reads are ranged GETs through fsspec (s3fs for s3://; credentials, region and endpoint from the standard AWS
configuration, AWS_ENDPOINT_URL included). Metadata parses read through `RemoteFile`: small reads fetch one
aligned BLOCK and keep it, larger ones fetch exactly the bytes asked for, and `prefetch` fetches a list of
ranges in parallel (zip local headers); the cache is shared by the handles of one command and dropped by
`fresh()`. Tensor data is read exactly (`read_into`) and never cached. `stats()` counts every request and the
bytes each response carried, so what `inspect` transfers can be measured.
"""

from __future__ import annotations

import bisect
import errno
import fnmatch
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, TypeVar

from ckpt_cli.errors import DataError, UsageError

PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory")  # recognised in Path's `s3:/b/k` form
BLOCK = 8 << 10  # a small read fetches this aligned block (zip directories, pickles and headers sit in one or two)
SPAN_LIMIT = 1 << 20  # exact reads up to this size are kept too (a header read, then parsed from a second handle)
CACHE_BYTES = 64 << 20
MERGE_GAP = 4 << 10  # prefetched ranges closer than this are fetched as one
RETRIES = 5  # s3fs's own retries of transient errors, on top of botocore's (standard mode, MAX_ATTEMPTS)
MAX_ATTEMPTS = 8
INSTALL_HINT = "pip install 'ckpt-tools[s3]'"
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://")
# a change of any of these gets a new filesystem (tests and the Python API may change them in one process)
_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
_ENV += ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")
_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionError", "InvalidEndpointError"}
T = TypeVar("T")


def protocol_of(path: object) -> str | None:
    """The protocol of a remote location (`s3://b/k`, or `s3:/b/k` as Path spells it); None for a local path."""
    if isinstance(path, RemotePath):
        return path.protocol
    text = os.fspath(path) if isinstance(path, PurePath) else str(path)
    match = _URL.match(text)
    if match:
        return match.group(1)
    head, sep, _ = text.partition(":/")
    return head if sep and head in PROTOCOLS else None


def is_remote(path: object) -> bool:
    return protocol_of(path) is not None


def location(path: str | os.PathLike[str]) -> Path:
    """A RemotePath for a URL (or Path's spelling of one), else the local Path."""
    if isinstance(path, RemotePath):
        return path
    protocol = protocol_of(path)
    if protocol is None:
        return path if isinstance(path, Path) else Path(path)
    rest = [p for p in str(path).split(":", 1)[1].split("/") if p]
    if not rest:
        raise UsageError(f"{protocol}://: names no bucket")
    return RemotePath(f"{protocol}:", *rest)  # type: ignore[return-value]


@dataclass(frozen=True)
class RemoteStat:
    st_size: int
    st_mtime_ns: int
    st_mode: int

    @property
    def st_mtime(self) -> float:
        return self.st_mtime_ns / 1e9


class RemotePath(PurePosixPath):
    """`s3://bucket/key` as a path (parts `s3:`, `bucket`, `key`...) with the filesystem calls readers make."""

    __slots__ = ()

    def __str__(self) -> str:
        if not self.parts or not self.parts[0].endswith(":"):  # relative_to() gives a plain relative path
            return "/".join(self.parts) or "."
        head, *rest = self.parts
        return f"{head}//{'/'.join(rest)}"

    @property
    def parents(self) -> tuple[RemotePath, ...]:  # type: ignore[override]
        """The prefixes above, up to the bucket (`s3://` itself is no location)."""
        return tuple(RemotePath(*self.parts[:n]) for n in range(len(self.parts) - 1, 1, -1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    @property
    def protocol(self) -> str:
        return self.parts[0][:-1]

    @property
    def key(self) -> str:
        """The fsspec path: `bucket/key`."""
        return "/".join(self.parts[1:])

    @property
    def fs(self) -> Any:
        return filesystem(self.protocol)

    def stat(self, *, follow_symlinks: bool = True) -> RemoteStat:
        info = call(self, self.fs.info, self.key)
        when = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
        ns = int(when.timestamp() * 1e9) if hasattr(when, "timestamp") else int(float(when or 0) * 1e9)
        kind = stat.S_IFDIR if info.get("type") == "directory" else stat.S_IFREG
        return RemoteStat(int(info.get("size") or 0), ns, kind | 0o644)

    lstat = stat

    def exists(self, *, follow_symlinks: bool = True) -> bool:
        return len(self.parts) > 1 and call(self, self.fs.exists, self.key)

    def is_dir(self) -> bool:
        return len(self.parts) > 1 and call(self, self.fs.isdir, self.key)

    def is_file(self) -> bool:
        return len(self.parts) > 2 and call(self, self.fs.isfile, self.key)

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[RemotePath]:
        if len(self.parts) < 2:
            raise NotADirectoryError(errno.ENOTDIR, "not a bucket or prefix", str(self))
        for entry in call(self, self.fs.ls, self.key, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name and entry.rstrip("/") != self.key:
                yield self / name

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        if "/" in pattern or "**" in pattern:
            yield from (location(f"{self.protocol}://{p}") for p in call(self, self.fs.glob, f"{self.key}/{pattern}"))  # type: ignore[misc]
            return
        yield from (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def rglob(self, pattern: str) -> Iterator[RemotePath]:
        for found in call(self, self.fs.find, self.key, withdirs=True):
            path = location(f"{self.protocol}://{found}")
            if found != self.key and fnmatch.fnmatchcase(path.name, pattern):
                yield path  # type: ignore[misc]

    def resolve(self, strict: bool = False) -> RemotePath:
        return self

    def absolute(self) -> RemotePath:
        return self

    def expanduser(self) -> RemotePath:
        return self

    def mkdir(self, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: object stores have no folders, a prefix exists once an object is under it."""

    def open(self, mode: str = "rb", *args: Any, **kwargs: Any) -> RemoteFile:
        if mode != "rb":
            raise UsageError(f"{self}: objects are opened for reading here; writes go through core/remote_write.py")
        return RemoteFile(self)

    def read_bytes(self) -> bytes:
        with self.open() as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)


# ---- errors ------------------------------------------------------------------------------------------------


def call(where: object, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args)` against the store, its failures as one line naming `where`: a missing object is a
    FileNotFoundError (callers word it as for a local file), bad or missing credentials and an unreachable
    endpoint are UsageError (exit 2), anything else left after the retries a DataError (exit 1)."""
    try:
        return fn(*args, **kwargs)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(where)) from None
    except PermissionError as exc:
        raise UsageError(
            f"{where}: access denied ({_reason(exc)}); check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the bucket policy"
        ) from None
    except (UsageError, DataError):
        raise
    except Exception as exc:
        raise translate(exc, where) from None


def translate(exc: BaseException, where: object) -> Exception:
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    if names & _CREDENTIALS:
        return UsageError(f"{where}: no usable credentials ({_reason(exc)}); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
    if names & _UNREACHABLE:
        return UsageError(f"{where}: cannot reach the object store ({_reason(exc)}); check AWS_ENDPOINT_URL and the network")
    if isinstance(exc, ImportError):
        return UsageError(f"{where}: object storage needs the s3 extra: {INSTALL_HINT} ({exc})")
    return DataError(f"{where}: object store request failed after retries ({type(exc).__name__}: {_reason(exc)})")


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


# ---- filesystems and request counts -------------------------------------------------------------------------


@dataclass
class Stats:
    requests: int = 0
    bytes_in: int = 0  # response bodies (a GET's bytes; HEAD responses carry none)
    bytes_out: int = 0  # request bodies uploaded (parts, small objects)


_stats = Stats()
_stats_lock = threading.Lock()
_fs_lock = threading.Lock()
_filesystems: dict[tuple[Any, ...], Any] = {}


def stats() -> Stats:
    with _stats_lock:
        return Stats(_stats.requests, _stats.bytes_in, _stats.bytes_out)


def reset_stats() -> None:
    with _stats_lock:
        _stats.requests = _stats.bytes_in = _stats.bytes_out = 0


def count_sent(nbytes: int) -> None:
    with _stats_lock:
        _stats.bytes_out += nbytes


def _after_call(http_response: Any = None, model: Any = None, **_: Any) -> None:
    length = 0
    if http_response is not None and not getattr(model, "name", "").startswith("Head"):
        length = int(http_response.headers.get("content-length") or 0)
    with _stats_lock:
        _stats.requests += 1
        _stats.bytes_in += length


def filesystem(protocol: str) -> Any:
    """The fsspec filesystem for `protocol`, one per protocol and AWS environment (a changed endpoint or key gets a new one)."""
    key = (protocol, *(os.environ.get(k) for k in _ENV))
    with _fs_lock:
        if key not in _filesystems:
            _filesystems[key] = _make(protocol)
        return _filesystems[key]


def _make(protocol: str) -> Any:
    if protocol in ("s3", "s3a"):
        try:
            import s3fs
        except ImportError:
            raise UsageError(f"{protocol}:// needs the s3 extra: {INSTALL_HINT}") from None
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            config_kwargs={"retries": retry_policy(), "max_pool_connections": 64},
        )
        fs.retries = RETRIES  # a class attribute in s3fs: attempts of its own retry loop (throttling, 5xx, timeouts)
        try:
            fs.connect()
            fs.s3.meta.events.register("after-call.s3", _after_call)
        except Exception as exc:
            raise translate(exc, f"{protocol}://") from None
        return fs
    try:
        import fsspec

        return fsspec.filesystem(protocol, skip_instance_cache=True)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"{protocol}://: no filesystem for this protocol ({exc})") from None


def retry_policy() -> dict[str, Any]:
    """botocore's retries of throttling, 5xx and connection errors, with exponential backoff and jitter: standard
    mode, MAX_ATTEMPTS attempts, unless AWS_RETRY_MODE / AWS_MAX_ATTEMPTS say otherwise (an explicit Config would
    override them). Adaptive mode also slows the client down under sustained throttling, to a crawl when a store
    refuses a steady share of requests; it is there for those who want it (AWS_RETRY_MODE=adaptive)."""
    attempts = os.environ.get("AWS_MAX_ATTEMPTS", "")
    return {"mode": os.environ.get("AWS_RETRY_MODE") or "standard", "max_attempts": int(attempts) if attempts.isdigit() else MAX_ATTEMPTS}


def fresh() -> None:
    """Forget cached listings and blocks: a new command sees the store as it is now."""
    _cache.clear()
    with _fs_lock:
        filesystems = list(_filesystems.values())
    for fs in filesystems:
        fs.invalidate_cache()


def forget(path: RemotePath) -> None:
    """Forget what is cached about `path` (it was just written or deleted)."""
    path.fs.invalidate_cache(path.key)
    _cache.drop(str(path))


# ---- reads --------------------------------------------------------------------------------------------------


class _Cache:
    """Byte spans of objects (url -> sorted spans), at most CACHE_BYTES in all, the oldest objects dropped first."""

    def __init__(self) -> None:
        self._spans: OrderedDict[str, list[tuple[int, bytes]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, url: str, pos: int, n: int) -> bytes | None:
        with self._lock:
            spans = self._spans.get(url)
            if not spans:
                return None
            i = bisect.bisect_right(spans, pos, key=lambda s: s[0]) - 1
            for start, data in reversed(spans[max(0, i - 3) : i + 1]):
                if start <= pos and pos + n <= start + len(data):
                    return data[pos - start : pos - start + n]
        return None

    def put(self, url: str, start: int, data: bytes) -> None:
        with self._lock:
            spans = self._spans.setdefault(url, [])
            self._spans.move_to_end(url)
            bisect.insort(spans, (start, data), key=lambda s: s[0])
            self._bytes += len(data)
            while self._bytes > CACHE_BYTES and len(self._spans) > 1:
                _, dropped = self._spans.popitem(last=False)
                self._bytes -= sum(len(d) for _, d in dropped)

    def drop(self, url: str) -> None:
        with self._lock:
            self._bytes -= sum(len(d) for _, d in self._spans.pop(url, []))

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._bytes = 0


_cache = _Cache()


def size(path: str | os.PathLike[str]) -> int:
    """The size of a file or object (OSError when missing, as os.path.getsize)."""
    if not is_remote(path):
        return os.path.getsize(path)
    return location(path).stat().st_size


def exists(path: str | os.PathLike[str]) -> bool:
    return location(path).exists() if is_remote(path) else os.path.exists(path)


def fetch(path: RemotePath, start: int, end: int) -> bytes:
    """Bytes [start, end) of an object: one ranged GET (DataError if the object ends first)."""
    data = call(path, path.fs.cat_file, path.key, start=start, end=end)
    if len(data) != end - start:
        raise DataError(f"{path}: truncated: expected {end - start} bytes at offset {start}, the object ends first")
    return data


def read_into(url: str, offset: int, view: memoryview) -> None:
    """Fill `view` with bytes of the object from `offset` (one ranged GET, not cached); DataError if it ends first."""
    path = location(url)
    total = path.stat().st_size  # type: ignore[attr-defined]
    if offset + len(view) > total:
        raise DataError(f"{url}: truncated: expected {len(view)} bytes at offset {offset}, file ends first")
    if len(view):
        view[:] = fetch(path, offset, offset + len(view))  # type: ignore[arg-type]


def prefetch_heads(paths: list[Any], nbytes: int = BLOCK) -> None:
    """The first `nbytes` of each object, in one parallel round (the headers of many files: hf shards); local
    paths and objects not found are passed over (reading them reports it)."""
    remote = [location(p) for p in paths if is_remote(p)]
    by_fs: dict[int, list[RemotePath]] = {}
    for path in remote:
        by_fs.setdefault(id(path.fs), []).append(path)  # type: ignore[arg-type]
    for group in by_fs.values():
        if len(group) < 2:
            continue
        fs = group[0].fs
        got = call(group[0], fs.cat_ranges, [p.key for p in group], [0] * len(group), [nbytes] * len(group), on_error="return")
        for path, data in zip(group, got):
            if isinstance(data, bytes):
                _cache.put(str(path), 0, data)


class RemoteFile:
    """A read-only, seekable file object over one object; reads go through the shared block cache."""

    def __init__(self, path: RemotePath) -> None:
        info = call(path, path.fs.info, path.key)
        if info.get("type") == "directory":
            raise IsADirectoryError(errno.EISDIR, "Is a prefix, not an object", str(path))
        self.path, self.name, self.size = path, str(path), int(info["size"])
        self.pos, self.closed = 0, False

    def read(self, n: int | None = -1) -> bytes:
        left = max(self.size - self.pos, 0)
        n = left if n is None or n < 0 else min(n, left)
        data = self.read_at(self.pos, n)
        self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer).cast("B")))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def read_at(self, pos: int, n: int) -> bytes:
        if n <= 0:
            return b""
        hit = _cache.get(self.name, pos, n)
        if hit is not None:
            return hit
        if n >= BLOCK:
            data = fetch(self.path, pos, pos + n)
            if n <= SPAN_LIMIT:
                _cache.put(self.name, pos, data)
            return data
        start = pos - pos % BLOCK
        end = min(self.size, -(-(pos + n) // BLOCK) * BLOCK)
        data = fetch(self.path, start, end)
        _cache.put(self.name, start, data)
        return data[pos - start : pos - start + n]

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch (offset, length) ranges not cached yet, in parallel; ranges closer than MERGE_GAP as one."""
        wanted = sorted(
            (s, min(s + n, self.size)) for s, n in ranges if n > 0 and 0 <= s < self.size and _cache.get(self.name, s, n) is None
        )
        merged: list[list[int]] = []
        for start, end in wanted:
            if merged and start - merged[-1][1] <= MERGE_GAP:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        if len(merged) < 2:
            return  # one range: fetched when read
        starts, ends = [s for s, _ in merged], [e for _, e in merged]
        got = call(self.path, self.path.fs.cat_ranges, [self.path.key] * len(merged), starts, ends, on_error="return")
        for (start, end), data in zip(merged, got):
            if isinstance(data, bytes) and len(data) == end - start:
                _cache.put(self.name, start, data)

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError(errno.EBADF, "an object in object storage has no file descriptor", self.name)

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> RemoteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
