"""``OverviewStore`` on every backend: an org by id and its credit, its ledger entries, its
batches' charges, a batch's failed lines, orgs with their credit, the queue by model."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from sqlalchemy import case, event, text, update

from backfill.adapters.db import tables as t
from backfill.adapters.db.store import SqlStore
from backfill.domain.catalog import Billing
from backfill.domain.engine_health import EngineReport, EngineState
from backfill.domain.lifecycle import BatchStatus, Outcome
from backfill.domain.overview import BatchCharges, EntryKind, LedgerEntry, OrgAccount
from backfill.domain.records import Admission, Org, Receipt, ReceiptKind
from backfill.domain.scheduling.planning import ModelRate, Plan
from backfill.errors import InvalidInput
from tests.contract.test_store import LEASE, NOW, bad, make_batch, make_org, ok, take

RESERVE = 10**12
CREDIT = 10**15


def reserving(reserve: int = RESERVE) -> Admission:
    return Admission(
        reserve=reserve,
        require_positive_balance=False,
        max_unfinished=1000,
        max_retained_input_bytes=1 << 40,
        throughput_tokens_per_s=None,
    )


async def test_orgs_are_found_by_id(store: SqlStore) -> None:
    org = await make_org(store)
    assert await store.org_by_id(org.id) == org
    assert await store.org_by_id("org_unknown") is None


async def test_ledger_entries_are_credits_and_catalog_batches_newest_first(
    store: SqlStore,
) -> None:
    # A batch's place is its listing key (the wall clock when its row was written), a
    # credit's the second it was added in: credits here are dated around the real now.
    now = int(time.time())
    org = await make_org(store)
    first = await store.credit(org.id, CREDIT, "first", now - 100)
    assert first.credits == CREDIT
    batch = await make_batch(
        store, org, 3, admission=reserving(), created_at=int(NOW), model="m", price_input=1
    )
    # A batch that holds nothing and was charged nothing is no entry.
    await make_batch(store, org, 1, created_at=int(NOW) + 1)
    await store.credit(org.id, 2 * CREDIT, None, now + 100)

    page = await store.ledger_entries(org.id, None, 10)
    assert [(e.kind, e.id == batch.id) for e in page.items] == [
        (EntryKind.CREDIT, False),
        (EntryKind.BATCH, True),
        (EntryKind.CREDIT, False),
    ]
    newest, charge, oldest = page.items
    assert newest.amount == 2 * CREDIT
    assert newest.note is None
    assert charge.amount == 0
    assert charge.reserved == RESERVE
    assert charge.status == BatchStatus.IN_PROGRESS
    assert charge.model == "m"
    assert charge.created_at == int(NOW)  # shown as created, placed by its listing key
    assert oldest.note == "first"
    assert page.has_more is False
    assert await paged_one_by_one(store, org.id) == page.items


async def paged_one_by_one(store: SqlStore, org_id: str) -> list[LedgerEntry]:
    """Every entry, a page of one at a time, each page's last id the next cursor."""
    seen: list[LedgerEntry] = []
    after = None
    while True:
        one = await store.ledger_entries(org_id, after, 1)
        seen += one.items
        if not one.has_more:
            return seen
        after = one.items[-1].id


async def test_ledger_pages_hold_every_entry_once_in_order(store: SqlStore) -> None:
    now = int(time.time())
    org = await make_org(store)
    await store.credit(org.id, 10 * CREDIT, "start", now - 2000)
    made: list[str] = []
    for i in range(4):
        batch = await make_batch(store, org, 1, admission=reserving(), price_input=1)
        made.append(batch.id)
        # A GPU-time batch and an uncharged one between them are no entries.
        await make_batch(store, org, 1, admission=reserving(), billing=Billing.GPU_TIME)
        await make_batch(store, org, 1)
        # Credits in the same second as each other: their ids break the tie.
        await store.credit(org.id, CREDIT, f"top-up {i}", now - 1000)
    everything = (await store.ledger_entries(org.id, None, 100)).items
    assert len(everything) == 9
    assert [e.id for e in everything[:4]] == made[::-1]
    top_ups = [e.id for e in everything[4:8]]
    assert top_ups == sorted(top_ups, reverse=True)
    assert everything[-1].note == "start"
    assert await paged_one_by_one(store, org.id) == everything
    for size in (2, 3, 5):
        seen: list[LedgerEntry] = []
        after = None
        while True:
            page = await store.ledger_entries(org.id, after, size)
            seen += page.items
            if not page.has_more:
                break
            after = page.items[-1].id
        assert seen == everything, size


