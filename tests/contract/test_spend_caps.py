"""Spend caps on every store (SQLite and PostgreSQL): the caps themselves, what each window
counts (batches by creation, charged plus still reserved; GPU time when charged), what an
ended or deleted batch leaves counted, and parallel creations that never pass a cap together
(docs/billing.md, "Spend caps")."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import Table, func, select

from backfill.adapters.db import tables as t
from backfill.adapters.db.store import SqlStore
from backfill.domain import ids
from backfill.domain.files import FilePurpose
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import Admission, BatchRecord, Org, Receipt, ReceiptKind
from backfill.domain.spend_caps import CapScope, CapUse, Period, SpendCap
from backfill.errors import SpendCapReached
from tests.contract.test_group_commit import lease, result
from tests.contract.test_store import NOW, file_record, make_batch, make_org

# NOW is Monday 1970-01-12 13:46:40 UTC: the day before is in the week before.
DAY = 86_400
RESERVE = 10**12  # 1 USD
CREDIT = 10**15


def admission(reserve: int = RESERVE, key: str | None = None, gpu: bool = False) -> Admission:
    return Admission(
        reserve=reserve,
        require_positive_balance=gpu,
        max_unfinished=1000,
        max_retained_input_bytes=1 << 40,
        throughput_tokens_per_s=None,
        api_key_id=key,
    )


async def funded_org(store: SqlStore) -> Org:
    org = await make_org(store)
    await store.credit(org.id, CREDIT, None, int(NOW))
    return org


def cap(org: Org, period: Period, limit: int, key: str | None = None) -> SpendCap:
    if key is None:
        return SpendCap(CapScope.ORG, org.id, org.id, period, limit, int(NOW))
    return SpendCap(CapScope.KEY, key, org.id, period, limit, int(NOW))


def new_batch(org: Org, file_id: str, created_at: float = NOW) -> BatchRecord:
    return BatchRecord(
        id=ids.batch_id(),
        org_id=org.id,
        endpoint="/v1/chat/completions",
        model="m",
        model_config_id="m-v1",
        input_file_id=file_id,
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=int(created_at),
        expires_at=int(created_at) + DAY,
        total=1,
        price_input=1_000,
        price_cached_input=500,
        price_output=4_000,
    )


async def create(
    store: SqlStore,
    org: Org,
    reserve: int = RESERVE,
    *,
    key: str | None = None,
    created_at: float = NOW,
) -> BatchRecord:
    """A batch created as the API creates one: admission, reservation and row together."""
    source = file_record(org)
    await store.create_file(source)
    batch = new_batch(org, source.id, created_at)
    await store.create_batch(batch, admission(reserve, key))
    return batch


async def uses(store: SqlStore, org: Org, now: float = NOW) -> dict[tuple[str, str], CapUse]:
    return {
        (u.cap.scope_id, u.cap.period.value): u for u in await store.spend_cap_uses(org.id, now)
    }


async def held(store: SqlStore, org: Org, now: float = NOW) -> dict[tuple[str, str], int]:
    """Each cap's window: charged plus still reserved."""
    return {where: u.used for where, u in (await uses(store, org, now)).items()}


async def count(store: SqlStore, table: Table, org: Org) -> int:
    async with store.engine.connect() as conn:
        query = select(func.count()).select_from(table).where(table.c.org_id == org.id)
        return int((await conn.execute(query)).scalar_one())


async def test_caps_are_set_replaced_listed_and_removed(store: SqlStore) -> None:
    org, other = await funded_org(store), await funded_org(store)
    first = await store.put_spend_cap(cap(org, Period.MONTH, 5 * RESERVE), NOW)
    assert (first.cap.limit, first.used, first.window.resets_at) == (5 * RESERVE, 0, 2_678_400)
    await store.put_spend_cap(cap(org, Period.DAY, RESERVE), NOW)
    await store.put_spend_cap(cap(org, Period.DAY, 3 * RESERVE, key="key_a"), NOW)
    await store.put_spend_cap(cap(other, Period.DAY, RESERVE), NOW)
    # A second cap of the same owner and period replaces the first.
    replaced = await store.put_spend_cap(cap(org, Period.DAY, 2 * RESERVE), NOW + 5)
    assert (replaced.cap.limit, replaced.cap.updated_at) == (2 * RESERVE, int(NOW))

    found = await store.spend_cap_uses(org.id, NOW)
    assert [(u.cap.scope, u.cap.scope_id, u.cap.period, u.cap.limit) for u in found] == [
        (CapScope.ORG, org.id, Period.DAY, 2 * RESERVE),
        (CapScope.ORG, org.id, Period.MONTH, 5 * RESERVE),
        (CapScope.KEY, "key_a", Period.DAY, 3 * RESERVE),
    ]
    assert await store.delete_spend_cap(org.id, Period.DAY)
    assert not await store.delete_spend_cap(org.id, Period.DAY)
    assert set(await held(store, org)) == {(org.id, "month"), ("key_a", "day")}
    assert set(await held(store, other)) == {(other.id, "day")}


