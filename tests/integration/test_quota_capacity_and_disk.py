"""Admission refusals that must not leak or mislead: the capacity 429 tells only the caller's
numbers and when to retry (not other orgs' queued volume), and a database out of disk answers
503 ``storage_unavailable`` (retryable) with nothing left behind (SPEC §4.1, §7.6, §10.1)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tests.support import (
    InProcess,
    chat_line,
    create_pg_database,
    drop_pg_database,
    in_process_backfill,
    jsonl,
    slow_sim_model,
    tmpfs,
)

NO_ENGINE_URL = "http://127.0.0.1:9/v1"


async def upload(bf: InProcess, rows: list[dict[str, Any]], headers: Any = None) -> str:
    response = await bf.client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", jsonl(rows), "application/jsonl")},
        headers=headers,
    )
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


async def create(bf: InProcess, file_id: str, window: str = "24h", headers: Any = None) -> Any:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    return await bf.client.post(
        "/v1/batches", json={**body, "completion_window": window}, headers=headers
    )


async def test_capacity_refusal_does_not_tell_other_orgs_queued_tokens(tmp_path: Path) -> None:
    slow = slow_sim_model()
    async with in_process_backfill(
        tmp_path, NO_ENGINE_URL, engines=[], models=[slow], min_completion_window_s=1
    ) as bf:
        tenants = bf.backfill.services.tenants
        await tenants.create_org("queued-org")
        await bf.backfill.services.billing.add_credit("queued-org", "100")
        their_key = await tenants.create_key("queued-org", frozenset({"inference:write"}))
        theirs = {"Authorization": f"Bearer {their_key}"}
        # The other org queues 13 x 7 = 91 output tokens of a 100 s window at 1 token/s.
        queued = await upload(bf, [chat_line(f"q{i}", max_tokens=7) for i in range(13)], theirs)
        assert (await create(bf, queued, "100s", theirs)).status_code == 200

        refused = await create(bf, await upload(bf, [chat_line("mine", max_tokens=16)]), "100s")
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "capacity_exceeded"
        assert "91" not in error["message"]
        assert "queued" not in error["message"]
        assert "16 output tokens" in error["message"]  # the caller's own number
        wait = int(refused.headers["retry-after"])
        assert wait > 0
        assert wait % 60 == 0
        assert f"{wait}s" in error["message"]


# ---- a database without disk -----------------------------------------------------------------


def storage_unavailable(response: Any) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["x-should-retry"] == "true"
    error = response.json()["error"]
    assert error["code"] == "storage_unavailable"
    assert "nothing was stored" in error["message"]


async def assert_nothing_left(bf: InProcess) -> None:
    assert (await bf.client.get("/v1/batches")).json()["data"] == []
    org = await bf.backfill.store.org_by_name("default")
    assert org is not None
    assert (await bf.backfill.store.ledger(org.id)).reserved == 0


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "tiny-db-fs", "4m") as mount_point:
        yield mount_point


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full."""
    with path.open("wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * 4096)


async def test_sqlite_out_of_disk_at_creation_is_503(tmp_path: Path, tiny_fs: Path) -> None:
    database = f"sqlite:///{tiny_fs / 'backfill.db'}"
    async with in_process_backfill(
        tmp_path, NO_ENGINE_URL, engines=[], database_url=database
    ) as bf:
        file_id = await upload(bf, [chat_line(f"l{i}") for i in range(200)])
        async with bf.backfill.store.engine.connect() as conn:
            # An empty WAL: the next write needs new disk space, not a reused WAL page.
            await conn.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))
        filler = tiny_fs / "filler"
        fill(filler)
        try:
            storage_unavailable(await create(bf, file_id))
            await assert_nothing_left(bf)
        finally:
            filler.unlink()
        again = await create(bf, file_id)
        assert again.status_code == 200, again.text


async def test_postgresql_disk_full_at_creation_is_503(tmp_path: Path) -> None:
    url = await create_pg_database()
    try:
        async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], database_url=url) as bf:
            file_id = await upload(bf, [chat_line("a")])
            engine = bf.backfill.store.engine
            async with engine.begin() as conn:
                # PostgreSQL's own "disk full" (SQLSTATE 53100), raised where a full disk
                # raises it: while the batch row is written.
                await conn.execute(
                    text(
                        "CREATE FUNCTION no_room() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION "
                        "'could not extend file: No space left on device' USING ERRCODE = "
                        "'disk_full'; END $$ LANGUAGE plpgsql"
                    )
                )
                await conn.execute(
                    text(
                        "CREATE TRIGGER no_room BEFORE INSERT ON batches "
                        "FOR EACH ROW EXECUTE FUNCTION no_room()"
                    )
                )
            storage_unavailable(await create(bf, file_id))
            await assert_nothing_left(bf)
            async with engine.begin() as conn:
                await conn.execute(text("DROP TRIGGER no_room ON batches"))
            again = await create(bf, file_id)
            assert again.status_code == 200, again.text
    finally:
        await drop_pg_database(url)
