"""Every difference between SQLite and PostgreSQL the queries need, each a small named helper.

Embedded SQLite is one process with one pooled connection for every write: while a transaction
holds it no other statement runs, so the row locks that order PostgreSQL's concurrent writers
are no-ops there (the API's hot reads have read-only connections of their own). The other
differences are spellings. ``SqlBase`` picks one dialect per engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from sqlalchemy import (
    Column,
    ColumnElement,
    Insert,
    Select,
    Table,
    Update,
    event,
    insert,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from backfill.adapters.db.sqlite_driver import one_trip_creator

_Query = TypeVar("_Query", bound=Select[Any])
# Read connections of an SQLite database beside its one writer.
_READERS = 2


class Dialect(Hashable, Protocol):
    def engine(self, url: str) -> AsyncEngine:
        """The engine, pooled and configured for this database."""
        ...

    def reader(self, url: str) -> AsyncEngine | None:
        """An engine for the API's hot reads (key lookups, batch polls) beside ``engine``, or
        None where ``engine`` serves them as well."""
        ...

    async def serialize_migrations(self, conn: AsyncConnection) -> None:
        """Make processes that start at once migrate the schema one after another."""
        ...

    def for_update(self, query: _Query) -> _Query:
        """``query`` locking the rows it reads until the transaction ends."""
        ...

    async def lock(self, conn: AsyncConnection, query: Select[Any]) -> None:
        """Lock the rows ``query`` reads, without reading them where nothing needs a lock."""
        ...

    def insert_ignoring(self, table: Table) -> Insert:
        """An insert that leaves rows already there (by any unique key) alone."""
        ...

    def upsert(
        self,
        table: Table,
        values: Mapping[str, Any],
        key: Sequence[Column[Any]],
        replace: Sequence[str],
        where: ColumnElement[bool],
    ) -> Insert:
        """Insert ``values``, or where a row with the same ``key`` exists and ``where`` holds
        for it, set its ``replace`` columns to theirs."""
        ...

    def update_picked(
        self, table: Table, where: ColumnElement[bool], key: Column[Any], pick: Select[Any]
    ) -> Update:
        """An update of the rows of ``table`` matching ``where`` whose ``key`` ``pick``
        selects, skipping rows another transaction holds; ``pick`` runs once."""
        ...


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the writer; FULL makes every commit survive power loss,
    # which is what "a result counts once it is durably stored" needs.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _sqlite_reader_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=30000")
    # A read connection never writes, whatever a query says.
    cursor.execute("PRAGMA query_only=ON")
    cursor.close()


def _replacing(
    ins: Any, key: Sequence[Column[Any]], replace: Sequence[str], where: ColumnElement[bool]
) -> Insert:
    """``ins`` (either dialect's insert) turned into an upsert of the ``replace`` columns."""
    upsert: Insert = ins.on_conflict_do_update(
        index_elements=key, set_={c: ins.excluded[c] for c in replace}, where=where
    )
    return upsert


class _Sqlite:
    def engine(self, url: str) -> AsyncEngine:
        # One connection: SQLite has one writer anyway, and serialising here avoids
        # "database is locked" retries under load.
        engine = create_async_engine(
            url,
            poolclass=AsyncAdaptedQueuePool,
            pool_size=1,
            max_overflow=0,
            async_creator=one_trip_creator(lambda: engine),
        )
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine

    def reader(self, url: str) -> AsyncEngine | None:
        # Polls would otherwise queue for the one connection behind group commits and claims.
        # Under WAL a reader sees every committed write and blocks no writer; each connection
        # has its own thread, where SQLite runs without the GIL. A private in-memory database
        # exists only on its one connection.
        if make_url(url).database in (None, "", ":memory:") or "mode=memory" in url:
            return None
        # No second rollback when a connection goes back to the pool (closing the connection
        # already ended its transaction): one round trip less to its thread per read.
        engine = create_async_engine(
            url,
            poolclass=AsyncAdaptedQueuePool,
            pool_size=_READERS,
            max_overflow=0,
            pool_reset_on_return=None,
            async_creator=one_trip_creator(lambda: engine),
        )
        event.listen(engine.sync_engine, "connect", _sqlite_reader_pragmas)
        return engine

    async def serialize_migrations(self, conn: AsyncConnection) -> None:
        pass  # the migration's write transaction already excludes every other writer

    def for_update(self, query: _Query) -> _Query:
        return query  # the one connection: nothing else runs while the transaction holds it

    async def lock(self, conn: AsyncConnection, query: Select[Any]) -> None:
        pass

    def insert_ignoring(self, table: Table) -> Insert:
        return insert(table).prefix_with("OR IGNORE")

    def upsert(
        self,
        table: Table,
        values: Mapping[str, Any],
        key: Sequence[Column[Any]],
        replace: Sequence[str],
        where: ColumnElement[bool],
    ) -> Insert:
        return _replacing(sqlite_insert(table).values(**values), key, replace, where)

    def update_picked(
        self, table: Table, where: ColumnElement[bool], key: Column[Any], pick: Select[Any]
    ) -> Update:
        return update(table).where(where, key.in_(pick.scalar_subquery()))


class _Postgres:
    def engine(self, url: str) -> AsyncEngine:
        return create_async_engine(url, pool_size=10, max_overflow=10)

    def reader(self, url: str) -> AsyncEngine | None:
        return None  # its pool already holds many connections, and readers never wait there

    async def serialize_migrations(self, conn: AsyncConnection) -> None:
        await conn.execute(text("SELECT pg_advisory_xact_lock(4242001)"))

    def for_update(self, query: _Query) -> _Query:
        return query.with_for_update()

    async def lock(self, conn: AsyncConnection, query: Select[Any]) -> None:
        await conn.execute(query.with_for_update())

    def insert_ignoring(self, table: Table) -> Insert:
        return pg_insert(table).on_conflict_do_nothing()

    def upsert(
        self,
        table: Table,
        values: Mapping[str, Any],
        key: Sequence[Column[Any]],
        replace: Sequence[str],
        where: ColumnElement[bool],
    ) -> Insert:
        return _replacing(pg_insert(table).values(**values), key, replace, where)

    def update_picked(
        self, table: Table, where: ColumnElement[bool], key: Column[Any], pick: Select[Any]
    ) -> Update:
        # A CTE runs once (an IN-subquery may be re-run per row and claim past the limit);
        # rows another transaction holds are skipped, never waited for.
        picked = pick.with_for_update(skip_locked=True).cte("picked")
        return update(table).where(where, key == picked.c[key.name])


SQLITE: Dialect = _Sqlite()
POSTGRES: Dialect = _Postgres()
