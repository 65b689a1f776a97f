"""A raw byte store on S3-compatible object storage (aiobotocore), for scale-out mode.

Writes are multipart uploads: parts are sent as they fill, and the object appears only when
the upload completes, so readers never see a partial blob.
"""

from __future__ import annotations

import contextlib
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from aiobotocore.session import get_session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from backfill.adapters.blobs.raw import RawWriter
from backfill.errors import NotFound, StorageError

PART_BYTES = 8 * 1024 * 1024  # S3 needs parts of at least 5 MiB, except the last one


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Location:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"storage_url {url!r} must look like s3://bucket/prefix")
        return cls(parsed.netloc, parsed.path.strip("/"))

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name


def _missing(exc: ClientError) -> bool:
    code = exc.response.get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


class _S3Writer:
    def __init__(self, store: S3RawStore, key: str) -> None:
        self._store = store
        self._key = key
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    async def write(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= PART_BYTES:
            await self._send_part()

    async def _send_part(self) -> None:
        client = await self._store.client()
        try:
            if self._upload_id is None:
                created = await client.create_multipart_upload(
                    Bucket=self._store.location.bucket, Key=self._key
                )
                self._upload_id = created["UploadId"]
            number = len(self._parts) + 1
            sent = await client.upload_part(
                Bucket=self._store.location.bucket,
                Key=self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=bytes(self._buffer),
            )
        except (BotoCoreError, ClientError) as exc:
            await self.abort()
            raise StorageError(f"Could not store the file in object storage: {exc}") from None
        self._parts.append({"ETag": sent["ETag"], "PartNumber": number})
        self._buffer.clear()

    async def commit(self) -> None:
        client = await self._store.client()
        try:
            if self._upload_id is None:
                await client.put_object(
                    Bucket=self._store.location.bucket, Key=self._key, Body=bytes(self._buffer)
                )
                return
            if self._buffer:
                await self._send_part()
            await client.complete_multipart_upload(
                Bucket=self._store.location.bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )
        except (BotoCoreError, ClientError) as exc:
            await self.abort()
            raise StorageError(f"Could not store the file in object storage: {exc}") from None

    async def abort(self) -> None:
        self._buffer.clear()
        if self._upload_id is not None:
            client = await self._store.client()
            with contextlib.suppress(BotoCoreError, ClientError):
                await client.abort_multipart_upload(
                    Bucket=self._store.location.bucket, Key=self._key, UploadId=self._upload_id
                )
            self._upload_id = None


class S3RawStore:
    """Blobs as objects under ``s3://bucket/prefix``; endpoint and credentials configurable."""

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
    ) -> None:
        self.location = S3Location.parse(url)
        self._options: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "region_name": region or "us-east-1",
            "aws_access_key_id": access_key_id,
            "aws_secret_access_key": secret_access_key,
            "config": Config(retries={"max_attempts": 5, "mode": "adaptive"}),
        }
        self._stack = AsyncExitStack()
        self._client: Any = None

    async def client(self) -> Any:
        if self._client is None:
            session = get_session()
            self._client = await self._stack.enter_async_context(
                session.create_client("s3", **self._options)
            )
        return self._client

    async def close(self) -> None:
        await self._stack.aclose()
        self._client = None

    async def writer(self, key: str) -> RawWriter:
        return _S3Writer(self, self.location.key(key))

    async def read(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        client = await self.client()
        try:
            response = await client.get_object(
                Bucket=self.location.bucket,
                Key=self.location.key(key),
                Range=f"bytes={start}-{start + length - 1}",
            )
            async with response["Body"] as body:
                data: bytes = await body.read()
                return data
        except BotoCoreError as exc:
            raise StorageError(f"Object storage failed: {exc}") from None
        except ClientError as exc:
            if _missing(exc):
                raise NotFound(f"No content stored under {key!r}.") from None
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""
            raise StorageError(f"Object storage failed: {exc}") from None

    async def size(self, key: str) -> int:
        client = await self.client()
        try:
            head = await client.head_object(Bucket=self.location.bucket, Key=self.location.key(key))
        except BotoCoreError as exc:
            raise StorageError(f"Object storage failed: {exc}") from None
        except ClientError as exc:
            if _missing(exc):
                raise NotFound(f"No content stored under {key!r}.") from None
            raise StorageError(f"Object storage failed: {exc}") from None
        return int(head["ContentLength"])

    async def delete(self, key: str) -> None:
        client = await self.client()
        with contextlib.suppress(ClientError):
            await client.delete_object(Bucket=self.location.bucket, Key=self.location.key(key))
