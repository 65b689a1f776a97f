"""Group commit of results: lock order under concurrency, the move to ``finalizing`` with the
last result, and queue gauges read from the batch counters.

Leases are set up with plain SQL so these tests depend on the item rows only, not on how
items are claimed.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event, func, select, update

from backfill.adapters.db import tables as t
from backfill.adapters.db.store import SqlStore
from backfill.domain.lifecycle import BatchStatus, ItemState
from backfill.domain.records import Admission, BatchRecord, ItemResult, Org
from backfill.errors import StorageError
from tests.contract.test_store import NOW, make_batch, make_org
from tests.support import create_pg_database, drop_pg_database

FAR = NOW + 10**9
RESERVE = 10**12
CREDIT = 10**15


async def priced_batch(
    store: SqlStore, org: Org, items: int, *, status: BatchStatus = BatchStatus.IN_PROGRESS
) -> BatchRecord:
    """A catalog-priced batch with a reservation, so writes charge and release."""
    admission = Admission(
        reserve=RESERVE,
        require_positive_balance=False,
        max_unfinished=1000,
        max_retained_input_bytes=1 << 40,
        throughput_tokens_per_s=None,
    )
    return await make_batch(
        store,
        org,
        items,
        status=status,
        model="m",
        admission=admission,
        price_input=1_000,
        price_cached_input=500,
        price_output=4_000,
    )


async def lease(store: SqlStore, batch_id: str, token: str, where: Any = None) -> None:
    """Lease items of a batch to ``token`` directly (all of them, or those ``where`` picks)."""
    i = t.items
    stmt = update(i).where(i.c.batch_id == batch_id)
    if where is not None:
        stmt = stmt.where(where)
    async with store.engine.begin() as conn:
        await conn.execute(stmt.values(state=ItemState.LEASED, lease_token=token, lease_until=FAR))


def result(batch_id: str, idx: int, token: str, ok: bool = True) -> ItemResult:
    return ItemResult(
        batch_id,
        idx,
        token,
        ok,
        f"{token}:{batch_id}:{idx}".encode(),
        input_tokens=7 if ok else 0,
        output_tokens=11 if ok else 0,
        cached_tokens=2 if ok else 0,
        request_id=f"req_{batch_id}_{idx}",
        custom_id=f"req-{idx}",
        finished_at=time.time(),
    )


def is_deadlock(exc: BaseException) -> bool:
    """Whether a failure (as ``SqlBase.writing`` wraps it) was PostgreSQL's deadlock_detected."""
    seen: BaseException | None = exc
    while seen is not None:
        for err in (seen, getattr(seen, "orig", None)):
            if getattr(err, "sqlstate", None) == "40P01" or "deadlock" in str(err).lower():
                return True
        seen = seen.__cause__ or seen.__context__
    return False


# ---- lock order -------------------------------------------------------------------------

WRITERS = 8
BATCHES = 20
ORGS = 3
ROUNDS = 15
PER_BATCH = 600


async def test_concurrent_group_commits_never_deadlock() -> None:
    """Writers whose groups share batches and orgs, each group in random order: every
    transaction takes batch, item and org rows in one global order, so none waits in a cycle."""
    url = await create_pg_database()
    store = SqlStore(url)
    await store.init()
    try:
        await _hammer(store)
    finally:
        await store.close()
        await drop_pg_database(url)


