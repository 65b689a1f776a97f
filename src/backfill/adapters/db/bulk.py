"""Statements run for many rows at once, handed to the driver as tuples.

At a million rows SQLAlchemy's per-row parameter processing (a dict per row, turned into the
driver's tuple) costs more than the database's own insert, and the worker pays it on every
request (a group commit stores a result and a receipt for each). A statement compiled once per
dialect and the driver's ``executemany`` leave only the database's work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Dialect, Insert, UpdateBase, bindparam
from sqlalchemy.ext.asyncio import AsyncConnection


class DriverStatement:
    """``stmt`` for rows given as tuples of the values of its bound ``params``, in that order:
    the order its compiled SQL takes them, which ``sql`` checks once per dialect (an UPDATE's
    SET values come in the table's column order, its WHERE values after).

    Values go to the driver as they are: no SQLAlchemy type processing, so each must already be
    what the driver takes (ints, strs, floats, bytes, None; an enum as its plain value).
    """

    def __init__(self, stmt: UpdateBase, params: Sequence[str]) -> None:
        self.params = tuple(params)
        self._stmt = stmt
        self._sql: dict[str, str] = {}

    def sql(self, dialect: Dialect) -> str:
        """The statement in the driver's own parameter style, compiled once per dialect."""
        sql = self._sql.get(dialect.name)
        if sql is None:
            compiled = self._stmt.compile(dialect=dialect)
            if tuple(compiled.positiontup or ()) != self.params:
                raise AssertionError(f"{compiled.positiontup} are not {self.params}")
            sql = self._sql[dialect.name] = compiled.string
        return sql

    async def run(self, conn: AsyncConnection, rows: Sequence[tuple[Any, ...]]) -> None:
        if rows:
            await conn.exec_driver_sql(self.sql(conn.dialect), rows)

    def run_in(self, conn: Connection, rows: Sequence[tuple[Any, ...]]) -> None:
        """``run`` inside a synchronous transaction (``SqlBase.in_one_trip``)."""
        if rows:
            conn.exec_driver_sql(self.sql(conn.dialect), rows)


class BulkInsert(DriverStatement):
    """An insert of rows given as tuples of ``columns``, in that order."""

    def __init__(self, stmt: Insert, columns: Sequence[str]) -> None:
        super().__init__(stmt.values({c: bindparam(c) for c in columns}), columns)
