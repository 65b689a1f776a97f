"""The database engine: URLs, the dialect, migrations at start, failed writes."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import greenlet_spawn

from backfill.adapters.db import audit_rows
from backfill.adapters.db.dialect import POSTGRES, SQLITE
from backfill.adapters.db.migrate import upgrade
from backfill.adapters.db.sqlite_driver import OneTripConnection
from backfill.domain import audit
from backfill.domain.audit import Outcome
from backfill.errors import StorageError

_T = TypeVar("_T")
_P = ParamSpec("_P")

# PostgreSQL's class 53 "insufficient resources": disk_full, out_of_memory, too_many_connections.
_PG_NO_ROOM = "53"


def async_url(url: str) -> str:
    """The async driver's URL for a plain ``postgresql://`` or ``sqlite://`` one."""
    for plain, driver in (
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(plain):
            return driver + url.removeprefix(plain)
    return url


def out_of_room(exc: DBAPIError) -> bool:
    """Whether the database refused a write for lack of disk (or of another resource that a
    later retry may find): SQLite's SQLITE_FULL, PostgreSQL's SQLSTATE class 53."""
    orig = exc.orig
    if isinstance(orig, sqlite3.Error):
        return getattr(orig, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return isinstance(sqlstate, str) and sqlstate.startswith(_PG_NO_ROOM)


class SqlBase:
    """The engine and the schema; the query mixins of ``SqlStore`` build on it."""

    def __init__(self, url: str) -> None:
        url = async_url(url)
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self.dialect = SQLITE if self.is_sqlite else POSTGRES
        self.engine: AsyncEngine = self.dialect.engine(url)
        # The API's hot reads: SQLite's own read connections, else the engine itself.
        self._reader = self.dialect.reader(url)
        self.reads: AsyncEngine = self._reader or self.engine

    async def init(self) -> None:
        """Bring the schema up to date (Alembic); safe when several processes start at once."""
        async with self.engine.begin() as conn:
            await self.dialect.serialize_migrations(conn)
            await conn.run_sync(upgrade)

    @asynccontextmanager
    async def writing(self, failing: str | None = None) -> AsyncIterator[AsyncConnection]:
        """A write transaction whose "disk full" becomes StorageError (503, retryable): the
        transaction rolled back, so nothing is left and the same call may be sent again.

        With ``failing`` (what the write does, for the message) any driver failure — a lost
        connection, a busy database — becomes a retryable StorageError too: the worker's
        writes, where the runner must not need to know the driver's exceptions.
        """
        scope = audit.pending()
        claimed = False
        try:
            with _storage_errors(failing):
                async with self.engine.begin() as conn:
                    yield conn
                    if scope is not None and audit.pending() is scope:
                        # The action a request or an admin command is making: its audit row
                        # commits with its first change, or not at all (domain/audit.py).
                        scope.claimed = claimed = True
                        recorded = await audit_rows.append(
                            conn, scope.entry(Outcome.SUCCEEDED, 200)
                        )
        except BaseException:
            if scope is not None and claimed:
                # Rolled back with the change: the next write of the action may append it.
                scope.claimed = False
            raise
        if scope is not None and claimed:
            scope.recorded = recorded

    async def in_one_trip(
        self,
        failing: str,
        body: Callable[Concatenate[Connection, _P], _T],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """``body(conn, *args, **kwargs)`` as one transaction on the writer, failures as
        ``writing``'s (a ``body`` that only reads commits nothing).

        ``body`` is synchronous: on SQLite it runs whole in the writer connection's thread,
        one trip for all of its statements (``OneTripConnection.transaction``); on
        PostgreSQL it runs on the event loop, each statement awaited as usual. The worker's
        hot transactions (claims, group commits) and an idle worker's polls take this form,
        where a trip per statement cost as much as the SQL."""

        def call(conn: Connection) -> _T:
            return body(conn, *args, **kwargs)

        with _storage_errors(failing):
            if not self.is_sqlite:
                async with self.engine.begin() as conn:
                    return await conn.run_sync(call)
            # The pool's connection itself, without an ``AsyncConnection`` around it (whose
            # close is a task of its own: a fifth of a short transaction's CPU).
            pooled = await greenlet_spawn(self.engine.sync_engine.pool.connect)
            try:
                driver = pooled.driver_connection
                assert isinstance(driver, OneTripConnection)
                done = await driver.transaction(call)
            except BaseException:
                # Cut short (cancelled mid-trip), its check-in may wait for a rollback trip: it
                # must reach the pool, or the one writer connection is lost.
                await asyncio.shield(greenlet_spawn(pooled.close))
                raise
            # The transaction ended in its trip: the check-in makes none, and cannot be cut.
            await greenlet_spawn(pooled.close)
            return done

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.dispose()
        await self.engine.dispose()


@contextmanager
def _storage_errors(failing: str | None) -> Iterator[None]:
    """A write's "disk full" as StorageError; with ``failing``, any driver failure too."""
    try:
        yield
    except (DBAPIError, OSError) as exc:
        if isinstance(exc, DBAPIError) and out_of_room(exc):
            raise StorageError(
                "The database has no room left for this write; nothing was stored. Retry "
                "later, once an operator has freed space."
            ) from exc
        if failing is None:
            raise
        raise StorageError(
            f"The database failed while {failing}: {exc.__class__.__name__}."
        ) from exc
