"""The Azure side of the object-storage tests: a container on Azurite (the Azure Storage emulator, started by
conftest's `az` fixture), seen through the Azure SDK, with the same methods as s3_store.S3."""

from __future__ import annotations

import base64
from pathlib import Path

from store_view import StoreView

CONTAINER = "ckpt"
# Azurite's one account and its published key (https://learn.microsoft.com/azure/storage/common/storage-use-azurite)
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def connection_string(port: int) -> str:
    return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"


class Azure(StoreView):
    """The test's own view of the container (azure-storage-blob), and uploads of local checkpoints."""

    protocol, root = "az", CONTAINER

    def __init__(self, conn: str) -> None:
        from azure.storage.blob import BlobServiceClient

        self.conn = conn
        self.service = BlobServiceClient.from_connection_string(conn)
        self.container = self.service.get_container_client(CONTAINER)

    def put_file(self, local: Path, key: str) -> None:
        with open(local, "rb") as f:
            self.container.upload_blob(key, f, overwrite=True)

    def keys(self, prefix: str) -> list[str]:
        return sorted(b.name for b in self.container.list_blobs(name_starts_with=prefix))

    def get(self, key: str) -> bytes:
        return self.container.download_blob(key).readall()

    def put(self, key: str, data: bytes) -> None:
        self.container.upload_blob(key, data, overwrite=True)

    def delete(self, key: str) -> None:
        self.container.delete_blob(key)

    def uploads(self, prefix: str) -> list[str]:
        """Names with staged blocks and no committed blob: writes that never completed."""
        staged = [b.name for b in self.container.list_blobs(name_starts_with=prefix, include=["uncommittedblobs"])]
        committed = set(self.keys(prefix))
        return [n for n in staged if n not in committed]

    def start_unfinished(self, key: str) -> None:
        """A write that staged a block and never committed it."""
        self.container.get_blob_client(key).stage_block(base64.b64encode(b"0000000000").decode(), b"x" * 16)
