"""SQLite's connections do each statement in one trip to their thread, and behave as the stock
aiosqlite adapter does: rows, counts, errors, transactions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from backfill.adapters.db.dialect import SQLITE
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.sqlite_driver import OneTripConnection


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = SQLITE.engine(f"sqlite+aiosqlite:///{tmp_path}/t.db")
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)"))
    yield engine
    await engine.dispose()


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every trip to a connection's thread made through ``OneTripConnection``."""
    made: list[int] = []
    real = OneTripConnection._execute

    async def counted(self: OneTripConnection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return await real(self, fn, *args, **kwargs)

    monkeypatch.setattr(OneTripConnection, "_execute", counted)
    return made


async def test_a_read_and_a_write_are_one_trip_each(engine: AsyncEngine, trips: list[int]) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))  # the pool's first checkout is behind us
        trips.clear()
        rows = (await conn.execute(text("SELECT :a + 1 AS b, 'x' AS c"), {"a": 41})).all()
        assert [tuple(r) for r in rows] == [(42, "x")]
        assert len(trips) == 1
        trips.clear()
        res = await conn.execute(
            text("INSERT INTO t (id, v) VALUES (:id, :v)"),
            [{"id": i, "v": str(i)} for i in range(5)],
        )
        assert res.rowcount == 5
        assert len(trips) == 1
        await conn.commit()


async def test_rows_counts_and_returning_are_those_of_the_statement(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        res = await conn.execute(text("INSERT INTO t (v) VALUES ('a')"))
        assert res.lastrowid == 1
        await conn.exec_driver_sql("INSERT INTO t (v) VALUES (?)", [("b",), ("c",)])
        res = await conn.execute(text("UPDATE t SET v = v || '!' WHERE id > 1"))
        assert res.rowcount == 2
        res = await conn.execute(text("UPDATE t SET v = 'z' WHERE id = 3 RETURNING id, v"))
        assert [tuple(r) for r in res.all()] == [(3, "z")]
        assert (await conn.execute(text("SELECT v FROM t WHERE id = 99"))).first() is None
        many = await conn.execute(text("SELECT id FROM t ORDER BY id"))
        assert many.fetchone() == (1,)
        assert [tuple(r) for r in many.fetchmany(1)] == [(2,)]
        assert [tuple(r) for r in many.all()] == [(3,)]


async def test_errors_are_the_drivers_and_roll_the_transaction_back(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'kept?')"))
        with pytest.raises(IntegrityError):
            await conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'twice')"))
        await conn.rollback()
        with pytest.raises(OperationalError, match="no such table"):
            await conn.execute(text("SELECT * FROM nowhere"))
    async with engine.connect() as conn:
        # The first insert rolled back; the connection still works.
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar() == 0


async def test_a_commit_or_rollback_with_nothing_open_makes_no_trip(
    engine: AsyncEngine, trips: list[int]
) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))  # the pool's first checkout is behind us
    trips.clear()
    async with engine.begin() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one() == 0
    assert len(trips) == 1  # the read; its commit and the pool's rollback found nothing open
    trips.clear()
    async with engine.begin() as conn:
        await conn.execute(text("SELECT count(*) FROM t"))
        await conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'a')"))
    # The read, the insert and the commit; the pool's rollback on checkin found nothing open.
    assert len(trips) == 3
    trips.clear()
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT v FROM t"))).scalar_one() == "a"
    assert len(trips) == 1


async def test_a_transaction_left_open_is_still_rolled_back_by_the_pool(
    engine: AsyncEngine, trips: list[int]
) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'not committed')"))
        trips.clear()
    assert len(trips) == 1  # the pool's rollback went to the thread
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one() == 0


async def test_a_whole_transaction_is_one_trip(engine: AsyncEngine, trips: list[int]) -> None:
    def body(conn: Connection) -> list[tuple[int, str]]:
        conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'a')"))
        conn.exec_driver_sql("INSERT INTO t (id, v) VALUES (?, ?)", [(2, "b"), (3, "c")])
        done = conn.execute(text("UPDATE t SET v = v || '!' WHERE id > 1 RETURNING id, v"))
        return sorted((r.id, r.v) for r in done)

    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))  # the pool's first checkout is behind us
        driver = (await conn.get_raw_connection()).driver_connection
        assert isinstance(driver, OneTripConnection)
        trips.clear()
        assert await driver.transaction(body) == [(2, "b!"), (3, "c!")]
        assert len(trips) == 1
    # Committed: another connection's read sees it, and the pool's rollback made no trip.
    assert len(trips) == 1
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT id, v FROM t ORDER BY id"))
        assert [tuple(r) for r in rows] == [(1, "a"), (2, "b!"), (3, "c!")]


async def test_a_transaction_that_raises_leaves_nothing(engine: AsyncEngine) -> None:
    def body(conn: Connection) -> None:
        conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'rolled back')"))
        conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'twice')"))

    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert isinstance(driver, OneTripConnection)
        with pytest.raises(IntegrityError):
            await driver.transaction(body)
        # The same connection goes on: its next transaction commits alone.
        await driver.transaction(lambda c: c.execute(text("INSERT INTO t (id, v) VALUES (2, 'b')")))
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT id, v FROM t"))
        assert [tuple(r) for r in rows] == [(2, "b")]


async def test_closing_a_connection_is_clean(tmp_path: Path) -> None:
    engine = SQLITE.engine(f"sqlite+aiosqlite:///{tmp_path}/c.db")
    async with engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        assert isinstance(driver, OneTripConnection)
    await driver.close()  # the call that closes it answers, not the check after it
    await engine.dispose()


async def test_a_transaction_cut_short_by_its_caller_gives_its_connection_back(
    tmp_path: Path,
) -> None:
    """The writer is one pooled connection: a caller cancelled while its transaction runs in
    the thread must not keep it from the next one."""
    base = SqlBase(f"sqlite:///{tmp_path}/w.db")
    await base.in_one_trip("creating", lambda c: c.execute(text("CREATE TABLE t (v TEXT)")))

    def slow(conn: Connection) -> None:
        conn.execute(text("INSERT INTO t (v) VALUES ('finished in its thread')"))
        time.sleep(0.3)

    cut = asyncio.create_task(base.in_one_trip("inserting", slow))
    await asyncio.sleep(0.1)
    cut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cut

    def read(conn: Connection) -> list[str]:
        return [row.v for row in conn.execute(text("SELECT v FROM t"))]

    # The thread finished the transaction (committed); the connection is back in the pool.
    assert await asyncio.wait_for(base.in_one_trip("reading", read), 5) == [
        "finished in its thread"
    ]
    await base.close()
