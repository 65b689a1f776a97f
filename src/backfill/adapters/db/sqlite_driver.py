"""aiosqlite with one trip to the connection's thread per statement.

aiosqlite runs its sqlite3 connection in a thread of its own; every call is a trip there and
back (a queue, the event loop's wake-up, a future). SQLAlchemy's aiosqlite adapter makes four
for a read (open a cursor, execute, fetch, close) and three for a write. Here a cursor does its
whole statement in one trip: execute, fetch every row, close. And a commit or rollback with
no transaction open (the pool's rollback after every commit, the commit of a transaction that
only read) makes none. A statement's process CPU falls by about two fifths, and a drain runs
about one statement for every two or three requests (docs/performance.md).

The connection is a plain ``aiosqlite.Connection`` otherwise, so SQLAlchemy's adapter,
transactions and pool work on it unchanged; it is made with ``create_async_engine``'s
``async_creator`` from the arguments the dialect reads from the URL.

The worker's hot transactions (a claim, a group commit of results) go further: ``transaction``
runs a whole transaction, written against SQLAlchemy's synchronous ``Connection``, in one trip.
Its statements run in the connection's thread one after another with no trip, no greenlet
switch and no wake-up of the event loop between them; that takes about half the process CPU
of the same transaction made statement by statement (docs/performance.md).
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiosqlite
from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import StaticPool

_Done = tuple[Any, list[Any], int, int | None]
_T = TypeVar("_T")


class OneTripCursor:
    """The part of ``aiosqlite.Cursor`` SQLAlchemy's adapter uses for a non-streaming cursor
    (enter, execute, executemany, fetchall, close), each statement one trip. Every row is
    fetched in that trip, as the adapter itself does; Backfill opens no server-side cursors."""

    __slots__ = ("_conn", "_rows", "arraysize", "description", "lastrowid", "rowcount")

    def __init__(self, conn: OneTripConnection) -> None:
        self._conn = conn
        self._rows: list[Any] = []
        self.arraysize = 1
        self.description: Any = None
        self.rowcount = -1
        self.lastrowid: int | None = None

    async def __aenter__(self) -> OneTripCursor:
        return self

    def _run(self, many: bool, sql: str, params: Any) -> _Done:
        """In the connection's thread: the statement, its rows, its counts."""
        cursor = self._conn._conn.cursor()
        try:
            if many:
                cursor.executemany(sql, params)
            else:
                cursor.execute(sql, params)
            description = cursor.description
            rows = cursor.fetchall() if description else []
            return description, rows, cursor.rowcount, cursor.lastrowid
        finally:
            cursor.close()

    async def _trip(self, many: bool, sql: str, params: Any) -> OneTripCursor:
        done = await self._conn.trip(functools.partial(self._run, many, sql, params))
        self.description, self._rows, self.rowcount, self.lastrowid = done
        return self

    async def execute(self, sql: str, parameters: Any = ()) -> OneTripCursor:
        return await self._trip(False, sql, parameters)

    async def executemany(self, sql: str, parameters: Sequence[Any]) -> OneTripCursor:
        return await self._trip(True, sql, parameters)

    async def fetchall(self) -> list[Any]:
        rows, self._rows = self._rows, []
        return rows

    async def close(self) -> None:
        self._rows = []


class OneTripConnection(aiosqlite.Connection):
    # Whether the connection may be inside a transaction: read in its thread at the end of
    # every call there (sqlite3's ``in_transaction``), True while a call runs.
    _open = True
    # A synchronous engine over this one sqlite3 connection, for ``transaction``; made in the
    # connection's thread at its first use.
    _sync: Engine | None = None

    async def _execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._open = True
        call = functools.partial(fn, *args, **kwargs)
        return await super()._execute(self._noting, call)  # type: ignore[no-untyped-call]

    def _noting(self, call: Callable[[], Any]) -> Any:
        """In the connection's thread: ``call()``, then whether a transaction is open. The
        flag is set before the call's future is resolved, so its awaiter sees it."""
        try:
            return call()
        finally:
            try:
                self._open = self._conn.in_transaction
            except (ValueError, sqlite3.ProgrammingError):  # closed (by this call, maybe)
                self._open = True

    async def commit(self) -> None:
        # A transaction that only read opened none (sqlite3 begins before a write): a worker's
        # polls that find nothing (lapsed leases, due notifications) commit with nothing open,
        # and that trip would do nothing.
        if self._open:
            await super().commit()

    async def rollback(self) -> None:
        # SQLAlchemy's pool rolls back every connection it takes back, after a commit as well
        # (one per transaction): with no transaction open that trip would do nothing.
        if self._open:
            await super().rollback()

    async def trip(self, call: Callable[[], _T]) -> _T:
        """``call()`` in the connection's thread."""
        done: _T = await self._execute(call)
        return done

    async def transaction(self, body: Callable[[Connection], _T]) -> _T:
        """``body`` as one transaction, committed when it returns and rolled back when it
        raises, run whole in the connection's thread: one trip. The caller holds this
        connection (checked out of its pool), so nothing else runs on it meanwhile."""
        return await self.trip(functools.partial(self._transaction, body))

    def _transaction(self, body: Callable[[Connection], _T]) -> _T:
        if self._sync is None:
            # The pool hands out this connection and nothing else; it neither opens nor closes
            # it (the async engine's pool owns it), nor resets it: the block below ends every
            # transaction itself.
            self._sync = create_engine(
                "sqlite://",
                creator=lambda: self._conn,
                poolclass=StaticPool,
                pool_reset_on_return=None,
            )
        with self._sync.connect() as conn:
            try:
                done = body(conn)
            except BaseException:
                conn.rollback()
                raise
            conn.commit()
            return done

    def cursor(self) -> OneTripCursor:  # type: ignore[override]
        # No trip: the sqlite3 cursor is made (and closed) inside each statement's trip.
        return OneTripCursor(self)


def one_trip_creator(engine: Callable[[], AsyncEngine]) -> Callable[[], Awaitable[Any]]:
    """``create_async_engine``'s ``async_creator`` for ``engine()``'s URL: the connection
    arguments its dialect reads from the URL (path, ``uri``, ``check_same_thread``), given to
    a ``OneTripConnection``. ``engine`` is called at the first connection, once it exists."""

    async def connect() -> OneTripConnection:
        sync = engine().sync_engine
        args, kwargs = sync.dialect.create_connect_args(sync.url)
        conn = OneTripConnection(
            functools.partial(sqlite3.connect, *args, **kwargs), iter_chunk_size=64
        )
        # As aiosqlite.connect: a thread left running must not keep the process alive.
        conn._thread.daemon = True
        await conn  # starts the thread and connects
        return conn

    return connect
