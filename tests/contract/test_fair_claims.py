"""Weighted fair share, deadline urgency and the planner's reads and writes, on SQLite and
PostgreSQL: the claim decides the shares, so every claimer of a database gets the same ones."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import bindparam, text

from backfill.adapters.clock import ManualClock
from backfill.adapters.db.claims import pick_sql
from backfill.adapters.db.migrate import alembic_config
from backfill.adapters.db.store import SqlStore
from backfill.domain.chunks import CHUNK_LINES
from backfill.domain.engine_health import EngineState
from backfill.domain.records import Org
from backfill.domain.scheduling.claim_model import LANES_PER_CLAIM
from backfill.domain.scheduling.planning import NOT_URGENT, LanePlan, ModelRate, Plan, plan
from backfill.errors import RateLimited
from backfill.services.planner import PLANNER, Planner
from tests.contract.test_engine_health_store import report
from tests.contract.test_store import (
    ADMIT_ALL,
    LEASE,
    NOW,
    STORE_URLS,
    make_batch,
    make_org,
    ok,
    take,
)
from tests.support import create_pg_database, drop_pg_database


async def weighted_org(store: SqlStore, weight: int) -> Org:
    org = await make_org(store)
    updated = await store.set_org_weight(org.id, weight)
    assert updated is not None
    assert (updated.id, updated.weight) == (org.id, weight)
    return updated


async def served_by_org(store: SqlStore, model: str, claims: int, limit: int) -> Counter[str]:
    """Lines each org got over ``claims`` claims of ``limit`` lines (leases left to run)."""
    served: Counter[str] = Counter()
    for _ in range(claims):
        for claim in await store.claim([model], limit, "t", NOW + LEASE, NOW):
            served[claim.batch.org_id] += len(claim.items)
    return served


async def test_a_weight_is_stored_and_read_back_with_the_org(store: SqlStore) -> None:
    org = await make_org(store, "acme")
    assert (await store.org_by_name("acme")) == dataclasses.replace(org, weight=1)
    await store.set_org_weight(org.id, 7)
    found = await store.org_by_name("acme")
    assert found is not None
    assert found.weight == 7
    assert await store.set_org_weight("org_nobody", 3) is None


@pytest.mark.parametrize(("light", "heavy"), [(1, 1), (1, 3), (2, 5)])
async def test_claims_follow_the_weights(store: SqlStore, light: int, heavy: int) -> None:
    a, b = await weighted_org(store, light), await weighted_org(store, heavy)
    await make_batch(store, a, 3000, model="shared")
    await make_batch(store, b, 3000, model="shared")
    # Small claims, as slots free up one by one: rounding must not favour either lane. (A
    # claim takes one chunk per lane, so one that meets a chunk's end comes back short.)
    served = await served_by_org(store, "shared", 150, 7)
    total = served[a.id] + served[b.id]
    assert total > 140 * 7
    assert abs(served[a.id] / total - light / (light + heavy)) < 0.01, served


async def test_a_weight_change_applies_to_the_next_claims(store: SqlStore) -> None:
    a, b = await make_org(store), await make_org(store)
    await make_batch(store, a, 3000, model="shared")
    await make_batch(store, b, 3000, model="shared")
    before = await served_by_org(store, "shared", 20, 10)
    assert before[a.id] == before[b.id] == 100
    await store.set_org_weight(b.id, 4)
    after = await served_by_org(store, "shared", 100, 10)
    assert abs(after[b.id] / (after[a.id] + after[b.id]) - 0.8) < 0.01, after


async def test_a_lane_that_reopens_starts_level_and_then_shares_by_weight(
    store: SqlStore,
) -> None:
    """The newcomer neither waits for the incumbent's history nor takes a burst."""
    big = await weighted_org(store, 1)
    await make_batch(store, big, 4000, model="shared")
    assert (await served_by_org(store, "shared", 30, 20))[big.id] > 500
    small = await weighted_org(store, 3)
    await make_batch(store, small, 2000, model="shared")
    served = await served_by_org(store, "shared", 20, 20)
    assert abs(served[small.id] / (served[small.id] + served[big.id]) - 0.75) < 0.02, served


