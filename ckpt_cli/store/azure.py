"""az:// (and abfs://) Azure Blob Storage through adlfs: the client, its error words, and writes as staged blocks.

Credentials come from what adlfs reads: AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with
AZURE_STORAGE_ACCOUNT_KEY, a SAS token, a service principal, or the default Azure credential chain. The Azure SDK
retries throttling, 5xx and connection errors with exponential backoff. Every response is counted (the storage
response hook of the client's pipeline, store/clients.py's `stats`).

An output object is a block blob: its bytes are staged as blocks of BLOCK_BYTES (at most IN_FLIGHT being sent while
the next is filled) and become the blob in one Put Block List once all are staged, so an object is whole or absent.
Staged blocks that were never committed are invisible; Azure drops them after a week. ckpt drops them itself on
abort, and lists them as unfinished writes (`list_blobs(include=uncommittedblobs)`).

An output blob equal to a source blob of the same account byte for byte (up to WHOLE_COPY_MOST) is copied by the
service (Copy Blob From URL, synchronous: whole or absent), the source named by a read-only SAS made from the account
key and by its ETag as the plan read it (a source changed since is refused). Ranges are not copied: Azurite, which
the tests run against, does not implement Put Block From URL, so a range copy could not be tested here; they stream.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.store.clients import call, count_request, names_of, reason
from ckpt_cli.store.location import Location
from ckpt_cli.store.objects import ObjectStore
from ckpt_cli.store.parts import PartWriter, part_size

_CREDENTIALS = {"ClientAuthenticationError", "CredentialUnavailableError"}
_UNREACHABLE = {"ServiceRequestError", "ClientConnectorError", "ServiceRequestTimeoutError", "ConnectionError"}
THROTTLING = {"ServerBusy", "OperationTimedOut", "IngressOverAccountLimit", "EgressOverAccountLimit"}
BLOCK_BYTES = 8 << 20
MAX_BLOCKS = 50_000
WHOLE_COPY_MOST = 256 << 20  # Copy Blob From URL's limit (a larger blob streams)
SAS_SECONDS = 3600  # how long the read-only SAS of a copy's source lasts
RETRY_BACKOFF = (2, 2)  # the Azure SDK's 3 retries after 2, 4 and 6 s (+-3 s of jitter); its own default is (15, 3)


def _after_call(response: Any) -> None:
    http = response.http_response
    length = 0 if response.http_request.method == "HEAD" else int(http.headers.get("Content-Length") or 0)
    count_request(length)


# ---- writes -------------------------------------------------------------------------------------------------


def _run(path: Location, make_coroutine: Callable[..., Any], *args: Any) -> Any:
    """A coroutine of the Azure SDK run on adlfs's event loop, from any thread, its failure worded as one line."""
    from fsspec.asyn import sync

    return call(path, sync, path.fs.loop, make_coroutine, *args)


def _blob(path: Location) -> Any:
    return path.fs.service_client.get_blob_client(path.parts[1], "/".join(path.parts[2:]))


def _on_blob(path: Location, method: str, *args: Any, **kwargs: Any) -> Any:
    """One request of the blob client at `path` (`method`: stage_block, upload_blob, ...), run as _run runs it."""

    async def request() -> Any:
        async with _blob(path) as blob:
            return await getattr(blob, method)(*args, **kwargs)

    return _run(path, request)


class Writer(PartWriter):
    """One blob as staged blocks committed by one block list (one Put Blob when it fits in a block); on failure the
    staged blocks are dropped (store/parts.py)."""

    WHOLE_MOST = WHOLE_COPY_MOST

    def __init__(self, path: Location, total: int, progress: Callable[[int], None] | None = None) -> None:
        super().__init__(path, part_size(total, BLOCK_BYTES, MAX_BLOCKS), progress)

    def copies(self, url: str) -> bool:
        return super().copies(url) and _account_key(self.path.fs) is not None

    def _copy_whole(self, source: Location, etag: str) -> None:
        from azure.core import MatchConditions

        url = _blob(source).url + "?" + _read_sas(source)
        _on_blob(
            self.path,
            "start_copy_from_url",
            url,
            requires_sync=True,
            source_etag=etag,
            source_match_condition=MatchConditions.IfNotModified,
        )

    def _current_etag(self, source: Location) -> str:
        return str(_on_blob(source, "get_blob_properties").etag or "")

    def _upload_part(self, number: int, body: bytes) -> str:
        block_id = base64.b64encode(f"{number:010d}".encode()).decode()  # the ids of one blob have one length
        _on_blob(self.path, "stage_block", block_id, body, length=len(body))
        return block_id

    def _put_whole(self, body: bytes) -> None:
        _on_blob(self.path, "upload_blob", body, overwrite=True)

    def _finish(self, tokens: list[Any]) -> None:
        from azure.storage.blob import BlobBlock

        _on_blob(self.path, "commit_block_list", [BlobBlock(block_id) for block_id in tokens])

    def _drop(self) -> None:
        _discard(self.path)


