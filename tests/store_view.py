"""What the object-storage tests' own views of a bucket (s3_store.S3) and a container (az_store.Azure) share: URLs,
uploads of local checkpoints, and reading a checkpoint back; each store gives `put_file`, `keys` and `get`."""

from __future__ import annotations

from pathlib import Path


class StoreView:
    protocol = ""  # s3, az
    root = ""  # the bucket or container

    def put_file(self, local: Path, key: str) -> None:
        raise NotImplementedError

    def keys(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def url(self, key: str) -> str:
        return f"{self.protocol}://{self.root}/{key}"

    def upload(self, local: Path, key: str) -> str:
        """A local file, or every file under a local folder, at `key` (a folder's files under the prefix `key/`)."""
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for p in files:
            self.put_file(p, key if p == local else f"{key}/{p.relative_to(local).as_posix()}")
        return self.url(key)

    def objects(self, key: str) -> dict[str, bytes]:
        """The object `key` as {"": bytes}, or the objects under the prefix by relative name."""
        found = self.keys(key + "/")
        if not found:
            return {"": self.get(key)}
        return {k[len(key) + 1 :]: self.get(k) for k in found}
