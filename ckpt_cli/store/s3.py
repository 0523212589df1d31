"""s3:// through s3fs (aiobotocore): the client, its retries and error words, and writes as multipart uploads.

Credentials, region and endpoint come from the standard AWS configuration (AWS_ENDPOINT_URL included); botocore
retries throttling, 5xx and connection errors with backoff, and s3fs's own loop retries around it. Every request
and the bytes each response carried are counted (a botocore event hook, store/clients.py's `stats`).

Each output object streams into one multipart upload (store/parts.py), completed only once every byte is sent and
aborted on any failure, so an object is either whole or absent; one that fits in a part is one PUT. Parts are
PART_BYTES (S3 needs at least 5 MiB but for the last), larger only when an object would need more than MAX_PARTS.
Bytes that pass unchanged from an object of the same endpoint are copied by S3 itself: a whole object by CopyObject (up
to 5 GiB), a long range as an UploadPartCopy part, each naming the source's ETag as the plan read it
(CopySourceIfMatch), and the ETag asked again before the object is completed (a store that ignores the condition,
as moto does, is still held to it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.store.backend import PathLike
from ckpt_cli.store.clients import call, count_request, names_of, reason
from ckpt_cli.store.location import Location, remote
from ckpt_cli.store.objects import ObjectStore
from ckpt_cli.store.parts import PartWriter, part_size

RETRIES = 5  # s3fs's own retries of transient errors, on top of botocore's (standard mode, MAX_ATTEMPTS)
MAX_ATTEMPTS = 8
_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionError", "InvalidEndpointError"}
THROTTLING = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException"}
PART_BYTES = 8 << 20
MIN_PART = 5 << 20  # every part but the last
MAX_PARTS = 10_000
WHOLE_COPY_MOST = 5 << 30  # CopyObject's limit; a larger object is copied as parts


def _after_call(http_response: Any = None, model: Any = None, **_: Any) -> None:
    length = 0
    if http_response is not None and not getattr(model, "name", "").startswith("Head"):
        length = int(http_response.headers.get("content-length") or 0)
    count_request(length)


def retry_policy() -> dict[str, Any]:
    """botocore's retries of throttling, 5xx and connection errors, with exponential backoff and jitter: standard
    mode, MAX_ATTEMPTS attempts, unless AWS_RETRY_MODE / AWS_MAX_ATTEMPTS say otherwise (an explicit Config would
    override them). Adaptive mode also slows the client down under sustained throttling, to a crawl when a store
    refuses a steady share of requests; it is there for those who want it (AWS_RETRY_MODE=adaptive)."""
    attempts = os.environ.get("AWS_MAX_ATTEMPTS", "")
    return {"mode": os.environ.get("AWS_RETRY_MODE") or "standard", "max_attempts": int(attempts) if attempts.isdigit() else MAX_ATTEMPTS}


def _codes(exc: BaseException) -> set[str]:
    """The S3 error codes of a failure: s3fs raises OSError with botocore's ClientError, which names the code, as cause."""
    found = set()
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            found.add(str(response.get("Error", {}).get("Code")))
    return found


def _throttled(exc: BaseException) -> bool:
    return bool(_codes(exc) & THROTTLING)


# ---- writes -------------------------------------------------------------------------------------------------


class Writer(PartWriter):
    """One object as a multipart upload (one PUT when it fits in a part), aborted on failure (store/parts.py)."""

    MIN_PART = MIN_PART
    RANGE_COPIES = True
    WHOLE_MOST = WHOLE_COPY_MOST

    def __init__(self, path: Location, total: int, progress: Callable[[int], None] | None = None) -> None:
        super().__init__(path, part_size(total, PART_BYTES, MAX_PARTS), progress)
        self.bucket, self.key = path.parts[1], "/".join(path.parts[2:])
        self.upload_id: str | None = None

    def _s3(self, method: str, **kwargs: Any) -> Any:
        return call(self.path, self.path.fs.call_s3, method, Bucket=self.bucket, Key=self.key, **kwargs)

    def _start(self) -> None:
        self.upload_id = self._s3("create_multipart_upload")["UploadId"]

    def _upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        reply = self._s3("upload_part", UploadId=self.upload_id, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def _put_whole(self, body: bytes) -> None:
        self._s3("put_object", Body=body)

    def _copy_part(self, number: int, source: Location, start: int, end: int, etag: str) -> dict[str, Any]:
        reply = self._s3(
            "upload_part_copy",
            UploadId=self.upload_id,
            PartNumber=number,
            CopySource=_copy_source(source),
            CopySourceRange=f"bytes={start}-{end - 1}",
            **_if_match(etag),
        )
        return {"PartNumber": number, "ETag": reply["CopyPartResult"]["ETag"]}

    def _copy_whole(self, source: Location, etag: str) -> None:
        # its own full-object CRC32: a source uploaded in parts has a checksum of its parts, which is not the copy's
        self._s3("copy_object", CopySource=_copy_source(source), ChecksumAlgorithm="CRC32", **_if_match(etag))

    def _current_etag(self, source: Location) -> str:
        reply = call(source, source.fs.call_s3, "head_object", Bucket=source.parts[1], Key="/".join(source.parts[2:]))
        return str(reply.get("ETag") or "")

    def _finish(self, tokens: list[Any]) -> None:
        self._s3("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": tokens})

    def _drop(self) -> None:
        if self.upload_id is not None:
            self._s3("abort_multipart_upload", UploadId=self.upload_id)