@pytest.mark.parametrize("weight", [1, 3])
async def test_a_returning_lane_is_not_owed_its_own_history(store: SqlStore, weight: int) -> None:
    """An org that ran 2,000 lines, went idle, and comes back while another org (new to the
    model, so starting from nothing) drains: it moves in step by weight at once, not after
    the other has claimed what it once had (the 2026-12-05 review, M1)."""
    back, busy = await weighted_org(store, weight), await weighted_org(store, 1)
    history = await make_batch(store, back, 2000, model="shared")
    assert len(await take(store, history, 2000, "t", NOW + LEASE, NOW)) == 2000
    await make_batch(store, busy, 3000, model="shared")
    assert (await served_by_org(store, "shared", 5, 20))[busy.id] == 100
    await make_batch(store, back, 400, model="shared")
    served = await served_by_org(store, "shared", 20, 20)
    share = served[back.id] / (served[back.id] + served[busy.id])
    assert abs(share - weight / (weight + 1)) < 0.02, served


async def test_a_lane_that_stays_busy_keeps_its_place(store: SqlStore) -> None:
    """A second batch of an org whose lane still has ready work adds to that lane; the lane
    keeps its virtual time (only a lane with no ready work is levelled)."""
    a, b = await make_org(store), await make_org(store)
    await make_batch(store, a, 3000, model="shared")
    await make_batch(store, b, 3000, model="shared")
    await served_by_org(store, "shared", 10, 20)
    before = await vtimes(store)
    await make_batch(store, a, 500, model="shared")
    assert await vtimes(store) == before


async def vtimes(store: SqlStore) -> dict[str, float]:
    async with store.engine.connect() as conn:
        rows = (await conn.execute(text("SELECT org_id, vtime FROM lanes"))).all()
    return {row.org_id: row.vtime for row in rows}


async def test_urgent_lanes_are_served_first_earliest_deadline_first(store: SqlStore) -> None:
    calm, late, later = [await make_org(store) for _ in range(3)]
    await make_batch(store, calm, CHUNK_LINES * 4, model="shared")
    soon = await make_batch(store, late, CHUNK_LINES * 4, model="shared")
    after = await make_batch(store, later, CHUNK_LINES * 4, model="shared")
    # The calm lane is furthest behind in virtual time: without urgency it would go first.
    await store.claim(["shared"], 60, "t", NOW + LEASE, NOW)
    await store.apply_plan(
        Plan(
            rates=[],
            lanes=[
                LanePlan("shared", later.id, 40, 0.0, after.expires_at + 100),
                LanePlan("shared", late.id, 20, 0.0, soon.expires_at),
            ],
            estimates={},
        )
    )
    claims = await store.claim(["shared"], CHUNK_LINES + 50, "t", NOW + LEASE, NOW)
    got = Counter({c.batch.org_id: len(c.items) for c in claims})
    # The earliest deadline takes its whole chunk (what the first claim left of it), the
    # next the rest of the claim beyond that chunk's length.
    assert got[late.id] == CHUNK_LINES - 20
    assert got[later.id] == 50
    assert got[calm.id] == 0
    # Once the planner clears the marks (forgiving what the lanes ran ahead), they share again.
    before = {lane.org_id: lane.vtime for lane in (await store.plan_inputs()).lanes}
    await store.apply_plan(
        Plan(
            rates=[],
            lanes=[
                LanePlan("shared", later.id, 40, 0.0, NOT_URGENT, forgiven=50.0),
                LanePlan("shared", late.id, 20, 0.0, NOT_URGENT, forgiven=236.0),
            ],
            estimates={},
        )
    )
    levelled = {lane.org_id: lane.vtime for lane in (await store.plan_inputs()).lanes}
    assert levelled == {
        calm.id: before[calm.id],
        later.id: before[later.id] - 50,
        late.id: before[late.id] - 236,
    }
    assert len(set(levelled.values())) == 1  # level again: 20 lines each
    shared = await served_by_org(store, "shared", 10, 30)
    assert abs(shared[calm.id] - shared[later.id]) <= 30, shared


async def test_a_private_deployments_lane_never_reaches_a_catalog_engine(store: SqlStore) -> None:
    """Engines claim by the models they list: the deployment's lane, even urgent and far
    behind in virtual time, is claimed only for an engine that lists the deployment."""
    owner, other = await make_org(store), await make_org(store)
    private = await make_batch(store, owner, 50, model="acme-llama")
    mine = await make_batch(store, owner, 50, model="catalog-m")
    theirs = await make_batch(store, other, 50, model="catalog-m")
    await store.apply_plan(
        Plan([], [LanePlan("acme-llama", owner.id, 0, 0.0, private.expires_at)], {})
    )
    async with store.engine.begin() as conn:
        await conn.execute(text("UPDATE lanes SET vtime = -1000 WHERE model = 'acme-llama'"))
    catalog = [
        c for _ in range(10) for c in await store.claim(["catalog-m"], 30, "t", NOW + LEASE, NOW)
    ]
    assert {c.batch.id for c in catalog} == {mine.id, theirs.id}
    assert sum(len(c.items) for c in catalog) == 100
    deployment = await store.claim(["acme-llama"], 100, "t", NOW + LEASE, NOW)
    assert {c.batch.id for c in deployment} == {private.id}