async def _hammer(store: SqlStore) -> None:
    rng = random.Random(20261130)
    orgs = [await make_org(store) for _ in range(ORGS)]
    for org in orgs:
        await store.credit(org.id, CREDIT, None, int(NOW))
    batches = [await priced_batch(store, orgs[n % ORGS], PER_BATCH) for n in range(BATCHES)]
    tokens = [f"writer-{w}" for w in range(WRITERS)]
    # Each writer holds every WRITERS-th item of every batch: its own items, shared batches.
    pending: list[dict[str, list[int]]] = []
    for w, token in enumerate(tokens):
        for batch in batches:
            await lease(store, batch.id, token, t.items.c.idx % WRITERS == w)
        pending.append({b.id: list(range(w, PER_BATCH, WRITERS)) for b in batches})

    accepted: list[ItemResult] = []
    deadlocks = 0

    async def writer(w: int) -> None:
        nonlocal deadlocks
        wrng = random.Random(rng.random())
        mine = pending[w]
        for _ in range(ROUNDS):
            live = [b for b, idxs in mine.items() if idxs]
            chosen = wrng.sample(live, min(len(live), wrng.randint(2, 5)))
            size = wrng.randint(30, 60)
            group: list[ItemResult] = []
            for n in range(size):
                idxs = mine[chosen[n % len(chosen)]]
                if idxs:
                    idx = idxs.pop(wrng.randrange(len(idxs)))
                    group.append(result(chosen[n % len(chosen)], idx, tokens[w], n % 7 != 0))
            wrng.shuffle(group)
            try:
                flags = await store.write_results(group)
            except StorageError as exc:
                if not is_deadlock(exc):
                    raise
                deadlocks += 1
                # Rolled back: the leases are still held, so these may be written again.
                for r in group:
                    mine[r.batch_id].append(r.idx)
                continue
            assert all(flags), "every result of a held lease is accepted"
            accepted.extend(group)

    started = time.monotonic()
    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    elapsed = time.monotonic() - started
    assert deadlocks == 0, f"{deadlocks} deadlocks in {elapsed:.1f}s"
    assert accepted

    # Every accepted result is stored once, with its own payload, and counted once.
    by_batch: dict[str, list[ItemResult]] = defaultdict(list)
    for r in accepted:
        by_batch[r.batch_id].append(r)
    assert len({(r.batch_id, r.idx) for r in accepted}) == len(accepted)
    for batch in batches:
        mine = {r.idx: r for r in by_batch[batch.id]}
        stored = [r async for page in store.iter_results(batch.id) for r in page]
        assert {s.idx: s.payload for s in stored if s.payload is not None} == {
            idx: r.payload for idx, r in mine.items()
        }
        got = await store.get_batch(None, batch.id)
        assert got is not None
        assert (got.completed, got.failed) == (
            sum(r.ok for r in mine.values()),
            sum(not r.ok for r in mine.values()),
        )

    # Receipts: one per accepted success; each org paid exactly their sum.
    async with store.engine.connect() as conn:
        receipts = (await conn.execute(select(t.receipts.c.batch_id, t.receipts.c.idx))).all()
        reserved = dict(
            (
                await conn.execute(
                    select(t.batches.c.org_id, func.sum(t.batches.c.reserved)).group_by(
                        t.batches.c.org_id
                    )
                )
            ).all()
        )
    assert Counter((r.batch_id, r.idx) for r in receipts) == Counter(
        (r.batch_id, r.idx) for r in accepted if r.ok
    )
    for org in orgs:
        ledger = await store.ledger(org.id)
        assert ledger.balance == CREDIT - ledger.charges
        assert ledger.charges > 0
        # The org's reservation is what its batches still hold: releases were summed right.
        assert ledger.reserved == int(reserved[org.id])


# ---- the move to finalizing -------------------------------------------------------------


async def _status(store: SqlStore, batch_id: str) -> tuple[str, int | None, int, int]:
    got = await store.get_batch(None, batch_id)
    assert got is not None
    return got.status, got.finalizing_at, got.completed, got.failed


async def test_the_last_result_moves_the_batch_to_finalizing(store: SqlStore) -> None:
    org = await make_org(store)
    await store.credit(org.id, CREDIT, None, int(NOW))
    batch = await priced_batch(store, org, 3)
    await lease(store, batch.id, "token-a")
    assert await store.write_results([result(batch.id, 0, "token-a")]) == [True]
    before = int(time.time())
    flags = await store.write_results(
        [result(batch.id, 2, "token-a", ok=False), result(batch.id, 1, "token-a")]
    )
    after = int(time.time())
    assert flags == [True, True]
    status, finalizing_at, completed, failed = await _status(store, batch.id)
    assert (status, completed, failed) == (BatchStatus.FINALIZING, 2, 1)
    assert finalizing_at is not None
    assert before <= finalizing_at <= after