async def test_a_batch_past_a_cap_is_refused_and_nothing_is_stored(store: SqlStore) -> None:
    org = await funded_org(store)
    await store.put_spend_cap(cap(org, Period.DAY, 3 * RESERVE), NOW)
    for _ in range(3):
        await create(store, org)
    before = await store.ledger(org.id)
    with pytest.raises(SpendCapReached) as refused:
        await create(store, org)
    assert "daily spend cap of 1 USD" not in refused.value.message
    assert "daily spend cap of 3 USD" in refused.value.message
    assert await store.ledger(org.id) == before
    assert before.reserved == 3 * RESERVE
    assert await count(store, t.batches, org) == await count(store, t.spend, org) == 3
    # A batch that costs nothing still fits a full cap.
    await create(store, org, 0)


async def test_key_caps_count_only_that_keys_batches(store: SqlStore) -> None:
    org = await funded_org(store)
    await store.put_spend_cap(cap(org, Period.MONTH, 2 * RESERVE, key="key_a"), NOW)
    await store.put_spend_cap(cap(org, Period.MONTH, 4 * RESERVE), NOW)
    await create(store, org, key="key_a")
    await create(store, org, key="key_b")
    await create(store, org, key="key_a")
    with pytest.raises(SpendCapReached) as refused:
        await create(store, org, key="key_a")
    assert "API key key_a's monthly spend cap of 2 USD" in refused.value.message
    await create(store, org, key="key_b")
    assert await held(store, org) == {
        (org.id, "month"): 4 * RESERVE,
        ("key_a", "month"): 2 * RESERVE,
    }
    # Now the org's cap is the one that refuses, whichever key asks.
    with pytest.raises(SpendCapReached, match="this organization's monthly spend cap"):
        await create(store, org, key="key_b")


async def test_a_batch_counts_in_the_windows_it_was_created_in(store: SqlStore) -> None:
    org = await funded_org(store)
    for period in Period:
        await store.put_spend_cap(cap(org, period, 100 * RESERVE), NOW)
    # Sunday (last week), Monday 00:00 (this week's first second) and now.
    await create(store, org, 1 * RESERVE, created_at=NOW - DAY)
    await create(store, org, 2 * RESERVE, created_at=NOW - NOW % DAY)
    await create(store, org, 4 * RESERVE)
    assert await held(store, org) == {
        (org.id, "day"): 6 * RESERVE,
        (org.id, "week"): 6 * RESERVE,
        (org.id, "month"): 7 * RESERVE,
        (org.id, "total"): 7 * RESERVE,
    }
    # Tomorrow the day is empty again; the batches still run, and hold the rest.
    tomorrow = await held(store, org, NOW + DAY)
    assert (tomorrow[(org.id, "day")], tomorrow[(org.id, "week")]) == (0, 6 * RESERVE)
    # Next month (February 1970 starts on day 31).
    assert (await held(store, org, 31 * DAY))[(org.id, "month")] == 0
    # The refusal names the window the batch would be created in.
    await store.put_spend_cap(cap(org, Period.DAY, 7 * RESERVE), NOW)
    with pytest.raises(SpendCapReached, match="resets at 1970-01-13T00:00:00Z") as refused:
        await create(store, org, 2 * RESERVE)
    assert refused.value.retry_after_s == DAY - NOW % DAY
    await create(store, org, 2 * RESERVE, created_at=NOW + DAY)


async def test_an_ended_batch_counts_what_it_was_charged_even_once_deleted(
    store: SqlStore,
) -> None:
    org = await funded_org(store)
    await store.put_spend_cap(cap(org, Period.TOTAL, 10 * RESERVE), NOW)
    batch = await make_batch(
        store,
        org,
        4,
        model="m",
        admission=admission(RESERVE),
        price_input=1_000,
        price_cached_input=500,
        price_output=4_000,
    )
    await lease(store, batch.id, "tok")
    # Three lines succeed: (7 - 2) x 1000 + 2 x 500 + 11 x 4000 = 50,000 pUSD each.
    results = [result(batch.id, idx, "tok", ok=idx < 3) for idx in range(4)]
    assert await store.write_results(results) == [True] * 4
    running = (await uses(store, org))[(org.id, "total")]
    assert (running.charged, running.reserved) == (150_000, RESERVE - 150_000)

    finalizing = BatchStatus.FINALIZING
    assert (await store.take_finalize(batch.id, [finalizing], "fin", NOW + 60, NOW)).taken
    out = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    err = file_record(org, FilePurpose.BATCH_OUTPUT, batch_id=batch.id)
    assert await store.publish(
        batch.id, finalizing, BatchStatus.COMPLETED, int(NOW), out, err, token="fin"
    )
    ended = (await uses(store, org))[(org.id, "total")]
    assert (ended.charged, ended.reserved) == (150_000, 0)
    assert await store.delete_batch(org.id, batch.id, int(NOW) + 1) is not None
    assert (await uses(store, org))[(org.id, "total")] == ended