def _account_key(fs: Any) -> str | None:
    """The account key a SAS is made from (a shared-key client's credential holds it); None without one."""
    key = getattr(getattr(fs.service_client, "credential", None), "account_key", None)
    return str(key) if key else None


def _read_sas(source: Location) -> str:
    """A SAS that lets the service read `source` for SAS_SECONDS (a copy's source must be readable by the service)."""
    from datetime import datetime, timedelta, timezone

    from azure.storage.blob import BlobSasPermissions, generate_blob_sas

    fs = source.fs
    expiry = datetime.now(timezone.utc) + timedelta(seconds=SAS_SECONDS)
    account, name, key = fs.service_client.account_name, "/".join(source.parts[2:]), _account_key(fs)
    return str(generate_blob_sas(account, source.parts[1], name, account_key=key, permission=BlobSasPermissions(read=True), expiry=expiry))


def _discard(path: Location) -> None:
    """Drop a blob's uncommitted blocks where no blob is committed under its name (a committed one, which a one-file
    output replaces only on commit, is never touched; its staged blocks go with the next commit, or in a week).
    Deleting a name that holds only staged blocks drops them (Azurite); where the service answers 404, an empty Put
    Blob commits the name first, and the deletion follows."""

    async def discard() -> None:
        from azure.core.exceptions import ResourceNotFoundError

        async with _blob(path) as blob:
            try:
                await blob.get_blob_properties()
                return
            except ResourceNotFoundError:
                pass
            try:
                await blob.delete_blob()
            except ResourceNotFoundError:
                await blob.upload_blob(b"", overwrite=True)
                await blob.delete_blob()

    _run(path, discard)


class Azure(ObjectStore):
    """az:// (and abfs://, abfss://): the Backend of store/backend.py for Azure Blob Storage."""

    INSTALL_HINT = "the azure extra: pip install 'ckpt-tools[azure]'"
    CREDENTIALS = "the credentials (AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME and _KEY) and the container's access"
    ENVIRONMENT: tuple[str, ...] = (
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCOUNT_NAME",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
    )
    ENVIRONMENT += ("AZURE_STORAGE_CLIENT_ID", "AZURE_STORAGE_CLIENT_SECRET", "AZURE_STORAGE_TENANT_ID", "AZURE_STORAGE_ANON")
    DESTINATION = "a name under the container ({protocol}://container/name)"
    UNFINISHED = (
        "blocks staged but never committed (a write killed outright, or one running now); ckpt's next --overwrite of this prefix drops them"
    )
    Writer = Writer

    def make(self, protocol: str) -> Any:
        try:
            import adlfs
        except ImportError:
            raise UsageError(f"{protocol}:// needs {self.INSTALL_HINT}") from None
        try:
            fs = adlfs.AzureBlobFileSystem(skip_instance_cache=True)
        except Exception as exc:
            raise self.translate(exc, f"{protocol}://") or UsageError(f"{protocol}://: {reason(exc)}; set {self.CREDENTIALS}") from None
        for policy in fs.service_client._pipeline._impl_policies:  # every client made from it shares these policies
            if type(policy).__name__ == "AsyncStorageResponseHook":
                policy._response_callback = _after_call
            if type(policy).__name__ == "ExponentialRetry":
                # the SDK waits 15, 18 and 24 s between attempts: an unreachable endpoint took 84 s to say so
                policy.initial_backoff, policy.increment_base = RETRY_BACKOFF
        return fs

    def translate(self, exc: BaseException, where: object) -> Exception | None:
        names = names_of(exc)
        status = getattr(exc, "status_code", None)
        if names & _CREDENTIALS or status == 403:
            return UsageError(f"{where}: access denied or no usable credentials ({reason(exc)}); check {self.CREDENTIALS}")
        if names & _UNREACHABLE:
            return UsageError(f"{where}: cannot reach the object store ({reason(exc)}); check the account URL and the network")
        if status == 412 or getattr(exc, "error_code", None) in ("ConditionNotMet", "SourceConditionNotMet"):
            return DataError(f"{where}: a source blob changed since it was read; nothing was written, run again")
        if getattr(exc, "error_code", None) in THROTTLING or status == 503:
            return DataError(f"{where}: the object store kept throttling requests (503 ServerBusy) through every retry; try again later")
        return None

    def unfinished_keys(self, dest: Location) -> list[str]:
        """Names at or under `dest` holding staged blocks and no committed blob (a write killed outright, or one running)."""
        container, key = dest.parts[1], "/".join(dest.parts[2:])

        async def listing() -> list[str]:
            client = dest.fs.service_client.get_container_client(container)
            staged = [b.name async for b in client.list_blobs(name_starts_with=key, include=["uncommittedblobs"])]
            committed = {b.name async for b in client.list_blobs(name_starts_with=key)}
            return sorted(n for n in staged if n not in committed and (n == key or n.startswith(key + "/")))

        return _run(dest, listing)

    def drop_unfinished(self, dest: Location) -> None:
        for name in self.unfinished_keys(dest):
            _discard(Location(f"{dest.protocol}:", dest.parts[1], *name.split("/")))
