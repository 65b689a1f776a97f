"""The database engine: URLs, SQLite pragmas, migrations at start."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from backfill.adapters.db.migrate import upgrade


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the writer; FULL makes every commit survive power loss,
    # which is what "a result counts once it is durably stored" needs.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


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


class SqlBase:
    """The engine and the schema; the query mixins of ``SqlStore`` build on it."""

    def __init__(self, url: str) -> None:
        url = async_url(url)
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            # One connection: SQLite has one writer anyway, and serialising here avoids
            # "database is locked" retries under load.
            self.engine: AsyncEngine = create_async_engine(
                url, poolclass=AsyncAdaptedQueuePool, pool_size=1, max_overflow=0
            )
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        else:
            self.engine = create_async_engine(url, pool_size=10, max_overflow=10)

    async def init(self) -> None:
        """Bring the schema up to date (Alembic); safe when several processes start at once."""
        async with self.engine.begin() as conn:
            if not self.is_sqlite:
                await conn.execute(text("SELECT pg_advisory_xact_lock(4242001)"))
            await conn.run_sync(upgrade)

    async def close(self) -> None:
        await self.engine.dispose()
