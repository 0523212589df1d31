"""The fsspec filesystems behind object storage locations (core/storage.py): one client per protocol and AWS
environment, its retries, its errors worded as one line, and a count of every request and byte.

s3:// goes through s3fs (aiobotocore): credentials, region and endpoint from the standard AWS configuration
(AWS_ENDPOINT_URL included); botocore retries throttling, 5xx and connection errors with backoff, and s3fs's
own loop retries around it. `stats()` counts every request and the bytes each response carried (a botocore
event hook), so what `inspect` transfers can be measured; uploads add what they sent (`count_sent`).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ckpt_cli.errors import DataError, UsageError

RETRIES = 5  # s3fs's own retries of transient errors, on top of botocore's (standard mode, MAX_ATTEMPTS)
MAX_ATTEMPTS = 8
INSTALL_HINT = "pip install 'ckpt-tools[s3]'"
# a change of any of these gets a new filesystem (tests and the Python API may change them in one process)
_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
_ENV += ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")
_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionError", "InvalidEndpointError"}
THROTTLING = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException"}
T = TypeVar("T")


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
    if _throttled(exc):
        return DataError(
            f"{where}: the object store kept throttling requests (503 SlowDown) through every retry; "
            "try again later, with fewer --workers, or with a larger AWS_MAX_ATTEMPTS"
        )
    if isinstance(exc, ImportError):
        return UsageError(f"{where}: object storage needs the s3 extra: {INSTALL_HINT} ({exc})")
    return DataError(f"{where}: object store request failed after retries ({type(exc).__name__}: {_reason(exc)})")


def _throttled(exc: BaseException) -> bool:
    """A throttling answer: s3fs raises OSError(EBUSY) with botocore's ClientError, which names the code, as cause."""
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in THROTTLING:
            return True
    return False


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


def made() -> list[Any]:
    """The filesystems made so far (to drop their cached listings)."""
    with _fs_lock:
        return list(_filesystems.values())
