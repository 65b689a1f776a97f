"""A batch's progress over time from the times its results were stored
(``Store.progress_history``): exact points, only for the batch's own org, none rather than
wrong ones for results stored without a time, and a lookup on the results index, never a
walk over the batch's lines."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import event, text, update

from backfill.adapters.db import tables as t
from backfill.adapters.db.store import SqlStore
from backfill.domain.progress import MAX_POINTS, BatchProgress, ProgressPoint, sampled_seqs
from backfill.domain.records import ItemResult
from tests.contract.test_group_commit import lease, result
from tests.contract.test_store import make_batch, make_org

T0 = 1_700_000_000.0


def at(batch_id: str, idx: int, when: float, ok: bool = True) -> ItemResult:
    """A result of line ``idx`` that ended at ``when`` by its worker's clock."""
    return dataclasses.replace(result(batch_id, idx, "tok", ok), finished_at=T0 + when)


def points(*pairs: tuple[float, int]) -> tuple[ProgressPoint, ...]:
    return tuple(ProgressPoint(T0 + when, done) for when, done in pairs)


async def test_the_points_are_the_times_of_the_writes_that_stored_the_results(
    store: SqlStore,
) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 8)
    other = await make_batch(store, org, 3)
    await lease(store, batch.id, "tok")
    await lease(store, other.id, "tok")
    assert await store.progress_history(org.id, batch.id, MAX_POINTS) == BatchProgress(8, ())

    # Three writes; a write's results all take the time of the last of them to end (they
    # were stored together, after it), and another batch's results count for that batch only.
    writes = [
        [at(batch.id, 3, 10.0), at(batch.id, 1, 12.5)],
        [at(batch.id, 0, 20.0, ok=False), at(other.id, 2, 21.0)],
        [
            at(batch.id, 6, 30.0),
            at(other.id, 0, 40.0),
            at(batch.id, 2, 31.25),
            at(batch.id, 5, 29.0),
        ],
    ]
    for write in writes:
        assert all(await store.write_results(write))

    found = await store.progress_history(org.id, batch.id, MAX_POINTS)
    assert found == BatchProgress(
        8, points((12.5, 1), (12.5, 2), (20.0, 3), (31.25, 4), (31.25, 5), (31.25, 6))
    )
    assert await store.progress_history(org.id, other.id, MAX_POINTS) == BatchProgress(
        3, points((21.0, 1), (40.0, 2))
    )
    # Fewer points: evenly spaced results, the first and the last among them.
    assert sampled_seqs(6, 3) == [1, 3, 6]
    assert await store.progress_history(org.id, batch.id, 3) == BatchProgress(
        8, points((12.5, 1), (20.0, 3), (31.25, 6))
    )


async def test_another_orgs_batch_is_not_readable(store: SqlStore) -> None:
    org = await make_org(store)
    stranger = await make_org(store)
    batch = await make_batch(store, org, 2)
    await lease(store, batch.id, "tok")
    assert await store.write_results([at(batch.id, 0, 1.0)])
    assert await store.progress_history(stranger.id, batch.id, MAX_POINTS) is None
    assert await store.progress_history(org.id, "batch_nonexistent", MAX_POINTS) is None
    found = await store.progress_history(org.id, batch.id, MAX_POINTS)
    assert found == BatchProgress(2, points((1.0, 1)))


async def test_results_stored_without_a_time_give_no_points(store: SqlStore) -> None:
    """Results stored before times were kept (numbered by the 0008 migration or written
    before 0010) keep a null time: such a batch has no curve rather than a wrong one."""
    org = await make_org(store)
    old = await make_batch(store, org, 4)
    await lease(store, old.id, "tok")
    assert all(await store.write_results([at(old.id, i, float(i)) for i in range(4)]))
    i = t.items
    async with store.engine.begin() as conn:
        # As the migration leaves a result stored before it: numbered, without a time.
        await conn.execute(
            update(i).where(i.c.batch_id == old.id, i.c.idx == 1).values(done_at=None)
        )
    assert await store.progress_history(org.id, old.id, MAX_POINTS) == BatchProgress(4, ())
    # Times are kept from some result on, so the first one, always read, says whether the
    # curve is whole, however few numbers are read.
    async with store.engine.begin() as conn:
        await conn.execute(update(i).where(i.c.batch_id == old.id).values(done_at=T0))
        await conn.execute(
            update(i).where(i.c.batch_id == old.id, i.c.idx == 0).values(done_at=None)
        )
    assert sampled_seqs(4, 2) == [1, 4]
    assert await store.progress_history(org.id, old.id, 2) == BatchProgress(4, ())


# ---- the query's plan ---------------------------------------------------------------------

# Large enough that PostgreSQL's planner prefers looking the numbers up to reading the batch's
# whole range of the index (it does the latter for a few thousand lines, where it is cheaper).
LINES = 20_000


async def _explain_progress(store: SqlStore, org_id: str, batch_id: str) -> list[str]:
    """The plans of the items statement ``progress_history`` sends, as sent: with its
    parameters known, and (PostgreSQL) the generic plan a prepared statement may settle on."""
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "FROM items" in statement:
            sent.append((statement, params))

    event.listen(store.engine.sync_engine, "before_cursor_execute", capture)
    try:
        found = await store.progress_history(org_id, batch_id, MAX_POINTS)
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", capture)
    assert found is not None
    assert len(found.points) == MAX_POINTS
    assert len(sent) == 1, sent
    statement, params = sent[0]
    assert len(params) == MAX_POINTS + 1
    async with store.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        if store.is_sqlite:
            cursor = await driver.execute("EXPLAIN QUERY PLAN " + statement, params)
            return ["\n".join(str(row[-1]) for row in await cursor.fetchall())]
        custom = await driver.fetch("EXPLAIN " + statement, *params)
        values = ", ".join(_sql_literal(p) for p in params)
        await driver.execute("SET plan_cache_mode = force_generic_plan")
        await driver.execute(f"PREPARE progress AS {statement}")
        try:
            generic = await driver.fetch(f"EXPLAIN EXECUTE progress({values})")
        finally:
            await driver.execute("DEALLOCATE progress")
            await driver.execute("RESET plan_cache_mode")
        return ["\n".join(row[0] for row in plan) for plan in (custom, generic)]


def _sql_literal(value: Any) -> str:
    if isinstance(value, int):
        return str(value)
    assert isinstance(value, str)
    return "'" + value.replace("'", "''") + "'"


async def test_the_points_are_looked_up_on_the_results_index(store: SqlStore) -> None:
    org = await make_org(store)
    done = await make_batch(store, org, LINES)
    # A running batch beside it, none of its lines done yet: the partial index leaves them out.
    await make_batch(store, org, LINES // 4)
    i = t.items
    async with store.engine.begin() as conn:
        # As LINES writes would leave it, without paying for them.
        await conn.execute(
            update(i)
            .where(i.c.batch_id == done.id)
            .values(state=2, done_seq=i.c.idx + 1, done_at=T0 + i.c.idx)
        )
        await conn.execute(
            update(t.batches).where(t.batches.c.id == done.id).values(results_seq=LINES)
        )
        await conn.execute(text("ANALYZE"))
    for plan in await _explain_progress(store, org.id, done.id):
        assert "ix_items_results" in plan, plan
        assert "SCAN" not in plan, plan  # SQLite's walk over a table or an index
        assert "Seq Scan" not in plan, plan
        # The numbers are keys of the index lookup, not a filter over the batch's range.
        keyed = [line for line in plan.splitlines() if "Index Cond" in line or "INDEX" in line]
        assert any("done_seq=?" in line or "done_seq = ANY" in line for line in keyed), plan