async def test_a_batch_that_ends_unrun_gives_its_room_back(store: SqlStore) -> None:
    org = await funded_org(store)
    await store.put_spend_cap(cap(org, Period.DAY, RESERVE), NOW)
    first = await create(store, org)
    with pytest.raises(SpendCapReached):
        await create(store, org)
    assert await store.fail_batch(first.id, BatchStatus.VALIDATING, int(NOW), [])
    assert await held(store, org) == {(org.id, "day"): 0}
    await create(store, org)


async def test_gpu_time_counts_for_the_org_when_it_is_charged(store: SqlStore) -> None:
    org = await funded_org(store)
    await store.put_spend_cap(cap(org, Period.DAY, RESERVE), NOW)
    await store.put_spend_cap(cap(org, Period.DAY, RESERVE, key="key_a"), NOW)
    charges = [(NOW - DAY, 5 * RESERVE), (NOW - 3600, RESERVE // 4), (NOW - 1.5, RESERVE // 4)]
    for charged_at, amount in charges:
        await store.charge_gpu_time(
            Receipt(
                request_id=ids.request_id(),
                org_id=org.id,
                kind=ReceiptKind.GPU_TIME,
                batch_id=None,
                custom_id=None,
                model_config_id="dep-v1",
                deployment_id="dep",
                input_tokens=0,
                cached_tokens=0,
                output_tokens=0,
                prices=None,
                gpu_count=1,
                gpu_ms=1000,
                amount=amount,
                started_at=None,
                created_at=charged_at,
            )
        )
    found = await uses(store, org)
    assert (found[(org.id, "day")].charged, found[("key_a", "day")].charged) == (RESERVE // 2, 0)
    # One row per org and UTC day, however many spans were charged.
    assert await count(store, t.spend, org) == 2
    # A GPU-time batch starts while the window has room, and not once it has none.
    source = file_record(org)
    await store.create_file(source)
    await store.create_batch(new_batch(org, source.id), admission(0, "key_a", gpu=True))
    await store.put_spend_cap(cap(org, Period.DAY, RESERVE // 2), NOW)
    source = file_record(org)
    await store.create_file(source)
    with pytest.raises(SpendCapReached, match="billed by GPU time"):
        await store.create_batch(new_batch(org, source.id), admission(0, "key_a", gpu=True))


@pytest.mark.parametrize("key", [None, "key_a"])
async def test_parallel_creates_never_pass_a_cap_together(store: SqlStore, key: str | None) -> None:
    """Each creation fits the cap alone; together only three do. The org row's lock orders
    them, so each sees the reservations of those before it (PostgreSQL: a pool of
    connections, the creations in flight at once)."""
    org = await funded_org(store)
    await store.put_spend_cap(cap(org, Period.WEEK, 3 * RESERVE, key=key), NOW)
    sources = [file_record(org) for _ in range(12)]
    for source in sources:
        await store.create_file(source)
    batches = [new_batch(org, source.id) for source in sources]
    outcomes = await asyncio.gather(
        *(store.create_batch(b, admission(RESERVE, key)) for b in batches),
        return_exceptions=True,
    )
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert all(isinstance(o, SpendCapReached) for o in refused), refused
    assert (len(outcomes) - len(refused), len(refused)) == (3, 9)
    assert (await store.ledger(org.id)).reserved == 3 * RESERVE
    assert await count(store, t.batches, org) == 3
    scope_id = key or org.id
    assert (await held(store, org))[(scope_id, "week")] == 3 * RESERVE


async def test_batches_of_another_org_never_count(store: SqlStore) -> None:
    org, other = await funded_org(store), await funded_org(store)
    await store.put_spend_cap(cap(org, Period.DAY, RESERVE), NOW)
    await create(store, other, 5 * RESERVE, key="key_a")
    await create(store, org)
    assert await held(store, org) == {(org.id, "day"): RESERVE}
