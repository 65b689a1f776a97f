"""Weighted fair share between orgs on one shared engine, through the API (SPEC §9.4): while two
orgs both have work, each gets its weight's share of the requests served; a small batch behind
another org's 50,000-request backlog finishes about as fast as its fair share allows. One
worker on SQLite; tests/e2e/test_fair_share_scale_out.py holds the same with three worker
processes on PostgreSQL.

Shares and times are measured in requests the model completed, never in seconds: a batch's
time at its fair share is its lines divided by its share of what the model served meanwhile.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backfill.domain.records import BatchRecord
from backfill.services.tenants import SCOPES
from tests.support import (
    FAST,
    STARTING_CREDIT_USD,
    InProcess,
    chat_line,
    eventually,
    in_process_backfill,
    jsonl,
    running_simulator,
)

TOKEN = "admin-token-for-fair-share-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Tenant:
    name: str
    headers: dict[str, str]


@dataclass
class Shared:
    """One Backfill, one engine, orgs ``default`` and ``other``."""

    bf: InProcess
    default: Tenant
    other: Tenant

    async def weigh(self, tenant: Tenant, weight: int) -> None:
        patched = await self.bf.client.patch(
            f"/admin/v1/orgs/{tenant.name}", json={"weight": weight}, headers=ADMIN
        )
        assert patched.status_code == 200, patched.text
        assert patched.json()["weight"] == weight

    async def submit(self, tenant: Tenant, lines: int, window: str = "24h") -> str:
        rows = [chat_line(f"{tenant.name}-{i}", f"{tenant.name} {i}") for i in range(lines)]
        uploaded = await self.bf.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", jsonl(rows), "application/jsonl")},
            headers=tenant.headers,
        )
        assert uploaded.status_code == 200, uploaded.text
        created = await self.bf.client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": window,
            },
            headers=tenant.headers,
        )
        assert created.status_code == 200, created.text
        batch_id: str = created.json()["id"]
        return batch_id

    async def batch(self, batch_id: str) -> BatchRecord:
        found = await self.bf.backfill.store.get_batch(None, batch_id)
        assert found is not None
        return found


def done(batch: BatchRecord) -> int:
    return batch.completed + batch.failed


@asynccontextmanager
async def shared_engine(tmp_path: Path, **overrides: Any) -> AsyncIterator[Shared]:
    async with (
        running_simulator(FAST) as (url, _),
        in_process_backfill(
            tmp_path, url, admin_token=TOKEN, plan_interval_s=0.2, **overrides
        ) as bf,
    ):
        services = bf.backfill.services
        await services.tenants.create_org("other")
        other_key = await services.tenants.create_key("other", SCOPES)
        await services.billing.add_credit("other", STARTING_CREDIT_USD)
        yield Shared(
            bf, Tenant("default", {}), Tenant("other", {"Authorization": f"Bearer {other_key}"})
        )


async def until_done(shared: Shared, batch_id: str, lines: int, timeout_s: float = 120) -> None:
    await eventually(
        lambda: shared.batch(batch_id),
        lambda batch: done(batch) >= lines,
        timeout_s,
        what=f"{lines} lines of {batch_id} done",
        interval_s=0.005,
    )


@pytest.mark.parametrize(("weight_a", "weight_b"), [(1, 1), (1, 3)])
async def test_while_both_orgs_have_work_each_gets_its_weighted_share(
    tmp_path: Path, weight_a: int, weight_b: int
) -> None:
    lines = 3000
    async with shared_engine(tmp_path) as shared:
        await shared.weigh(shared.default, weight_a)
        await shared.weigh(shared.other, weight_b)
        a = await shared.submit(shared.default, lines)
        b = await shared.submit(shared.other, lines)
        # From once the second has started: what the first claimed alone is out of the way.
        await until_done(shared, b, 100)
        start_a, start_b = done(await shared.batch(a)), done(await shared.batch(b))

        # Measure until the first of them is nearly done: both are active throughout.
        async def both() -> tuple[BatchRecord, BatchRecord]:
            return await shared.batch(a), await shared.batch(b)

        now_a, now_b = await eventually(
            both,
            lambda now: max(done(now[0]), done(now[1])) >= lines * 0.85,
            120,
            what="one of the batches nearly done",
            interval_s=0.005,
        )
        got_a, got_b = done(now_a) - start_a, done(now_b) - start_b
        share = got_a / (got_a + got_b)
        expected = weight_a / (weight_a + weight_b)
        print(f"\nweights {weight_a}:{weight_b}: share of a {share:.3f} (weight share {expected})")
        assert got_a + got_b > lines
        assert abs(share - expected) <= 0.05, (got_a, got_b)

        # The planner's view, as /metrics shows it: the same split over its last interval.
        scraped = (await shared.bf.client.get("/metrics")).text
        gauges = {
            org: float(value)
            for org, value in re.findall(
                r'backfill_dispatch_share\{model="sim-model",org="([^"]+)"\} (\S+)', scraped
            )
        }
        assert set(gauges) == {"default", "other"}, scraped
        assert abs(gauges["default"] - expected) <= 0.15, gauges


@pytest.mark.parametrize("weight", [1, 3])
async def test_a_small_batch_behind_a_50000_request_backlog_finishes_at_its_fair_share(
    tmp_path: Path, weight: int
) -> None:
    small = 600
    # Results are counted as they are stored: with commits of many results at once, each count
    # read below could be off by a whole commit's worth of the backlog's results (a few
    # percent of the share measured each); small commits make the count follow the engine.
    async with shared_engine(tmp_path, result_flush_s=0.005) as shared:
        await shared.weigh(shared.other, weight)
        big = await shared.submit(shared.default, 50_000)
        await until_done(shared, big, 1000)  # the backlog is draining steadily
        late = await shared.submit(shared.other, small)
        before = done(await shared.batch(big))
        await until_done(shared, late, small)
        after = await shared.batch(big)
        assert done(after) < 50_000, "the backlog must outlast the small batch"
        # While the small batch ran the model completed (after - before) + small requests; at
        # its fair share it would need small / share of them.
        served = done(after) - before + small
        fair = small * (1 + weight) / weight
        ratio = served / fair
        print(f"\nweight {weight}: small batch took {ratio:.3f}x its fair-share time")
        assert ratio <= 1.2, (served, fair)
