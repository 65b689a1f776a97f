"""The store every contract test runs against: one fresh database per test, on SQLite and on
PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backfill.adapters.db.store import SqlStore
from tests.contract.test_store import STORE_URLS
from tests.support import create_pg_database, drop_pg_database


@pytest.fixture(params=sorted(STORE_URLS))
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SqlStore]:
    url = STORE_URLS[request.param](tmp_path) or await create_pg_database()
    made = SqlStore(url)
    await made.init()
    try:
        yield made
    finally:
        await made.close()
        if request.param == "postgresql":
            await drop_pg_database(url)