async def test_a_partial_write_leaves_the_batch_in_progress(store: SqlStore) -> None:
    org = await make_org(store)
    await store.credit(org.id, CREDIT, None, int(NOW))
    batch = await priced_batch(store, org, 3)
    other = await priced_batch(store, org, 1)
    await lease(store, batch.id, "token-a")
    await lease(store, other.id, "token-a")
    # One write finishes ``other`` but not ``batch``; a rejected result counts for nothing.
    flags = await store.write_results(
        [
            result(batch.id, 0, "token-a"),
            result(other.id, 0, "token-a"),
            result(batch.id, 1, "token-a"),
            result(batch.id, 2, "token-wrong"),
        ]
    )
    assert flags == [True, True, True, False]
    assert await _status(store, batch.id) == (BatchStatus.IN_PROGRESS, None, 2, 0)
    assert (await _status(store, other.id))[0] == BatchStatus.FINALIZING


async def test_only_an_in_progress_batch_moves_to_finalizing(store: SqlStore) -> None:
    org = await make_org(store)
    await store.credit(org.id, CREDIT, None, int(NOW))
    batch = await priced_batch(store, org, 1)
    await lease(store, batch.id, "token-a")
    assert await store.transition(
        batch.id, [BatchStatus.IN_PROGRESS], BatchStatus.CANCELLING, int(NOW)
    )
    # A cancelling batch's in-flight result is still stored, but the cancel decides its end.
    assert await store.write_results([result(batch.id, 0, "token-a")]) == [True]
    assert await _status(store, batch.id) == (BatchStatus.CANCELLING, None, 1, 0)


# ---- gauges -----------------------------------------------------------------------------


@contextmanager
def statements(store: SqlStore) -> Iterator[list[tuple[str, Any]]]:
    """The SQL (and its driver parameters) that ``store`` sends while inside the block."""
    seen: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, sql: str, params: Any, *_rest: Any) -> None:
        seen.append((sql, params))

    event.listen(store.engine.sync_engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", record)


async def test_gauges_count_the_queue_from_batch_counters(store: SqlStore) -> None:
    org = await make_org(store)
    await store.credit(org.id, CREDIT, None, int(NOW))
    running = await priced_batch(store, org, 5)
    await lease(store, running.id, "token-a")
    assert await store.write_results(
        [result(running.id, 0, "token-a"), result(running.id, 1, "token-a", ok=False)]
    ) == [True, True]
    await priced_batch(store, org, 4, status=BatchStatus.VALIDATING)
    cancelling = await priced_batch(store, org, 2)
    assert await store.transition(
        cancelling.id, [BatchStatus.IN_PROGRESS], BatchStatus.CANCELLING, int(NOW)
    )
    done = await priced_batch(store, org, 6)
    assert await store.transition(
        done.id, [BatchStatus.IN_PROGRESS], BatchStatus.COMPLETED, int(NOW)
    )

    with statements(store) as seen:
        by_status, depth = await store.gauges()
    # 3 left of the running batch, 4 of the validating one, 2 of the cancelling one.
    assert depth == 3 + 4 + 2
    assert by_status == {
        BatchStatus.IN_PROGRESS: 1,
        BatchStatus.VALIDATING: 1,
        BatchStatus.CANCELLING: 1,
        BatchStatus.COMPLETED: 1,
    }
    assert seen
    for sql, _ in seen:
        assert not re.search(r"\bitems\b", sql), sql
    # Nor does any plan touch it (a view or a rewrite could hide it from the text).
    async with store.engine.connect() as conn:
        for sql, params in seen:
            explain = "EXPLAIN QUERY PLAN " if store.is_sqlite else "EXPLAIN "
            plan = (await conn.exec_driver_sql(explain + sql, params)).all()
            assert plan
            assert not re.search(r"\bitems\b", " ".join(map(str, plan))), plan


async def test_gauges_of_an_empty_store(store: SqlStore) -> None:
    assert await store.gauges() == ({}, 0)
