"""A stored file damaged on disk or in the bucket: every kind of damage is an error envelope
before the first byte where it can be found there, a dropped connection short of the
Content-Length where it can only be found mid-stream, and each finding is logged with the
file's id (never its content) and counted in ``backfill_stored_file_damaged_total``."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import uvicorn

from backfill.adapters.blobs.crypto import HEADER, SEGMENT, TAG
from backfill.adapters.http import download
from backfill.adapters.http.server import server_config
from backfill.container import build
from tests.support import (
    S3_CREDENTIALS,
    InProcess,
    Sim,
    chat_line,
    eventually,
    free_port,
    in_process_backfill,
    jsonl,
    moto_endpoint,
    new_bucket,
)

# Two segments of content: damage in the second is past the first segment sent.
MARKER = "q" * 900
ROWS = [chat_line(f"row-{i}", MARKER) for i in range(1300)]
CONTENT = jsonl(ROWS)
STORAGES = ["local", "s3"]


@dataclass
class Stored:
    """Raw access to one blob, on disk or in the bucket, as someone with storage access."""

    read: Callable[[], bytes]
    write: Callable[[bytes], object]
    delete: Callable[[], object]


def s3_settings() -> dict[str, Any]:
    return {
        "storage_url": f"s3://{new_bucket()}/blobs",
        "s3_endpoint_url": moto_endpoint(),
        "s3_access_key_id": S3_CREDENTIALS["access_key_id"],
        "s3_secret_access_key": S3_CREDENTIALS["secret_access_key"],
        "master_key": base64.b64encode(os.urandom(32)).decode(),
    }


@asynccontextmanager
async def on_storage(tmp_path: Path, sim: Sim, storage: str) -> AsyncIterator[InProcess]:
    settings = s3_settings() if storage == "s3" else {}
    async with in_process_backfill(tmp_path, sim[0], **settings) as bf:
        yield bf


def stored(bf: InProcess, file_id: str) -> Stored:
    url = bf.settings.storage_url
    if not url.startswith("s3://"):
        path = bf.settings.data_dir / "blobs" / "files" / file_id
        return Stored(path.read_bytes, path.write_bytes, path.unlink)
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    key = f"{prefix}/files/{file_id}"
    client = boto3.client(
        "s3",
        endpoint_url=bf.settings.s3.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=S3_CREDENTIALS["access_key_id"],
        aws_secret_access_key=S3_CREDENTIALS["secret_access_key"],
    )

    def read() -> bytes:
        body: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        return body

    return Stored(
        read,
        lambda data: client.put_object(Bucket=bucket, Key=key, Body=data),
        lambda: client.delete_object(Bucket=bucket, Key=key),
    )


def flipped(raw: bytes, position: int) -> bytes:
    changed = bytearray(raw)
    changed[position] ^= 0x01
    return bytes(changed)


SECOND_SEGMENT = HEADER + SEGMENT + TAG + 5
# How each kind is made, and the kind it is counted as.
DAMAGE: dict[str, tuple[str, Callable[[Stored], object]]] = {
    "byte flipped in the second segment": (
        "segment",
        lambda s: s.write(flipped(s.read(), SECOND_SEGMENT)),
    ),
    "byte flipped in the first segment": (
        "segment",
        lambda s: s.write(flipped(s.read(), HEADER + 5)),
    ),
    "wrapped data key tampered": ("header", lambda s: s.write(flipped(s.read(), HEADER - 3))),
    "cut inside the last segment's tag": (
        "truncated",
        lambda s: s.write(s.read()[: HEADER + SEGMENT + TAG + 5]),
    ),
    "5 bytes short": ("size_mismatch", lambda s: s.write(s.read()[:-5])),
    "deleted": ("missing", lambda s: s.delete()),
}


async def uploaded(bf: InProcess) -> str:
    response = await bf.upload(CONTENT)
    assert response.status_code == 200, response.text
    assert SEGMENT + 5 < response.json()["bytes"] <= 2 * SEGMENT
    file_id: str = response.json()["id"]
    return file_id


def damaged_count(metrics_text: str, kind: str) -> float:
    match = re.search(
        rf'^backfill_stored_file_damaged_total{{kind="{kind}"}} (\S+)$', metrics_text, re.M
    )
    return float(match.group(1)) if match else 0.0


async def counted(client: httpx.AsyncClient, kind: str) -> float:
    return damaged_count((await client.get("/metrics")).text, kind)


def assert_damaged_envelope(response: httpx.Response) -> None:
    assert response.status_code == 500, (response.status_code, response.content[:200])
    assert response.headers["x-should-retry"] == "false"
    assert "content-range" not in response.headers
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "content_unreadable", error
    assert error["type"] == "server_error"


def assert_logged_without_content(caplog: pytest.LogCaptureFixture, file_id: str) -> None:
    messages = [record.getMessage() for record in caplog.records]
    assert any(file_id in m for m in messages), messages
    for message in messages:
        assert MARKER[:20] not in message, message
        assert "row-" not in message, message


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_each_kind_of_damage_is_an_envelope_logged_and_counted(
    tmp_path: Path, sim: Sim, storage: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    kind, make = DAMAGE[damage]
    async with on_storage(tmp_path, sim, storage) as bf:
        file_id = await uploaded(bf)
        make(stored(bf, file_id))
        before = await counted(bf.client, kind)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            # The second segment is checked before the status line too: a two-segment file
            # is authenticated whole, so no request of it gets a 200 cut short.
            for range_ in (None, "bytes=0-", "bytes=-400000", f"bytes={SEGMENT + 5}-"):
                headers = {"Range": range_} if range_ else {}
                response = await bf.client.get(f"/v1/files/{file_id}/content", headers=headers)
                if (
                    damage == "byte flipped in the first segment"
                    and range_ == f"bytes={SEGMENT + 5}-"
                ):
                    assert response.status_code == 206  # it needs the second segment only
                    continue
                assert_damaged_envelope(response)
            head = await bf.client.head(f"/v1/files/{file_id}/content")
        assert head.status_code == 500
        after = await counted(bf.client, kind)
    found = 4 if damage == "byte flipped in the first segment" else 5
    assert after - before == found
    assert_logged_without_content(caplog, file_id)


@pytest.mark.parametrize("storage", STORAGES)
async def test_a_damaged_output_file_is_an_envelope(
    tmp_path: Path, sim: Sim, storage: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with on_storage(tmp_path, sim, storage) as bf:
        batch = await bf.run_batch([chat_line("a"), chat_line("b")])
        output_id = batch["output_file_id"]
        blob = stored(bf, output_id)
        blob.write(flipped(blob.read(), HEADER + 3))
        with caplog.at_level(logging.INFO):
            response = await bf.client.get(f"/v1/files/{output_id}/content")
        assert_damaged_envelope(response)
        assert await counted(bf.client, "segment") == 1
    assert_logged_without_content(caplog, output_id)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("storage", STORAGES)
async def test_a_restored_file_is_served_again_without_a_restart(
    tmp_path: Path, sim: Sim, storage: str, damage: str
) -> None:
    """Whatever the damage was, once the operator restores the blob it is served: nothing
    cached of the damaged one (its header, its size) outlives it."""
    async with on_storage(tmp_path, sim, storage) as bf:
        file_id = await uploaded(bf)
        blob = stored(bf, file_id)
        backup = blob.read()
        DAMAGE[damage][1](blob)
        assert_damaged_envelope(await bf.client.get(f"/v1/files/{file_id}/content"))
        blob.write(backup)  # what the operator does: restore the blob from a backup
        response = await bf.client.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 200
        assert response.content == CONTENT


# ---- damage found only once the status line is out ---------------------------------------


@asynccontextmanager
async def served(bf: InProcess) -> AsyncIterator[int]:
    """Backfill on ``bf``'s data behind the real HTTP server (uvicorn, as ``backfill serve``
    runs it); yields its port."""
    port = free_port()
    settings = bf.settings.model_copy(update={"host": "127.0.0.1", "port": port})
    server = uvicorn.Server(server_config(build(settings, engines=[]).app(), settings))
    task = asyncio.create_task(server.serve())

    async def started() -> bool:
        assert not task.done(), "the server did not start"
        return bool(server.started)

    try:
        await eventually(started, what="the server to start", interval_s=0.02)
        yield port
    finally:
        server.should_exit = True
        await task


def raw_get(port: int, key: str, file_id: str, range_: str | None) -> tuple[bytes, bytes]:
    """The head and body a client reading to the end of the connection gets."""
    request = (
        f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: backfill.test\r\n"
        f"Authorization: Bearer {key}\r\n" + (f"Range: {range_}\r\n" if range_ else "") + "\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(request.encode())
        received = b""
        while chunk := conn.recv(1 << 16):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return head, body


def header(head: bytes, name: str) -> str | None:
    for line in head.decode().split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name:
            return value.strip()
    return None


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("range_", [None, "bytes=10-", "bytes=-400000"])
async def test_damage_found_mid_stream_drops_the_connection_short(
    tmp_path: Path,
    sim: Sim,
    storage: str,
    range_: str | None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Only the first segment is checked before the status line, as for a file longer than
    # VERIFY_BEFORE_STATUS_BYTES: the damaged second one is found while the body streams.
    monkeypatch.setattr(download, "VERIFY_BEFORE_STATUS_BYTES", 0)
    async with on_storage(tmp_path, sim, storage) as bf:
        file_id = await uploaded(bf)
        blob = stored(bf, file_id)
        blob.write(flipped(blob.read(), SECOND_SEGMENT))
        async with served(bf) as port:
            with caplog.at_level(logging.INFO):
                head, body = await asyncio.to_thread(raw_get, port, bf.key, file_id, range_)
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {bf.key}"},
            ) as client:
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.get(f"/v1/files/{file_id}/content")
                metrics = (await client.get("/metrics")).text
    assert head.startswith(b"HTTP/1.1 20"), head
    assert header(head, "transfer-encoding") is None, "never a chunked body that ends cleanly"
    length = header(head, "content-length")
    assert length is not None
    # The connection ended short of the promised length, and what came is all true bytes.
    start = len(CONTENT) - 400000 if range_ == "bytes=-400000" else 10 if range_ else 0
    assert len(body) < int(length)
    assert body == CONTENT[start : start + len(body)]
    assert damaged_count(metrics, "segment") == 2
    cut = [r.getMessage() for r in caplog.records if "cut after" in r.getMessage()]
    assert cut, "the cut download is logged"
    assert file_id in cut[0], cut
    assert_logged_without_content(caplog, file_id)


async def test_a_long_file_is_checked_before_the_status_line_up_to_the_limit(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with on_storage(tmp_path, sim, "local") as bf:
        file_id = await uploaded(bf)
        blob = stored(bf, file_id)
        blob.write(flipped(blob.read(), SECOND_SEGMENT))
        # A span longer than the limit: damage past the first segment is not looked for
        # before the status line (the in-process client then sees the response unfinished).
        monkeypatch.setattr(download, "VERIFY_BEFORE_STATUS_BYTES", SEGMENT)
        with pytest.raises(AssertionError):
            await bf.client.get(f"/v1/files/{file_id}/content")
        # A range within the limit is checked whole: an envelope.
        response = await bf.client.get(
            f"/v1/files/{file_id}/content", headers={"Range": f"bytes={SEGMENT - 10}-"}
        )
        assert_damaged_envelope(response)
