"""The S3 side of the object-storage tests: a bucket on a moto server (started by conftest's `s3` fixture in server
mode, a real HTTP endpoint), seen through boto3, and comparisons of what ckpt printed and wrote there with a local run."""

from __future__ import annotations

from pathlib import Path

import boto3

BUCKET = "ckpt"
ISOLATED = {"AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true"}


class S3:
    """The test's own view of the bucket (boto3), and uploads of local checkpoints."""

    protocol = "s3"

    def __init__(self, endpoint: str, env: dict[str, str]) -> None:
        self.endpoint, self.env = endpoint, env
        self.client = boto3.client("s3", endpoint_url=endpoint)

    def url(self, key: str) -> str:
        return f"s3://{BUCKET}/{key}"

    def upload(self, local: Path, key: str) -> str:
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for p in files:
            name = key if p == local else f"{key}/{p.relative_to(local).as_posix()}"
            self.client.upload_file(str(p), BUCKET, name)
        return self.url(key)

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

    def objects(self, key: str) -> dict[str, bytes]:
        """The object `key` as {"": bytes}, or the objects under the prefix by relative name."""
        found = self.keys(key + "/")
        if not found:
            return {"": self.get(key)}
        return {k[len(key) + 1 :]: self.get(k) for k in found}

    def uploads(self, prefix: str) -> list[str]:
        return [u["Key"] for u in self.client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])]


def local_files(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def same_but_paths(s3_text: str, url: str, local_text: str, local: Path) -> None:
    assert s3_text.replace(url, "<root>") == local_text.replace(str(local), "<root>")
