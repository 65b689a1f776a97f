"""Pause and resume under load, across two worker processes on one PostgreSQL database: while
paused, no worker starts a line of the batch (its lines in flight finish, and lines that come
back wait); resumed, it goes on; after three pauses every line ran exactly once, each with one
receipt, and the batch's charge is the sum of its receipts. A priority-9 batch of the same org
submitted while the first is paused runs meanwhile."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.support import Api, SimulatorProcess, chat_line, eventually, scale_out

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LINES = 3_000


async def receipts(db: asyncpg.Connection, batch_id: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM receipts WHERE batch_id = $1", batch_id))


async def leased(db: asyncpg.Connection, batch_id: str) -> int:
    count = await db.fetchval(
        "SELECT count(*) FROM items WHERE batch_id = $1 AND state = 1", batch_id
    )
    return int(count)


async def completed(api: Api, headers: dict[str, str], batch_id: str) -> None:
    async def read() -> dict[str, Any]:
        return await api.batch(headers, batch_id)

    await eventually(read, lambda b: b["status"] == "completed", timeout_s=60, what=batch_id)


async def test_pause_and_resume_across_two_workers_lose_and_repeat_nothing(
    tmp_path: Path, pg_url: str, fast_sim: SimulatorProcess
) -> None:
    db = await asyncpg.connect(pg_url)
    try:
        with scale_out(tmp_path, pg_url, fast_sim.base_url, workers=2) as port:
            await pause_three_times(db, Api(port))
    finally:
        await db.close()


async def pause_three_times(db: asyncpg.Connection, api: Api) -> None:
    org = await api.org("acme", 1)
    rows = [chat_line(f"r{i}", f"line {i} [[sim:delay_ms=15]]") for i in range(LINES)]
    batch_id = await api.submit(org, rows)

    async def served() -> int:
        return await receipts(db, batch_id)

    for cycle in range(3):
        enough = (cycle + 1) * 400
        ran = await eventually(served, lambda n: n >= 400, timeout_s=60, what="it runs")
        while ran < enough:
            await asyncio.sleep(0.05)
            ran = await served()
        paused = await api.client.post(f"/v1/batches/{batch_id}/pause", headers=org)
        assert paused.status_code == 200, paused.text
        assert paused.json()["waiting_on"]["code"] == "paused"
        # Its lines in flight finish; then nothing of it starts, on either worker.
        await eventually(lambda: leased(db, batch_id), lambda n: n == 0, what="in-flight lines end")
        held = await receipts(db, batch_id)
        if cycle == 0:
            # The same org's priority-9 batch runs while the first waits.
            urgent = await api.submit(
                org, [chat_line(f"p{i}", f"urgent {i}") for i in range(50)], priority=9
            )

            await completed(api, org, urgent)
        await asyncio.sleep(1.0)
        assert await receipts(db, batch_id) == held, "a paused batch ran a line"
        assert await leased(db, batch_id) == 0
        assert held < LINES
        resumed = await api.client.post(f"/v1/batches/{batch_id}/resume", headers=org)
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["paused_at"] is None

    done = await eventually(
        lambda: api.batch(org, batch_id),
        lambda b: b["status"] == "completed",
        timeout_s=120,
        what="the batch completes",
    )
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    # Each line once: one receipt, one output row.
    assert await receipts(db, batch_id) == LINES
    distinct = await db.fetchval(
        "SELECT count(DISTINCT idx) FROM receipts WHERE batch_id = $1", batch_id
    )
    assert distinct == LINES
    out = await api.rows(org, done["output_file_id"])
    assert sorted(r["custom_id"] for r in out) == sorted(f"r{i}" for i in range(LINES))
    charged = await db.fetchval("SELECT charged FROM batches WHERE id = $1", batch_id)
    billed = await db.fetchval(
        "SELECT coalesce(sum(amount), 0) FROM receipts WHERE batch_id = $1", batch_id
    )
    assert charged == billed
    # Nothing of either batch is left in the queue.
    assert await db.fetchval("SELECT count(*) FROM chunks") == 0
    await api.client.aclose()