async def test_the_planner_reads_what_claims_served_and_stores_its_plan(store: SqlStore) -> None:
    a, b = await weighted_org(store, 1), await weighted_org(store, 3)
    first = await make_batch(store, a, 2000, model="shared")
    await make_batch(store, b, 2000, model="shared")
    # The first look opens a measurement window: nothing served yet, work ready.
    await store.apply_plan(plan(await store.plan_inputs(), NOW, 0.1))
    done = await take(store, first, 10, "t", NOW + LEASE, NOW)
    assert await store.write_results([ok(item, "t") for item in done]) == [True] * 10
    claimed = sum((await served_by_org(store, "shared", 10, 40)).values())

    inputs = await store.plan_inputs()
    lanes = {lane.org_id: lane for lane in inputs.lanes}
    assert lanes[a.id].served + lanes[b.id].served == claimed + 10
    assert all(lane.ready and lane.served_mark == 0 for lane in inputs.lanes)
    remaining = {batch.org_id: batch.remaining for batch in inputs.running}
    assert set(remaining) == {a.id, b.id}
    assert sum(remaining.values()) == 4000 - 10
    assert {batch.org_id: batch.weight for batch in inputs.running} == {a.id: 1, b.id: 3}

    made = plan(inputs, NOW + 100, 0.1)
    await store.apply_plan(made)
    [rate] = made.rates
    assert rate.rps == pytest.approx((claimed + 10) / 100)  # busy throughout the 100 s
    after = await store.plan_inputs()
    assert after.rates == [rate]
    assert rate.served == claimed + 10
    assert {lane.org_id: lane.served_mark for lane in after.lanes} == {
        a.id: lanes[a.id].served,
        b.id: lanes[b.id].served,
    }
    shares = {s.org: s.share for s in await store.dispatch_shares()}
    assert shares[a.name] == pytest.approx(lanes[a.id].served / (claimed + 10))
    assert shares[a.name] + shares[b.name] == pytest.approx(1.0)
    estimates = {batch.id: batch.estimate for batch in after.running}
    assert estimates[first.id] == made.estimates[first.id] is not None
    got = await store.get_batch(None, first.id)
    assert got is not None
    assert got.estimated_completion_at == made.estimates[first.id]


async def test_an_older_plan_never_overwrites_a_newer_rate(store: SqlStore) -> None:
    await store.apply_plan(Plan([ModelRate("m", 5.0, NOW + 10, 0, True)], [], {}))
    await store.apply_plan(Plan([ModelRate("m", 9.0, NOW, 0, True)], [], {}))
    assert [r.rps for r in (await store.plan_inputs()).rates] == [5.0]


async def test_admission_refuses_what_the_measured_rate_cannot_finish(store: SqlStore) -> None:
    org = await make_org(store)
    aware = dataclasses.replace(ADMIT_ALL, deadline_aware=True)
    deadline = int(NOW) + 100  # created at NOW: a 100 s window
    # No rate yet: nothing is refused.
    await make_batch(store, org, 80, model="m", admission=aware, expires_at=deadline)
    await store.apply_plan(Plan([ModelRate("m", 1.0, NOW, 0, True)], [], {}))
    with pytest.raises(RateLimited) as refused:
        await make_batch(store, org, 21, model="m", admission=aware, expires_at=deadline)
    assert refused.value.code == "capacity_exceeded"
    assert "about 20 requests would fit" in refused.value.message
    await make_batch(store, org, 20, model="m", admission=aware, expires_at=deadline)
    # Another model, and a creation that does not ask, are not limited by it.
    await make_batch(store, org, 500, model="other", admission=aware, expires_at=deadline)
    await make_batch(store, org, 500, model="m", expires_at=deadline)


async def test_admission_counts_the_start_of_an_engine_on_standby(store: SqlStore) -> None:
    """The model's only engine runs on demand and is stopped: its learnt start (10 s, from
    the stored engine report) comes off the window before the rate is applied."""
    org = await make_org(store)
    aware = dataclasses.replace(ADMIT_ALL, deadline_aware=True)
    deadline = int(NOW) + 100
    await store.apply_plan(Plan([ModelRate("m", 1.0, NOW, 0, True)], [], {}))
    standby = report("w1", "chat", models=("m",), state=EngineState.STANDBY, start_s=10.0)
    await store.report_engines([standby], NOW)
    with pytest.raises(RateLimited) as refused:
        await make_batch(store, org, 91, model="m", admission=aware, expires_at=deadline)
    assert "its engine starts on demand first, in about 10 s" in refused.value.message
    await make_batch(store, org, 90, model="m", admission=aware, expires_at=deadline)


