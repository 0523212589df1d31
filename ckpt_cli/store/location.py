"""Checkpoints on object storage (`s3://bucket/prefix`, `az://container/prefix`, another fsspec URL): locations,
listings, ranged reads.

A location in object storage is a `Location`: protocol + key, kept as a PurePosixPath whose first part is the
protocol (`s3:`), so format modules keep using `/`, `.name`, `.suffix`, `.parent` and the few filesystem calls they
make (`is_dir`, `iterdir`, `glob`, `stat`, `exists`, `open`), and `str()` gives the URL back. `Path("s3://b/k")`
(what argument parsing makes of a URL: `s3:/b/k`) is the same location; `location()` turns either into a Location,
never into a local path, typed as the Path it stands in for; `remote()`, for a path known to be a URL, typed as what
it is (the store's own code, which uses `.fs` and `.key`).

Reads are ranged GETs through fsspec (s3fs for s3://, adlfs for az://). Metadata parses read through `RemoteFile`:
small reads fetch one aligned BLOCK and keep it, larger ones fetch exactly the bytes asked for, and `prefetch`
fetches a list of ranges in parallel (zip local headers); the cache is shared by the handles of one command and
dropped by `fresh()`. Tensor data is read exactly (`read_into`) and never cached. Clients, errors and request
counts: store/clients.py and each protocol's backend (store/s3.py, store/azure.py).
"""

from __future__ import annotations

import bisect
import errno
import fnmatch
import functools
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.store import clients, predicted
from ckpt_cli.store.clients import BACKENDS, call, filesystem

PROTOCOLS = (*BACKENDS, "gs", "gcs", "memory")  # recognised in Path's `s3:/b/k` form: every backend's, and fsspec's few
BLOCK = 8 << 10  # a small read fetches this aligned block (zip directories, pickles and headers sit in one or two)
SPAN_LIMIT = 1 << 20  # exact reads up to this size are kept too (a header read, then parsed from a second handle)
CACHE_BYTES = 64 << 20
MERGE_GAP = 4 << 10  # prefetched ranges closer than this are fetched as one
PREFETCH_ROUNDS = 8  # objects whose announced ranges are fetched at once (RemoteFile.prefetch)
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://")
_probes: dict[tuple[str, str], Any] = {}  # (fs method, key) -> its answer, for one command (Location._probe)
_pending: dict[str, list[tuple[int, int, Future[None]]]] = {}  # url -> ranges being prefetched (RemoteFile.prefetch)
_pending_lock = threading.Lock()
_prefetcher: ThreadPoolExecutor | None = None
_etags: dict[str, str] = {}  # url -> the entity tag its first `info` probe of this command found (Location.etag)


def protocol_of(path: object) -> str | None:
    """The protocol of a remote location (`s3://b/k`, or `s3:/b/k` as Path spells it); None for a local path."""
    if isinstance(path, Location):
        return path.protocol
    return _text_protocol(os.fspath(path) if isinstance(path, PurePath) else str(path))


@functools.lru_cache(maxsize=1 << 12)  # asked for every chunk a write copies (a million times), of a few files
def _text_protocol(text: str) -> str | None:
    match = _URL.match(text)
    if match:
        return match.group(1)
    colon = text.find(":/")  # not partition(): asked for every chunk a write copies, it copied the whole path each time
    return text[:colon] if colon > 0 and text[:colon] in PROTOCOLS else None


def is_remote(path: object) -> bool:
    return protocol_of(path) is not None


def location(path: str | os.PathLike[str]) -> Path:
    """A Location for a URL (or Path's spelling of one), else the local Path."""
    if not isinstance(path, Location) and protocol_of(path) is None:
        return path if isinstance(path, Path) else Path(path)
    return remote(path)  # type: ignore[return-value]  # a Location stands in for a Path (the calls readers make)


def remote(path: str | os.PathLike[str]) -> Location:
    """The Location of a URL (or Path's spelling of one); for a path that names one (`is_remote`)."""
    if isinstance(path, Location):
        return path
    protocol = protocol_of(path)
    assert protocol is not None, f"{path}: a local path, not a URL"
    rest = [p for p in str(path).split(":", 1)[1].split("/") if p]
    if not rest:
        raise UsageError(f"{protocol}://: names no bucket")
    return Location(f"{protocol}:", *rest)


@dataclass(frozen=True)
class RemoteStat:
    st_size: int
    st_mtime_ns: int
    st_mode: int

    @property
    def st_mtime(self) -> float:
        return self.st_mtime_ns / 1e9