def _copy_source(source: Location) -> dict[str, str]:
    return {"Bucket": source.parts[1], "Key": "/".join(source.parts[2:])}


def _if_match(etag: str) -> dict[str, str]:
    return {"CopySourceIfMatch": etag} if etag else {}


def _uploads(dest: Location) -> list[tuple[str, str]]:
    """(key, upload id) of the multipart uploads at `dest` or under the prefix `dest/`, neither completed nor aborted."""
    bucket, key = dest.parts[1], "/".join(dest.parts[2:])
    found: list[tuple[str, str]] = []
    for prefix in (key, key + "/"):
        reply = call(dest, dest.fs.call_s3, "list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        found += [(u["Key"], u["UploadId"]) for u in reply.get("Uploads", []) if u["Key"] == key or u["Key"].startswith(key + "/")]
    return sorted(set(found))


class S3(ObjectStore):
    """s3:// (and s3a://): the Backend of store/backend.py for S3 and S3-compatible stores."""

    INSTALL_HINT = "the s3 extra: pip install 'ckpt-tools[s3]'"
    CREDENTIALS = "the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the bucket policy"
    # a change of any of these gets a new filesystem (tests and the Python API may change them in one process)
    ENVIRONMENT: tuple[str, ...] = (
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
    )
    ENVIRONMENT += ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")
    DESTINATION = "a key under the bucket (s3://bucket/name)"
    UNFINISHED = (
        "an upload that never completed (a write killed outright, or one running now); "
        "ckpt's next --overwrite of this prefix aborts it, as a lifecycle rule would"
    )
    Writer = Writer

    def tensorstore_kvstore(self, folder: PathLike) -> dict[str, Any] | None:
        """tensorstore's `s3` kvstore at the prefix, pointed where ckpt's own reads go: the endpoint and region of the
        AWS variables, and with keys in the environment the `environment` credentials alone (its default chain also
        tries profile files, and its logger writes to stderr when they are absent)."""
        bucket, _, key = remote(folder).key.partition("/")
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key.rstrip("/") + "/" if key else ""}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        spec.update({"endpoint": endpoint} if endpoint else {}, **({"aws_region": region} if region else {}))
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            spec["context"] = {"aws_credentials": {"type": "environment"}}
        return spec

    def make(self, protocol: str) -> Any:
        try:
            import s3fs
        except ImportError:
            raise UsageError(f"{protocol}:// needs {self.INSTALL_HINT}") from None
        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={"retries": retry_policy(), "max_pool_connections": 64})
        fs.retries = RETRIES  # a class attribute in s3fs: attempts of its own retry loop (throttling, 5xx, timeouts)
        try:
            fs.connect()
            fs.s3.meta.events.register("after-call.s3", _after_call)
        except Exception as exc:
            raise self.translate(exc, f"{protocol}://") or DataError(f"{protocol}://: {reason(exc)}") from None
        return fs

    def translate(self, exc: BaseException, where: object) -> Exception | None:
        names = names_of(exc)
        if names & _CREDENTIALS:
            return UsageError(f"{where}: no usable credentials ({reason(exc)}); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
        if names & _UNREACHABLE:
            return UsageError(f"{where}: cannot reach the object store ({reason(exc)}); check AWS_ENDPOINT_URL and the network")
        if _codes(exc) & {"PreconditionFailed", "412"}:  # a copy's CopySourceIfMatch: the source is not what was read
            return DataError(f"{where}: a source object changed since it was read; nothing was written, run again")
        if _throttled(exc):
            return DataError(
                f"{where}: the object store kept throttling requests (503 SlowDown) through every retry; "
                "try again later, with fewer --workers, or with a larger AWS_MAX_ATTEMPTS"
            )
        return None

    def unfinished_keys(self, dest: Location) -> list[str]:
        """Keys at or under `dest` with a multipart upload started and neither completed nor aborted (a write killed
        outright, or one running now): invisible, but stored (and billed) until aborted."""
        return sorted({key for key, _ in _uploads(dest)})

    def drop_unfinished(self, dest: Location) -> None:
        for key, upload in _uploads(dest):
            call(dest, dest.fs.call_s3, "abort_multipart_upload", Bucket=dest.parts[1], Key=key, UploadId=upload)
