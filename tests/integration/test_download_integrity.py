"""Damaged, truncated or missing content answers an error envelope before any byte is sent,
never a 200 with a Content-Length and then a dropped connection."""

from __future__ import annotations

import base64
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from backfill.adapters.blobs.crypto import HEADER, SEGMENT, TAG
from backfill.container import build
from backfill.simulator.server import Simulator
from tests.support import (
    S3_CREDENTIALS,
    InProcess,
    chat_line,
    free_port,
    in_process_backfill,
    jsonl,
    moto_endpoint,
    new_bucket,
)

Sim = tuple[str, Simulator]
# Two segments of content, so a range can start in the second one.
ROWS = [chat_line(f"row-{i}", "x" * 900) for i in range(1300)]
RANGES = [None, "bytes=0-9", f"bytes={SEGMENT + 5}-"]


@asynccontextmanager
async def reopened(bf: InProcess, **changes: Any) -> AsyncIterator[httpx.AsyncClient]:
    """Backfill started again on ``bf``'s data (no caches), and a client with its key."""
    backfill = build(bf.settings.model_copy(update=changes), engines=[])
    await backfill.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=backfill.app()),
            base_url="http://backfill.test",
            headers={"Authorization": f"Bearer {bf.key}"},
        ) as client:
            yield client
    finally:
        await backfill.stop()


def blob_path(bf: InProcess, file_id: str) -> Path:
    return bf.settings.data_dir / "blobs" / "files" / file_id


async def uploaded(bf: InProcess) -> str:
    response = await bf.upload(jsonl(ROWS))
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] > SEGMENT + 5
    file_id: str = response.json()["id"]
    return file_id


async def get(client: httpx.AsyncClient, file_id: str, range_: str | None) -> httpx.Response:
    headers = {"Range": range_} if range_ else {}
    return await client.get(f"/v1/files/{file_id}/content", headers=headers)


def assert_unreadable(response: httpx.Response) -> None:
    assert response.status_code == 500, (response.status_code, response.content[:200])
    assert response.headers["x-should-retry"] == "false"
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "content_unreadable", error
    assert error["type"] == "server_error"
    assert "content-range" not in response.headers


def flip(path: Path, position: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x01
    path.write_bytes(bytes(raw))


DAMAGE: dict[str, Callable[[Path], object]] = {
    "byte flipped in segment 0": lambda p: flip(p, HEADER + 5),
    "byte flipped in segment 1": lambda p: flip(p, HEADER + SEGMENT + TAG + 5),
    "wrapped data key tampered": lambda p: flip(p, HEADER - 3),
    "truncated by 5 bytes": lambda p: p.write_bytes(p.read_bytes()[:-5]),
    "truncated into the header": lambda p: p.write_bytes(p.read_bytes()[: HEADER // 2]),
    "deleted": lambda p: p.unlink(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_damaged_content_is_an_error_envelope(tmp_path: Path, sim: Sim, damage: str) -> None:
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        file_id = await uploaded(bf)
        DAMAGE[damage](blob_path(bf, file_id))
        # A restart, so no cache of the intact blob hides the damage.
        async with reopened(bf) as client:
            for range_ in RANGES:
                if damage == "byte flipped in segment 1" and range_ != RANGES[-1]:
                    # Damage past the first segment sent is found once the status is out: the
                    # connection then drops, and nothing false is sent. Not checked here.
                    continue
                response = await get(client, file_id, range_)
                if (damage, range_) == ("byte flipped in segment 0", RANGES[-1]):
                    assert response.status_code == 206  # the segments it needs are intact
                    continue
                assert_unreadable(response)
            if damage != "byte flipped in segment 1":
                head = await client.head(f"/v1/files/{file_id}/content")
                assert head.status_code == 500
                assert head.headers["x-should-retry"] == "false"


async def test_a_storage_outage_is_retryable(tmp_path: Path, sim: Sim) -> None:
    bucket = new_bucket()
    settings: dict[str, Any] = {
        "storage_url": f"s3://{bucket}/blobs",
        "s3_endpoint_url": moto_endpoint(),
        "s3_access_key_id": S3_CREDENTIALS["access_key_id"],
        "s3_secret_access_key": S3_CREDENTIALS["secret_access_key"],
        "master_key": base64.b64encode(os.urandom(32)).decode(),
    }
    async with in_process_backfill(tmp_path, sim[0], **settings) as bf:
        response = await bf.upload(jsonl(ROWS[:3]))
        assert response.status_code == 200, response.text
        file_id = response.json()["id"]
        # The object store stops answering: an outage, not damage to the file.
        elsewhere = bf.settings.s3.model_copy(
            update={"endpoint_url": f"http://127.0.0.1:{free_port()}"}
        )
        async with reopened(bf, s3=elsewhere) as client:
            response = await get(client, file_id, None)
        assert response.status_code == 503, response.text
        assert response.headers["x-should-retry"] == "true"
        assert response.json()["error"]["code"] == "storage_unavailable"
