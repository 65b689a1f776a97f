"""Inserts of many rows at once, handed to the driver as tuples.

At a million rows SQLAlchemy's per-row parameter processing (a dict per row, turned into the
driver's tuple) costs more than the database's own insert; a statement compiled once per
dialect and the driver's ``executemany`` leave only the database's work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Insert, bindparam
from sqlalchemy.ext.asyncio import AsyncConnection


class BulkInsert:
    """``stmt`` for rows given as tuples of ``columns``, in that order.

    Values go to the driver as they are: no SQLAlchemy type processing, so each must already be
    what the driver takes (ints, strs, floats, bytes; an enum as its plain value).
    """

    def __init__(self, stmt: Insert, columns: Sequence[str]) -> None:
        self.columns = tuple(columns)
        self._stmt = stmt.values({c: bindparam(c) for c in self.columns})
        self._sql: dict[str, str] = {}

    def sql(self, conn: AsyncConnection) -> str:
        """The statement in the driver's own parameter style, compiled once per dialect."""
        dialect = conn.dialect
        sql = self._sql.get(dialect.name)
        if sql is None:
            compiled = self._stmt.compile(dialect=dialect)
            if tuple(compiled.positiontup or ()) != self.columns:
                raise AssertionError(f"{compiled.positiontup} are not {self.columns}")
            sql = self._sql[dialect.name] = compiled.string
        return sql

    async def run(self, conn: AsyncConnection, rows: Sequence[tuple[Any, ...]]) -> None:
        if rows:
            await conn.exec_driver_sql(self.sql(conn), rows)
