"""Storage and database faults inside the worker's request path (SPEC §9, §10.2).

Real faults, not fakes: the input blob of a running batch is deleted from the local store; the
local store's reads fail with EIO for a while; SQLite refuses to grow (SQLITE_FULL, the error a
full disk gives) while results are being stored. A request whose input is gone ends as an
error row; a request that hits a passing fault goes back to the queue and runs again later,
exactly once; nothing stays leased, and cancel does not wait on leases nobody works on.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text

from backfill.adapters.blobs.raw import LocalRawStore
from backfill.adapters.db import tables as t
from backfill.domain.lifecycle import ItemState
from tests.support import (
    InProcess,
    Sim,
    assert_exactly_once,
    backfill_on_raw_store,
    chat_line,
    eventually,
    in_process_backfill,
    jsonl,
)


def slow_rows(prefix: str, n: int, delay_ms: int, pad: int = 0) -> list[dict[str, Any]]:
    return [
        chat_line(f"{prefix}-{i:04d}", f"line {i} [[sim:delay_ms={delay_ms}]] " + "x" * pad)
        for i in range(n)
    ]


def spanning_rows(prefix: str, delay_ms: int) -> list[dict[str, Any]]:
    """About 3.6 MB: the input spans several encrypted segments, and the worker reads (and
    caches) each segment only when it reaches the first request stored in it, so a fault
    that starts after the first result is met by the requests of the later segments."""
    return slow_rows(prefix, 1200, delay_ms, pad=3000)


async def start_batch(bf: InProcess, rows: list[dict[str, Any]]) -> tuple[str, str]:
    uploaded = await bf.upload(jsonl(rows))
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    created = await bf.create(file_id)
    assert created.status_code == 200, created.text
    return file_id, created.json()["id"]


async def wait_for(bf: InProcess, batch_id: str, done: int, timeout_s: float = 30) -> None:
    """Until at least ``done`` requests of the batch have a result."""
    await eventually(
        lambda: bf.batch(batch_id),
        lambda b: b["request_counts"]["completed"] + b["request_counts"]["failed"] >= done,
        timeout_s,
        what=f"{batch_id} to reach {done} results",
        interval_s=0.02,
    )


async def item_states(bf: InProcess, batch_id: str) -> dict[int, int]:
    i = t.items
    async with bf.backfill.store.engine.connect() as conn:
        rows = await conn.execute(
            select(i.c.state, func.count()).where(i.c.batch_id == batch_id).group_by(i.c.state)
        )
        return {int(state): int(count) for state, count in rows.all()}


def held_by_worker(bf: InProcess, batch_id: str) -> set[int]:
    """The items of the batch that a task of the worker runs now or its backlog holds."""
    worker = bf.backfill.worker
    assert worker is not None
    return worker.held_leases().get(batch_id, set())


async def assert_released_not_wedged(bf: InProcess, batch_id: str) -> None:
    """While the fault lasts, failed requests go back to the queue with a backoff, and every
    lease of the batch belongs to a request the worker still works on."""
    i = t.items
    backing_off = 0
    for _ in range(20):
        before = held_by_worker(bf, batch_id)
        async with bf.backfill.store.engine.connect() as conn:
            leased = set(
                (
                    await conn.execute(
                        select(i.c.idx).where(
                            i.c.batch_id == batch_id, i.c.state == ItemState.LEASED
                        )
                    )
                ).scalars()
            )
            backing_off = (
                await conn.execute(
                    select(func.count())
                    .select_from(i)
                    .where(
                        i.c.batch_id == batch_id,
                        i.c.state == ItemState.QUEUED,
                        i.c.lease_until.is_not(None),
                    )
                )
            ).scalar_one()
        # A request that ended between the two reads is in ``before``; one claimed meanwhile
        # is in the second read: a lease in neither belongs to a task that is gone.
        wedged = leased - before - held_by_worker(bf, batch_id)
        assert not wedged, f"leased by no running request: {sorted(wedged)[:10]}"
        if backing_off:
            break
        await asyncio.sleep(0.05)
    assert backing_off, "no failed request went back to the queue with a backoff"


async def receipts_of(bf: InProcess, batch_id: str) -> int:
    r = t.receipts
    async with bf.backfill.store.engine.connect() as conn:
        query = select(func.count()).select_from(r).where(r.c.batch_id == batch_id)
        return int((await conn.execute(query)).scalar_one())


async def results(bf: InProcess, batch: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    return await bf.rows(batch["output_file_id"]), await bf.rows(batch["error_file_id"])


# ---- a permanent cause: the input blob is gone -----------------------------------------------


async def test_deleted_input_ends_each_request_with_an_error_row(tmp_path: Path, sim: Sim) -> None:
    rows = spanning_rows("gone", delay_ms=50)
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        file_id, batch_id = await start_batch(bf, rows)
        await wait_for(bf, batch_id, 1)
        (bf.settings.resolved_storage_path / "files" / file_id).unlink()

        batch = await bf.wait(batch_id, timeout_s=60)
        assert batch["status"] == "completed", batch
        out, err = await results(bf, batch)
        assert_exactly_once(rows, out, err)
        assert err, "the blob was deleted after every request had read its input"
        assert {row["error"]["code"] for row in err} == {"input_unavailable"}
        assert "could not be read" in err[0]["error"]["message"]
        counts = batch["request_counts"]
        assert counts == {"total": 1200, "completed": len(out), "failed": len(err)}
        assert await receipts_of(bf, batch_id) == len(out)
        assert await item_states(bf, batch_id) == {ItemState.DONE: 1200}


# ---- a passing cause: reads fail with EIO, then work again -----------------------------------


class FlakyReads(LocalRawStore):
    """The real local store, whose reads of the segments of ``failing`` fail with EIO."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failing: str | None = None
        self.failures = 0
        self.many_failures = asyncio.Event()

    def fail(self, key: str) -> None:
        self.failing = key
        self.failures = 0
        self.many_failures.clear()

    async def read(self, key: str, start: int, length: int) -> bytes:
        if key == self.failing and start > 0:
            self.failures += 1
            if self.failures >= 50:
                self.many_failures.set()
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return await super().read(key, start, length)