async def test_ledger_entries_stay_within_their_org(store: SqlStore) -> None:
    ours, theirs = await make_org(store), await make_org(store)
    await store.credit(ours.id, CREDIT, "ours", int(NOW))
    await store.credit(theirs.id, CREDIT, "theirs", int(NOW))
    their_batch = await make_batch(store, theirs, 1, admission=reserving())
    entries = (await store.ledger_entries(ours.id, None, 10)).items
    assert [e.note for e in entries] == ["ours"]
    their_entries = (await store.ledger_entries(theirs.id, None, 10)).items
    assert their_batch.id in {e.id for e in their_entries}
    for entry in their_entries:
        with pytest.raises(InvalidInput) as refused:
            await store.ledger_entries(ours.id, entry.id, 10)
        assert refused.value.param == "after"
    with pytest.raises(InvalidInput):
        await store.ledger_entries(ours.id, "x" * 500, 10)


async def test_org_credits_page_oldest_first_with_balances(store: SqlStore) -> None:
    made: list[Org] = []
    for i in range(3):
        org = await make_org(store)
        made.append(org)
        await store.credit(org.id, (i + 1) * CREDIT, None, int(NOW))
    await make_batch(store, made[1], 1, admission=reserving())
    everything = (await store.org_credits(None, 10)).items
    assert sorted(c.org.id for c in everything) == sorted(o.id for o in made)
    by_id = {c.org.id: c for c in everything}
    assert by_id[made[0].id].balance == CREDIT
    assert by_id[made[1].id].reserved == RESERVE
    assert by_id[made[1].id].available == 2 * CREDIT - RESERVE

    seen = []
    after = None
    while True:
        page = await store.org_credits(after, 2)
        seen += [c.org.id for c in page.items]
        if not page.has_more:
            break
        after = page.items[-1].org.id
    assert seen == [c.org.id for c in everything]
    with pytest.raises(InvalidInput) as refused:
        await store.org_credits("org_unknown", 2)
    assert refused.value.param == "after"


async def test_queue_by_model_counts_unfinished_batches(store: SqlStore) -> None:
    assert await store.queue_by_model() == []
    org = await make_org(store)
    await make_batch(store, org, 4, model="alpha")
    await make_batch(store, org, 2, model="alpha", status=BatchStatus.VALIDATING)
    await make_batch(store, org, 5, model="beta", status=BatchStatus.COMPLETED)
    await make_batch(store, org, 3, model="beta", status=BatchStatus.CANCELLING)
    queue = {q.model: q for q in await store.queue_by_model()}
    assert set(queue) == {"alpha", "beta"}
    assert (queue["alpha"].batches, queue["alpha"].in_progress) == (2, 1)
    assert queue["alpha"].remaining == 6
    assert (queue["beta"].batches, queue["beta"].in_progress, queue["beta"].remaining) == (1, 0, 3)
    assert queue["alpha"].requests_per_s is None


