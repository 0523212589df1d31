"""The S3 side of the object-storage tests: a bucket on a moto server (started by conftest's `s3` fixture in server
mode, a real HTTP endpoint), seen through boto3, and comparisons of what ckpt printed and wrote there with a local run."""

from __future__ import annotations

from pathlib import Path

import boto3
from store_view import StoreView

BUCKET = "ckpt"
ISOLATED = {"AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true"}


class S3(StoreView):
    """The test's own view of the bucket (boto3), and uploads of local checkpoints."""

    protocol, root = "s3", BUCKET

    def __init__(self, endpoint: str, env: dict[str, str]) -> None:
        self.endpoint, self.env = endpoint, env
        self.client = boto3.client("s3", endpoint_url=endpoint)

    def put_file(self, local: Path, key: str) -> None:
        self.client.upload_file(str(local), BUCKET, key)

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=BUCKET, Key=key)

    def start_unfinished(self, key: str) -> None:
        """A write that started a multipart upload and never completed it."""
        self.client.create_multipart_upload(Bucket=BUCKET, Key=key)

    def uploads(self, prefix: str) -> list[str]:
        return [u["Key"] for u in self.client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])]


def local_files(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def same_but_paths(s3_text: str, url: str, local_text: str, local: Path) -> None:
    assert s3_text.replace(url, "<root>") == local_text.replace(str(local), "<root>")
