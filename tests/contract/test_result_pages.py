"""Results numbered as they are stored, and read back in pages (``Store.results_after``).

The numbers are what makes the results endpoint exactly-once: each accepted result gets the
next number of its batch in the write that stores it, numbers are contiguous, and a reader
that pages past a number never misses one committed later below it.
"""

from __future__ import annotations

import asyncio
import random

from sqlalchemy import select

from backfill.adapters.db import tables as t
from backfill.adapters.db.store import SqlStore
from backfill.domain.records import ItemResult
from backfill.domain.result_cursor import START, UNNUMBERED, PagedResult, ResultCursor
from tests.contract.test_group_commit import lease, result
from tests.contract.test_store import make_batch, make_org
from tests.support import create_pg_database, drop_pg_database


async def _results_seq(store: SqlStore, batch_id: str) -> int:
    async with store.engine.connect() as conn:
        return int(
            (
                await conn.execute(
                    select(t.batches.c.results_seq).where(t.batches.c.id == batch_id)
                )
            ).scalar_one()
        )


async def _read_all(
    store: SqlStore, batch_id: str, cursor: ResultCursor, limit: int
) -> list[PagedResult]:
    """Every row of ``cursor``'s part from ``cursor`` on, ``limit`` at a time."""
    read: list[PagedResult] = []
    while page := await store.results_after(batch_id, cursor, limit):
        assert len(page) <= limit
        read += page
        cursor = page[-1].next
    return read


async def test_accepted_results_are_numbered_in_the_order_they_were_stored(
    store: SqlStore,
) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 12)
    other = await make_batch(store, org, 4)
    await lease(store, batch.id, "tok")
    await lease(store, other.id, "tok")
    # Three writes; within one, a batch's results take its numbers by line.
    writes = [
        [result(batch.id, 7, "tok"), result(other.id, 2, "tok"), result(batch.id, 3, "tok")],
        [result(batch.id, 0, "tok", ok=False), result(batch.id, 11, "tok")],
        [result(other.id, 0, "tok"), result(batch.id, 5, "tok"), result(batch.id, 1, "tok")],
    ]
    for write in writes:
        assert all(await store.write_results(write))

    read = await _read_all(store, batch.id, START, 2)
    assert [p.result.idx for p in read] == [3, 7, 0, 11, 1, 5]
    assert [p.next for p in read] == [ResultCursor(True, n) for n in range(1, 7)]
    assert [p.result.ok for p in read] == [True, True, False, True, True, True]
    assert all(p.result.payload == f"tok:{batch.id}:{p.result.idx}".encode() for p in read)
    assert [p.result.custom_id for p in read] == [f"req-{p.result.idx}" for p in read]
    assert await _results_seq(store, batch.id) == 6
    # Every batch counts on its own.
    assert [p.result.idx for p in await _read_all(store, other.id, START, 10)] == [2, 0]
    assert await _results_seq(store, other.id) == 2
    # A reader past the end gets nothing, and one in the middle reads on from there.
    assert await store.results_after(batch.id, ResultCursor(True, 6), 10) == []
    assert [p.result.idx for p in await store.results_after(batch.id, read[2].next, 2)] == [
        11,
        1,
    ]


async def test_a_refused_result_takes_no_number(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 4)
    await lease(store, batch.id, "tok")
    flags = await store.write_results(
        [result(batch.id, 0, "stale"), result(batch.id, 1, "tok"), result(batch.id, 1, "tok")]
    )
    assert flags == [False, True, False]
    assert await store.write_results([result(batch.id, 1, "tok")]) == [False]
    assert await _results_seq(store, batch.id) == 1
    assert await store.write_results([result(batch.id, 2, "tok")]) == [True]
    read = await _read_all(store, batch.id, START, 10)
    assert [(p.result.idx, p.next.position) for p in read] == [(1, 1), (2, 2)]


async def test_lines_closed_without_a_result_are_read_by_line_after_the_numbered_ones(
    store: SqlStore,
) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 9)
    await lease(store, batch.id, "tok", t.items.c.idx.in_([2, 6]))
    assert await store.write_results([result(batch.id, 6, "tok"), result(batch.id, 2, "tok")])
    # A cancel: the other lines end without running, with no number.
    assert await store.close_unfinished(batch.id, "batch_cancelled") == 7

    numbered = await _read_all(store, batch.id, START, 10)
    assert [p.result.idx for p in numbered] == [2, 6]
    unnumbered = await _read_all(store, batch.id, UNNUMBERED, 3)
    assert [p.result.idx for p in unnumbered] == [0, 1, 3, 4, 5, 7, 8]
    assert [p.next for p in unnumbered] == [
        ResultCursor(False, idx + 1) for idx in (0, 1, 3, 4, 5, 7, 8)
    ]
    assert {(p.result.ok, p.result.payload, p.result.error_code) for p in unnumbered} == {
        (False, None, "batch_cancelled")
    }
    # Both parts together: every line once.
    assert sorted(p.result.idx for p in numbered + unnumbered) == list(range(9))
    assert await store.results_after(batch.id, ResultCursor(False, 9), 10) == []


async def test_a_purged_batch_reads_as_rows_without_payload(store: SqlStore) -> None:
    org = await make_org(store)
    batch = await make_batch(store, org, 2)
    await lease(store, batch.id, "tok")
    assert await store.write_results([result(batch.id, 0, "tok"), result(batch.id, 1, "tok")])
    await store.purge_results(batch.id)
    read = await _read_all(store, batch.id, START, 10)
    assert [(p.result.payload, p.result.error_code) for p in read] == [(None, None)] * 2


# ---- concurrent writers --------------------------------------------------------------------

WRITERS = 6
LINES = 1200


async def test_concurrent_writers_never_make_a_reader_skip_a_row() -> None:
    """PostgreSQL, many writers at once (SQLite has one writer): numbers commit in order, so a
    reader paging all the while sees every row exactly once."""
    url = await create_pg_database()
    store = SqlStore(url)
    await store.init()
    try:
        org = await make_org(store)
        batch = await make_batch(store, org, LINES)
        tokens = [f"writer-{w}" for w in range(WRITERS)]
        for w, token in enumerate(tokens):
            await lease(store, batch.id, token, t.items.c.idx % WRITERS == w)
        done = asyncio.Event()

        async def writer(w: int) -> None:
            rng = random.Random(w)
            mine = list(range(w, LINES, WRITERS))
            rng.shuffle(mine)
            while mine:
                size = rng.randint(1, 25)
                group, mine = mine[:size], mine[size:]
                write: list[ItemResult] = [result(batch.id, idx, tokens[w]) for idx in group]
                assert all(await store.write_results(write))
                await asyncio.sleep(rng.random() / 500)

        seen: list[PagedResult] = []

        async def reader() -> None:
            cursor = START
            while True:
                finished = done.is_set()
                page = await store.results_after(batch.id, cursor, 37)
                seen.extend(page)
                if page:
                    cursor = page[-1].next
                elif finished:
                    return
                else:
                    await asyncio.sleep(0)

        reading = asyncio.create_task(reader())
        await asyncio.gather(*(writer(w) for w in range(WRITERS)))
        done.set()
        await reading
    finally:
        await store.close()
        await drop_pg_database(url)
    assert [p.next.position for p in seen] == list(range(1, LINES + 1))
    assert sorted(p.result.idx for p in seen) == list(range(LINES))