async def test_demand_inputs_are_the_queued_batches_rates_per_replica_and_engine_rows(
    store: SqlStore,
) -> None:
    empty = await store.demand_inputs()
    assert (list(empty.queued), dict(empty.per_replica), list(empty.engines)) == ([], {}, [])
    org = await make_org(store)
    running = await make_batch(store, org, 4, model="alpha", output_token_bound=400)
    await make_batch(
        store, org, 2, model="alpha", status=BatchStatus.VALIDATING, output_token_bound=100
    )
    await make_batch(store, org, 5, model="beta", status=BatchStatus.COMPLETED)
    await make_batch(store, org, 3, model="beta", status=BatchStatus.CANCELLING)
    async with store.engine.begin() as conn:
        await conn.execute(
            update(t.files)
            .where(t.files.c.id == running.input_file_id)
            .values(prompt_token_bound=200)
        )
    [item] = await take(store, running, 1, "token-a", NOW + LEASE, NOW)
    assert await store.write_results([ok(item, "token-a")]) == [True]
    # What the planner stores, read back by the planner and by the demand alike.
    await store.apply_plan(Plan([ModelRate("alpha", 10.0, NOW, 7, True, 2, 5.0)], [], {}))
    await store.apply_plan(Plan([ModelRate("gamma", None, NOW, 0, True, 1, None)], [], {}))
    up = EngineReport(
        worker="w1",
        engine="vllm-a",
        url="http://10.0.0.7:8000/v1",
        models=("alpha",),
        state=EngineState.UP,
        last_error=None,
        since=NOW - 5,
        checked_at=NOW,
        in_flight=1,
        max_concurrency=16,
        concurrency_limit=16,
        mode="dedicated",
        signal="fixed",
        pressure=0.0,
        until=NOW + LEASE,
    )
    await store.report_engines([up], NOW)

    found = await store.demand_inputs()
    assert sorted((b.model, b.remaining, b.tokens_bound) for b in found.queued) == [
        # 3 of 4 lines left of (200 prompt + 400 output) tokens; the validating batch's 2.
        ("alpha", 2, 100),
        ("alpha", 3, 450),
    ]
    assert {(b.created_at, b.expires_at) for b in found.queued} == {(int(NOW), int(NOW) + 86400)}
    assert found.per_replica == {"alpha": 5.0, "gamma": None}
    assert list(found.engines) == [up]
    planned = await store.plan_inputs()
    assert {(r.model, r.replicas, r.per_replica) for r in planned.rates} == {
        ("alpha", 2, 5.0),
        ("gamma", 1, None),
    }
    assert list(planned.engines) == [up]


async def test_org_account_reads_credits_and_the_balance_not_receipts(store: SqlStore) -> None:
    assert await store.org_account("org_unknown") is None
    org = await make_org(store)
    empty = await store.org_account(org.id)
    assert empty == OrgAccount(org, credits=0, balance=0, reserved=0)
    await store.credit(org.id, CREDIT, "a", int(NOW))
    await store.credit(org.id, 2 * CREDIT, None, int(NOW) + 1)
    batch = await make_batch(
        store,
        org,
        3,
        admission=reserving(),
        price_input=1_000,
        price_cached_input=500,
        price_output=4_000,
    )
    items = await take(store, batch, 3, "token-a", NOW + LEASE, NOW)
    charged = [
        dataclasses.replace(ok(item, "token-a"), request_id=f"req_{item.idx}") for item in items[:2]
    ]
    assert await store.write_results([*charged, bad(items[2], "token-a")]) == [True] * 3
    await store.charge_gpu_time(gpu_receipt(org, 7 * 10**9))

    account = await store.org_account(org.id)
    # The ledger sums every receipt; the account derives the charges from the balance, and
    # the two agree: balance = credits - charges.
    ledger = await store.ledger(org.id)
    assert account is not None
    assert account.org == org
    assert account.credits == ledger.credits == 3 * CREDIT
    assert account.balance == ledger.balance
    assert account.reserved == ledger.reserved == RESERVE - (ledger.charges - 7 * 10**9)
    assert account.charges == ledger.charges > 7 * 10**9
    assert account.available == ledger.available


def gpu_receipt(org: Org, amount: int) -> Receipt:
    return Receipt(
        request_id=f"gpu_{org.id}",
        org_id=org.id,
        kind=ReceiptKind.GPU_TIME,
        batch_id=None,
        custom_id=None,
        model_config_id=None,
        deployment_id="deployment-1",
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
        prices=None,
        gpu_count=1,
        gpu_ms=1_000,
        amount=amount,
        started_at=NOW,
        created_at=NOW + 1,
    )