async def test_concurrent_claims_of_one_lane_add_up_their_virtual_time(store: SqlStore) -> None:
    org = await weighted_org(store, 4)
    batch = await make_batch(store, org, CHUNK_LINES * 8, model="shared")
    await asyncio.gather(
        *(store.claim(["shared"], 100, f"t{n}", NOW + LEASE, NOW) for n in range(6))
    )
    async with store.engine.connect() as conn:
        served, vtime = (await conn.execute(text("SELECT served, vtime FROM lanes"))).one()
    leased = await take(store, batch, CHUNK_LINES * 8, "u", NOW + LEASE, NOW)
    assert served + len(leased) == CHUNK_LINES * 8  # every line claimed once
    assert served > 400
    assert vtime == pytest.approx(served / 4)


async def test_the_pick_reads_lanes_through_their_turn_index_and_never_lines(
    store: SqlStore,
) -> None:
    """The claim's cost does not grow with the lines queued or done: lanes come through
    ix_lanes_turn (model, urgent_by, vtime), chunks through their index, no line is read."""
    for _ in range(5):
        await make_batch(store, await make_org(store), 600, model="shared")
    sql = pick_sql(store.dialect)
    params = {"models": ["shared"], "now": NOW, "k": LANES_PER_CLAIM, "lanes": 16}
    async with store.engine.connect() as conn:
        if store.is_sqlite:
            explain = text("EXPLAIN QUERY PLAN " + sql)
        else:
            await conn.execute(text("SET enable_seqscan = off"))
            explain = text("EXPLAIN " + sql)
        rows = await conn.execute(explain.bindparams(bindparam("models", expanding=True)), params)
        plan_text = " ".join(str(row[-1] if store.is_sqlite else row[0]) for row in rows)
    assert "ix_lanes_turn" in plan_text, plan_text
    assert "ix_chunks_ready" in plan_text, plan_text
    assert "items" not in plan_text, plan_text


@pytest.fixture(params=sorted(STORE_URLS))
async def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    url = STORE_URLS[request.param](tmp_path) or await create_pg_database()
    try:
        yield url
    finally:
        if request.param == "postgresql":
            await drop_pg_database(url)


async def test_the_upgrade_keeps_lanes_where_they_stood(empty_url: str) -> None:
    """v0006 on a database holding v0005 lanes: every org weighs 1, and a lane's virtual time
    is what it was served, so the turn order is unchanged."""
    made = SqlStore(empty_url)
    try:
        async with made.engine.begin() as conn:
            await conn.run_sync(lambda c: command.upgrade(alembic_config(c), "0005"))
            await conn.execute(
                text("INSERT INTO orgs (id, name, created_at) VALUES ('org_a', 'a', 1)")
            )
            await conn.execute(
                text(
                    "INSERT INTO lanes (model, org_id, metered, served, ready)"
                    " VALUES ('m', 'org_a', false, 7, 1)"
                )
            )
        await made.init()
        org = await made.org_by_name("a")
        assert org is not None
        assert org.weight == 1
        async with made.engine.connect() as conn:
            row = (
                await conn.execute(text("SELECT vtime, served_mark, urgent_by, share FROM lanes"))
            ).one()
        assert tuple(row) == (7.0, 7, NOT_URGENT, 0.0)
    finally:
        await made.close()


async def test_an_idle_planner_stores_nothing_and_takes_no_lease(store: SqlStore) -> None:
    """With no work anywhere a pass is reads alone; with work it takes the lease to store its
    plan, and a planner of another process then waits for that lease."""
    clock = ManualClock(NOW)
    mine, theirs = (Planner(store, clock, interval_s=5, margin_fraction=0.1) for _ in range(2))
    assert await mine.plan() == Plan([], [], {})
    # The lease is free: another process's planner takes it.
    assert await store.take_singleton(PLANNER, theirs.holder, NOW + 15, NOW)
    assert await mine.plan() == Plan([], [], {})  # nothing to store, so no lease needed
    await make_batch(store, await make_org(store), 10, model="m")
    assert await mine.plan() is None  # a plan to store, but the lease is theirs
    made = await theirs.plan()
    assert made is not None
    assert not made.empty
