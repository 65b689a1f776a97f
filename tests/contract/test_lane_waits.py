"""Why a lane's batches wait, through the store, on SQLite and PostgreSQL: the planner reads
which running batches have lines leased and each lane's credit gate, stores the lane's wait
with the rest of its plan, keeps its ``since`` while it holds, and every process reads it back
(``lane_waits``); an engine's hold is stored with its health report."""

from __future__ import annotations

from sqlalchemy import text

from backfill.adapters.db.store import SqlStore
from backfill.domain.catalog import Billing
from backfill.domain.engine_health import EngineHold, Hold
from backfill.domain.scheduling.planning import plan
from backfill.domain.waiting import LaneWait, WaitCode
from tests.contract.test_engine_health_store import report
from tests.contract.test_store import LEASE, NOW, make_batch, make_org


async def planned(store: SqlStore, now: float) -> None:
    """One planner pass at ``now``: read, plan, store."""
    await store.apply_plan(plan(await store.plan_inputs(), now, 0.1))


async def test_a_lane_with_no_lines_out_beside_one_that_has_some_waits_on_fair_share(
    store: SqlStore,
) -> None:
    first, second = await make_org(store), await make_org(store)
    await store.set_org_weight(second.id, 3)
    await make_batch(store, first, 50, model="shared")
    # The engines took the first org's lines before the second org's batch came.
    assert await store.claim(["shared"], 8, "t", NOW + LEASE, NOW)
    late = await make_batch(store, second, 50, model="shared")
    inputs = await store.plan_inputs()
    assert late.id not in inputs.leased
    assert len(inputs.leased) == 1
    await planned(store, NOW)
    expected = LaneWait(WaitCode.FAIR_SHARE, int(NOW), others=1, weight=3, total_weight=4)
    assert await store.lane_waits() == {("shared", second.id): expected}

    # Found again later: stored once, its since kept.
    await planned(store, NOW + 5)
    assert await store.lane_waits() == {("shared", second.id): expected}

    # Its lines go out: the wait is over at once (its lane was claimed from), and the next
    # pass clears it.
    claims = await store.claim(["shared"], 40, "t", NOW + LEASE, NOW + 6)
    assert {c.batch.org_id for c in claims} >= {second.id}
    assert await store.lane_waits() == {}
    await planned(store, NOW + 10)
    assert await store.lane_waits() == {}
    async with store.engine.connect() as conn:
        rows = (await conn.execute(text("SELECT waiting_code FROM lanes"))).all()
    assert [row.waiting_code for row in rows] == [None, None]


async def test_a_gpu_time_lane_of_an_org_without_credit_waits_on_credit(store: SqlStore) -> None:
    broke = await make_org(store)
    await make_batch(store, broke, 20, model="acme-llama", billing=Billing.GPU_TIME)
    # The claim's credit gate holds it: nothing is leased.
    assert await store.claim(["acme-llama"], 8, "t", NOW + LEASE, NOW) == []
    await planned(store, NOW)
    assert await store.lane_waits() == {
        ("acme-llama", broke.id): LaneWait(WaitCode.CREDIT, int(NOW), balance=0, lines=20)
    }
    # Credit: the next claim takes its lines, and the wait is over.
    await store.credit(broke.id, 10**12, "top up", int(NOW) + 1)
    assert await store.claim(["acme-llama"], 8, "t", NOW + LEASE, NOW + 2)
    assert await store.lane_waits() == {}
    await planned(store, NOW + 5)
    assert await store.lane_waits() == {}


async def test_an_engines_hold_is_stored_with_its_report(store: SqlStore) -> None:
    held = [
        report("w1", "vllm", hold=EngineHold(Hold.RATE_LIMITED, NOW - 3, NOW + 2, 429)),
        report("w2", "vllm", hold=EngineHold(Hold.INTERACTIVE_LOAD, NOW - 9)),
    ]
    await store.report_engines(held, NOW)
    assert await store.engine_reports(NOW) == held