async def test_batch_charges_are_read_at_once_for_the_org(store: SqlStore) -> None:
    ours, theirs = await make_org(store), await make_org(store)
    for org in (ours, theirs):
        await store.credit(org.id, CREDIT, None, int(NOW))
    running = await make_batch(store, ours, 2, admission=reserving())
    ended = await make_batch(store, ours, 1, status=BatchStatus.COMPLETED)
    gpu = await make_batch(store, ours, 1, billing=Billing.GPU_TIME)
    their_batch = await make_batch(store, theirs, 1, admission=reserving())
    asked = [ended.id, their_batch.id, "batch_unknown", running.id, gpu.id]
    found = {c.id: c for c in await store.batch_charges(ours.id, asked)}
    assert set(found) == {running.id, ended.id, gpu.id}
    assert found[running.id] == BatchCharges(
        running.id, BatchStatus.IN_PROGRESS, Billing.CATALOG, charged=0, reserved=RESERVE
    )
    assert found[ended.id].status == BatchStatus.COMPLETED
    assert found[gpu.id].billing == Billing.GPU_TIME
    assert await store.batch_charges(ours.id, []) == []
    assert [c.id for c in await store.batch_charges(theirs.id, asked)] == [their_batch.id]


async def test_failed_results_are_the_failed_lines_only(store: SqlStore) -> None:
    org, other = await make_org(store), await make_org(store)
    batch = await make_batch(store, org, 6)
    items = await take(store, batch, 4, "token-a", NOW + LEASE, NOW)
    results = [
        ok(items[0], "token-a"),
        bad(items[1], "token-a"),
        ok(items[2], "token-a"),
        bad(items[3], "token-a"),
    ]
    assert await store.write_results(results) == [True] * 4
    # The two lines never run end failed with a code and no sealed row.
    assert await store.close_unfinished(batch.id, "batch_cancelled") == 2

    failed = await store.failed_results(org.id, batch.id, -1, 100)
    assert [(r.idx, r.ok, r.payload, r.error_code) for r in failed] == [
        (1, False, b"error-payload", None),
        (3, False, b"error-payload", None),
        (4, False, None, "batch_cancelled"),
        (5, False, None, "batch_cancelled"),
    ]
    assert [r.custom_id for r in failed] == ["req-1", "req-3", "req-4", "req-5"]
    # Paged by index.
    assert [r.idx for r in await store.failed_results(org.id, batch.id, -1, 2)] == [1, 3]
    assert [r.idx for r in await store.failed_results(org.id, batch.id, 3, 2)] == [4, 5]
    assert await store.failed_results(org.id, batch.id, 5, 2) == []
    # Another org's batch reads as one with no failed lines.
    assert await store.failed_results(other.id, batch.id, -1, 100) == []
    assert await store.failed_results(org.id, "batch_unknown", -1, 100) == []


async def test_failed_lines_are_read_on_their_partial_index(store: SqlStore) -> None:
    """A batch of many successes and few failures: the count reads the failures only."""
    org = await make_org(store)
    batch = await make_batch(store, org, 20_000)
    i = t.items
    async with store.engine.begin() as conn:
        await conn.execute(
            update(i)
            .where(i.c.batch_id == batch.id)
            .values(state=2, outcome=case((i.c.idx % 1000 == 7, Outcome.ERROR), else_=Outcome.OK))
        )
        await conn.execute(text("ANALYZE"))
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        sent.append((statement, params))

    event.listen(store.engine.sync_engine, "before_cursor_execute", capture)
    try:
        failed = await store.failed_results(org.id, batch.id, -1, 1000)
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", capture)
    assert [r.idx for r in failed] == list(range(7, 20_000, 1000))
    (statement, params), *_ = sent
    async with store.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        if store.is_sqlite:
            cursor = await driver.execute("EXPLAIN QUERY PLAN " + statement, params)
            plan = "\n".join(str(row[-1]) for row in await cursor.fetchall())
        else:
            plan = "\n".join(row[0] for row in await driver.fetch("EXPLAIN " + statement, *params))
    assert "ix_items_failed" in plan, plan
    assert "Seq Scan on items" not in plan, plan
    assert "SCAN items" not in plan, plan  # SQLite's walk over the table
