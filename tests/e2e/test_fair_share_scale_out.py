"""Weighted fair share decided in the claim, not per process: three worker processes on one
PostgreSQL database give orgs weighted 1:3 and 1:1 their shares of the requests served, and a
small batch submitted behind another org's 50,000-request backlog finishes about as fast as
its fair share allows.

Shares and times are counted from the receipts: each successful request's receipt carries the
time its worker finished it, so the windows below are exact, whatever the polling lag.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.support import Api, SimulatorProcess, chat_line, eventually, scale_out

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

BACKLOG = 50_000
HEAVY = 4_000
SMALL = 1_000


def named_rows(name: str, lines: int) -> list[dict[str, Any]]:
    return [chat_line(f"{name}-{i}", f"{name} {i}") for i in range(lines)]


async def finished_at(db: asyncpg.Connection, batch_id: str, nth: int) -> float | None:
    """When the batch's ``nth`` request (in finishing order) finished; None if not yet."""
    value = await db.fetchval(
        "SELECT created_at FROM receipts WHERE batch_id = $1 ORDER BY created_at OFFSET $2 LIMIT 1",
        batch_id,
        nth - 1,
    )
    return None if value is None else float(value)


async def served_between(db: asyncpg.Connection, batch_id: str, start: float, end: float) -> int:
    count = await db.fetchval(
        "SELECT count(*) FROM receipts WHERE batch_id = $1 AND created_at > $2"
        " AND created_at <= $3",
        batch_id,
        start,
        end,
    )
    return int(count)


async def wait_for(
    db: asyncpg.Connection, batch_id: str, nth: int, timeout_s: float = 120
) -> float:
    at = await eventually(
        lambda: finished_at(db, batch_id, nth),
        lambda at: at is not None,
        timeout_s,
        what=f"{batch_id} to reach {nth}",
        interval_s=0.05,
    )
    assert at is not None
    return at


async def test_three_workers_share_by_weight_and_a_small_batch_gets_its_share(
    tmp_path: Path, pg_url: str, fast_sim: SimulatorProcess
) -> None:
    db = await asyncpg.connect(pg_url)
    try:
        with scale_out(tmp_path, pg_url, fast_sim.base_url, workers=3) as port:
            await share_by_weight(db, Api(port))
    finally:
        await db.close()


async def share_by_weight(db: asyncpg.Connection, api: Api) -> None:
    light = await api.org("light", 1)
    heavy = await api.org("heavy", 3)
    late = await api.org("late", 1)

    # 1:3 while both have work: count each org's requests between the moment the heavy
    # batch exists and the moment 85% of it is done.
    backlog = await api.submit(light, named_rows("light", BACKLOG))
    big = await api.submit(heavy, named_rows("heavy", HEAVY))
    start = time.time()
    end = await wait_for(db, big, int(HEAVY * 0.85))
    got_light = await served_between(db, backlog, start, end)
    got_heavy = await served_between(db, big, start, end)
    share = got_heavy / (got_light + got_heavy)
    print(f"\nthree workers, weights 1:3: heavy's share {share:.3f} of {got_light + got_heavy}")
    assert got_light + got_heavy > HEAVY / 2
    assert abs(share - 0.75) <= 0.05, (got_light, got_heavy)

    # The heavy batch ends; the light backlog still holds tens of thousands of requests.
    await wait_for(db, big, HEAVY)
    submitted = time.time()
    small = await api.submit(late, named_rows("late", SMALL))
    done = await wait_for(db, small, SMALL)
    ahead = await served_between(db, backlog, submitted, done)
    assert await finished_at(db, backlog, BACKLOG) is None, "the backlog must outlast it"
    # At its fair share (1 of 1 + 1) the small batch needs 2 x SMALL of the model's
    # requests; it took what the model served from its submission to its last result.
    ratio = (ahead + SMALL) / (2 * SMALL)
    print(f"three workers: small batch took {ratio:.3f}x its fair-share time")
    assert ratio <= 1.2, (ahead, SMALL)
    # Equal weights while both ran: from its first result to 85% of them.
    first = await wait_for(db, small, 1)
    end = await wait_for(db, small, int(SMALL * 0.85))
    got_late = await served_between(db, small, first, end)
    got_light = await served_between(db, backlog, first, end)
    share = got_late / (got_late + got_light)
    print(f"three workers, weights 1:1: late's share {share:.3f} of {got_late + got_light}")
    assert abs(share - 0.5) <= 0.05, (got_late, got_light)
    await api.client.aclose()
