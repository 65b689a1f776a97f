"""The retained-input limit holds at upload (SPEC §7.6): refused before the body is read when
it is spent, aborted mid-stream when an upload crosses it (nothing stored), and checked again
atomically when the file row is written, so concurrent uploads cannot both pass."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backfill.errors import RateLimited
from backfill.services.files import Upload
from tests.support import (
    InProcess,
    chat_line,
    create_pg_database,
    drop_pg_database,
    in_process_backfill,
    jsonl,
    running_simulator,
)

BOUNDARY = "quota-test-boundary"


class Body:
    """A multipart upload sent in chunks, counting how many chunks the server pulled."""

    def __init__(self, content: bytes, chunk: int = 64 * 1024) -> None:
        head = (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
            'filename="in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
        ).encode()
        tail = f"\r\n--{BOUNDARY}--\r\n".encode()
        parts = [content[i : i + chunk] for i in range(0, len(content), chunk)]
        self.chunks = [head, *parts, tail]
        self.pulled = 0

    async def stream(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.pulled += 1
            yield chunk


async def send(bf: InProcess, body: Body) -> Any:
    return await bf.client.post(
        "/v1/files",
        content=body.stream(),
        headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"},
    )


def stored_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def quota_error(response: Any, limit: int) -> str:
    assert response.status_code == 429, response.text
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["code"] == "retained_input_limit"
    assert f"the limit is {limit} bytes" in error["message"]
    message: str = error["message"]
    return message


def rows(prefix: str, n: int, padding: int = 40) -> bytes:
    return jsonl([chat_line(f"{prefix}{i:05d}", "lorem ipsum " * padding) for i in range(n)])


async def listed(bf: InProcess) -> list[str]:
    return [f["id"] for f in (await bf.client.get("/v1/files")).json()["data"]]


async def test_spent_quota_refuses_before_the_body_is_read(tmp_path: Path) -> None:
    first = rows("a", 3)
    async with (
        running_simulator() as (sim_url, _),
        in_process_backfill(tmp_path, sim_url, max_retained_input_bytes=len(first)) as bf,
    ):
        kept = await bf.upload(first)
        assert kept.status_code == 200, kept.text
        body = Body(rows("b", 1))
        quota_error(await send(bf, body), len(first))
        assert body.pulled == 0
        assert await listed(bf) == [kept.json()["id"]]

        # Deleting input frees the quota at once.
        assert (await bf.client.delete(f"/v1/files/{kept.json()['id']}")).status_code == 200
        assert (await send(bf, Body(rows("c", 1)))).status_code == 200


async def test_upload_crossing_the_quota_is_aborted_mid_stream(tmp_path: Path) -> None:
    limit = 100_000
    big = rows("big", 1200)  # about 700 KB in 64 KiB chunks
    async with (
        running_simulator() as (sim_url, _),
        in_process_backfill(tmp_path, sim_url, max_retained_input_bytes=limit) as bf,
    ):
        body = Body(big)
        quota_error(await send(bf, body), limit)
        assert body.pulled < len(body.chunks) // 2  # stopped near the limit, not at the end
        assert await listed(bf) == []
        assert stored_files(bf.settings.resolved_storage_path) == []  # no blob, no temp file

        fits = await bf.upload(rows("small", 10))
        assert fits.status_code == 200, fits.text


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_concurrent_uploads_cannot_both_pass_the_quota(tmp_path: Path, database: str) -> None:
    content = rows("c", 5)
    limit = len(content) * 3 // 2  # one fits, two do not
    url = await create_pg_database() if database == "postgresql" else ""
    try:
        async with (
            running_simulator() as (sim_url, _),
            in_process_backfill(
                tmp_path, sim_url, database_url=url, max_retained_input_bytes=limit
            ) as bf,
        ):
            files = bf.backfill.services.files
            org = await bf.backfill.store.org_by_name("default")
            assert org is not None
            # Both pass the check at the start and stream completely before either commits.
            uploads: list[Upload] = [await files.begin_upload(org.id) for _ in range(2)]
            for upload in uploads:
                await upload.feed(content)

            async def finish(upload: Upload) -> str:
                try:
                    return (await upload.finish("batch", None)).id
                except BaseException:
                    await upload.abort()
                    raise

            outcomes = await asyncio.gather(*map(finish, uploads), return_exceptions=True)
            kept = [o for o in outcomes if isinstance(o, str)]
            refusals = [o for o in outcomes if isinstance(o, RateLimited)]
            assert len(kept) == 1, outcomes
            assert len(refusals) == 1, outcomes
            assert refusals[0].code == "retained_input_limit"
            assert await listed(bf) == kept
            names = {p.name for p in stored_files(bf.settings.resolved_storage_path)}
            assert names == {kept[0], f"{kept[0]}.index"}
    finally:
        if url:
            await drop_pg_database(url)