class Location(PurePosixPath):
    """`s3://bucket/key` as a path (parts `s3:`, `bucket`, `key`...) with the filesystem calls readers make."""

    __slots__ = ()

    def __str__(self) -> str:
        if not self.parts or not self.parts[0].endswith(":"):  # relative_to() gives a plain relative path
            return "/".join(self.parts) or "."
        head, *rest = self.parts
        return f"{head}//{'/'.join(rest)}"

    @property
    def parents(self) -> tuple[Location, ...]:
        """The prefixes above, up to the bucket (`s3://` itself is no location)."""
        return tuple(Location(*self.parts[:n]) for n in range(len(self.parts) - 1, 1, -1))

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

    def _probe(self, method: str) -> Any:
        """fs.<method>(key), asked once per command: format detection probes one path many times, and each probe is a
        round trip (a HEAD or a LIST). Dropped by fresh() and forget()."""
        found = _probes.get((method, self.key), _probes)
        if found is _probes:
            found = _probes[(method, self.key)] = call(self, getattr(self.fs, method), self.key)
            if method == "info" and isinstance(found, dict):
                _etags.setdefault(str(self), str(found.get("ETag") or found.get("etag") or ""))
        return found

    def stat(self, *, follow_symlinks: bool = True) -> RemoteStat:
        info = self._probe("info")
        when = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
        ns = int(when.timestamp() * 1e9) if hasattr(when, "timestamp") else int(float(when or 0) * 1e9)
        kind = stat.S_IFDIR if info.get("type") == "directory" else stat.S_IFREG
        return RemoteStat(int(info.get("size") or 0), ns, kind | 0o644)

    lstat = stat

    @property
    def etag(self) -> str:
        """The object's entity tag as this command first saw it (its first `stat`, made when the plan read it), kept
        while the probes are dropped for the writes: a store copy names it, so a source changed since is refused
        (store/parts.py)."""
        if str(self) not in _etags:
            self._probe("info")
        return _etags[str(self)]

    def exists(self, *, follow_symlinks: bool = True) -> bool:
        return len(self.parts) > 1 and bool(self._probe("exists"))

    def is_dir(self) -> bool:
        return len(self.parts) > 1 and bool(self._probe("isdir"))

    def is_file(self) -> bool:
        return len(self.parts) > 2 and bool(self._probe("isfile"))

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[Location]:
        if len(self.parts) < 2:
            raise NotADirectoryError(errno.ENOTDIR, "not a bucket or prefix", str(self))
        for entry in call(self, self.fs.ls, self.key, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name and entry.rstrip("/") != self.key:
                yield self / name

    def glob(self, pattern: str) -> Iterator[Location]:
        if "/" in pattern or "**" in pattern:
            yield from (remote(f"{self.protocol}://{p}") for p in call(self, self.fs.glob, f"{self.key}/{pattern}"))
            return
        yield from (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def rglob(self, pattern: str) -> Iterator[Location]:
        for found in call(self, self.fs.find, self.key, withdirs=True):
            path = remote(f"{self.protocol}://{found}")
            if found != self.key and fnmatch.fnmatchcase(path.name, pattern):
                yield path

    def resolve(self, strict: bool = False) -> Location:
        return self

    def absolute(self) -> Location:
        return self

    def expanduser(self) -> Location:
        return self

    def mkdir(self, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: object stores have no folders, a prefix exists once an object is under it."""

    def open(self, mode: str = "rb", *args: Any, **kwargs: Any) -> RemoteFile:
        if mode != "rb":
            raise UsageError(f"{self}: objects are opened for reading here; writes go through a write transaction (store/__init__.py)")
        return RemoteFile(self)

    def read_bytes(self) -> bytes:
        with self.open() as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)


def fresh() -> None:
    """Forget cached listings and blocks: a new command sees the store as it is now."""
    with _pending_lock:
        running = [f for spans in _pending.values() for _, _, f in spans]
    for future in running:  # let an earlier command's prefetches land before the cache is emptied
        future.result()
    _cache.clear()
    _probes.clear()
    _etags.clear()
    for fs in clients.made():
        fs.invalidate_cache()


def forget(path: Location) -> None:
    """Forget what is cached about `path` (it was just written or deleted)."""
    path.fs.invalidate_cache(path.key)
    _cache.drop(str(path))
    _etags.pop(str(path), None)
    _probes.clear()  # the path's parents and the prefixes under it changed too


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


def fetch(path: Location, start: int, end: int) -> bytes:
    """Bytes [start, end) of an object: one ranged GET (DataError if the object ends first). A GET that reaches into
    the data of an item laid out by prediction takes the whole item and checks it before returning (store/predicted.py)."""
    return bytes(fetch_view(path, start, end))


def fetch_view(path: Location, start: int, end: int) -> bytes | memoryview:
    """fetch, as bytes or a view of the longer bytes fetched (no copy: what tensor data is read through)."""
    url = str(path)
    mine, theirs = predicted.claim(url, start, end)
    data = _checked_get(path, start, end, mine)
    for item in predicted.wait(theirs):  # given back by a fetch that failed
        _checked_get(path, item.start, item.end, [item])
    return data


def _checked_get(path: Location, start: int, end: int, mine: list[Any]) -> bytes | memoryview:
    """One ranged GET of [start, end), widened to the claimed items, which are checked on its bytes."""
    low, high = min([start, *(item.start for item in mine)]), max([end, *(item.end for item in mine)])
    try:
        data = call(path, path.fs.cat_file, path.key, start=low, end=high)
        if len(data) != high - low:
            raise DataError(f"{path}: truncated: expected {high - low} bytes at offset {low}, the object ends first")
    except BaseException:
        predicted.settle(mine, None, low)  # unchecked again: another fetch of them checks them
        raise
    predicted.settle(mine, data, low)
    return data if (low, high) == (start, end) else memoryview(data)[start - low : end - low]


def read_into(url: str, offset: int, view: memoryview) -> None:
    """Fill `view` with bytes of the object from `offset` (one ranged GET, not cached); DataError if it ends first."""
    path = remote(url)
    total = path.stat().st_size
    if offset + len(view) > total:
        raise DataError(f"{url}: truncated: expected {len(view)} bytes at offset {offset}, file ends first")
    if len(view):
        view[:] = fetch(path, offset, offset + len(view))


def prefetch_heads(paths: list[Any], nbytes: int = BLOCK) -> None:
    """The first `nbytes` of each object, in one parallel round (the headers of many files: hf shards); local
    paths and objects not found are passed over (reading them reports it)."""
    remote_paths = [remote(p) for p in paths if is_remote(p)]
    by_fs: dict[int, list[Location]] = {}
    for path in remote_paths:
        by_fs.setdefault(id(path.fs), []).append(path)
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

    def __init__(self, path: Location) -> None:
        info = path._probe("info")
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
        if predicted.unchecked(self.name, pos, pos + n):  # checked on the way (fetch), never served from the cache
            return fetch(self.path, pos, pos + n)
        hit = _cache.get(self.name, pos, n)
        if hit is None and _pending:
            self._wait_prefetched(pos, n)
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
        """Start fetching (offset, length) ranges not cached yet, in parallel, and return: a reader that announces the
        ranges of many objects one after another (a DCP checkpoint's chunk headers, file by file) has them fetched in
        one round, and a read of a range still in flight waits for it. Ranges closer than MERGE_GAP are fetched as one."""
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
        with _pending_lock:
            global _prefetcher
            if _prefetcher is None:
                _prefetcher = ThreadPoolExecutor(PREFETCH_ROUNDS, thread_name_prefix="ckpt-heads")
            future = _prefetcher.submit(self._fetch_ranges, merged)
            _pending.setdefault(self.name, []).extend((s, e, future) for s, e in merged)

    def _fetch_ranges(self, merged: list[list[int]]) -> None:
        try:
            starts, ends = [s for s, _ in merged], [e for _, e in merged]
            got = call(self.path, self.path.fs.cat_ranges, [self.path.key] * len(merged), starts, ends, on_error="return")
            for (start, end), data in zip(merged, got):
                if isinstance(data, bytes) and len(data) == end - start:
                    _cache.put(self.name, start, data)
        except Exception:  # a read of these ranges fetches them itself, and reports what fails
            pass
        finally:
            with _pending_lock:
                left = [p for p in _pending.get(self.name, []) if (p[0], p[1]) not in {(s, e) for s, e in merged}]
                if left:
                    _pending[self.name] = left
                else:
                    _pending.pop(self.name, None)

    def _wait_prefetched(self, pos: int, n: int) -> None:
        """Wait for a prefetch in flight that covers [pos, pos + n) (its bytes are then in the cache)."""
        with _pending_lock:
            found = [f for s, e, f in _pending.get(self.name, []) if s <= pos and pos + n <= e]
        for future in found:
            future.result()

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