def flaky_backfill(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> AbstractAsyncContextManager[tuple[InProcess, FlakyReads]]:
    return backfill_on_raw_store(tmp_path, sim[0], monkeypatch, FlakyReads)


async def test_failing_reads_back_off_then_complete_exactly_once(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rows = spanning_rows("eio", delay_ms=5)
    async with flaky_backfill(tmp_path, sim, monkeypatch) as (bf, raw):
        file_id, batch_id = await start_batch(bf, rows)
        await wait_for(bf, batch_id, 1)
        with caplog.at_level(logging.WARNING, "backfill.runner"):
            raw.fail(f"files/{file_id}")
            await asyncio.wait_for(raw.many_failures.wait(), 30)
            await assert_released_not_wedged(bf, batch_id)
        raw.failing = None

        batch = await bf.wait(batch_id, timeout_s=60)
        assert batch["status"] == "completed", batch
        out, err = await results(bf, batch)
        assert_exactly_once(rows, out, err)
        assert err == []
        assert batch["request_counts"] == {"total": 1200, "completed": 1200, "failed": 0}
        assert await receipts_of(bf, batch_id) == 1200
        # One traceback per cause and batch, not one per request and attempt.
        tracebacks = [r for r in caplog.records if r.exc_info is not None]
        assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]


async def test_cancel_during_failing_reads_finishes(
    tmp_path: Path, sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = spanning_rows("cancel", delay_ms=5)
    async with flaky_backfill(tmp_path, sim, monkeypatch) as (bf, raw):
        file_id, batch_id = await start_batch(bf, rows)
        await wait_for(bf, batch_id, 1)
        raw.fail(f"files/{file_id}")
        await asyncio.wait_for(raw.many_failures.wait(), 30)
        cancelled = await bf.client.post(f"/v1/batches/{batch_id}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        # The fault lasts: cancel must not wait on requests that nobody works on.
        batch = await bf.wait(batch_id, timeout_s=bf.settings.worker.lease_s * 3)
        assert batch["status"] == "cancelled", batch
        out, err = await results(bf, batch)
        assert_exactly_once(rows, out, err)
        assert {row["error"]["code"] for row in err} == {"batch_cancelled"}
        assert await item_states(bf, batch_id) == {ItemState.DONE: 1200}


# ---- a passing database fault: SQLite cannot grow while results are stored --------------------


async def test_database_full_while_storing_results_completes_exactly_once(
    tmp_path: Path, sim: Sim
) -> None:
    rows = slow_rows("full", 300, delay_ms=20)
    async with in_process_backfill(tmp_path, sim[0]) as bf:
        _, batch_id = await start_batch(bf, rows)
        await wait_for(bf, batch_id, 1)
        engine = bf.backfill.store.engine
        # One pooled connection: the limit applies to every statement the store runs.
        async with engine.connect() as conn:
            pages = (await conn.execute(text("PRAGMA page_count"))).scalar_one()
            await conn.execute(text(f"PRAGMA max_page_count = {pages}"))
        await asyncio.sleep(1.0)
        during = (await bf.client.get(f"/v1/batches/{batch_id}")).json()
        async with engine.connect() as conn:
            await conn.execute(text("PRAGMA max_page_count = 1073741823"))
        counts = during["request_counts"]
        assert counts["completed"] < 300, "the database never filled up; make the lines longer"

        batch = await bf.wait(batch_id, timeout_s=60)
        assert batch["status"] == "completed", batch
        out, err = await results(bf, batch)
        assert_exactly_once(rows, out, err)
        assert err == []
        assert batch["request_counts"] == {"total": 300, "completed": 300, "failed": 0}
        assert await receipts_of(bf, batch_id) == 300
        assert await item_states(bf, batch_id) == {ItemState.DONE: 300}
