"""SQLite's read connections: the API's hot reads run beside the one writer, see every write
committed before them, and an in-memory database (one connection's own) has none."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from backfill.adapters.db.store import SqlStore
from tests.contract.test_store import make_batch, make_org


@pytest.mark.parametrize("url", ["sqlite+aiosqlite://", "sqlite+aiosqlite:///:memory:"])
async def test_an_in_memory_database_reads_on_its_one_connection(url: str) -> None:
    store = SqlStore(url)
    await store.init()
    try:
        assert store.reads is store.engine
        org = await make_org(store)
        batch = await make_batch(store, org, 3)
        assert await store.get_batch(org.id, batch.id) is not None
        assert await store.api_key_by_hash("no such hash") is None
    finally:
        await store.close()


async def test_a_file_database_reads_on_read_only_connections_that_see_each_commit(
    tmp_path: Path,
) -> None:
    store = SqlStore(f"sqlite+aiosqlite:///{tmp_path}/backfill.db")
    await store.init()
    try:
        assert store.reads is not store.engine
        org = await make_org(store)
        batch = await make_batch(store, org, 3)
        # Committed on the writer, read at once on a reader.
        found = await store.get_batch(org.id, batch.id)
        assert found is not None
        assert found.status == "in_progress"
        assert await store.transition(batch.id, ["in_progress"], "cancelling", 5)
        found = await store.get_batch(org.id, batch.id)
        assert found is not None
        assert found.status == "cancelling"
        async with store.reads.connect() as conn:
            with pytest.raises(OperationalError, match=r"readonly"):
                await conn.exec_driver_sql("DELETE FROM batches")
    finally:
        await store.close()
