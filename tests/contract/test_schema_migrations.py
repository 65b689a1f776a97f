"""The migrations build exactly the schema ``tables.py`` declares, on SQLite and PostgreSQL;
0008 numbers the stored results of batches that were running when it ran, and 0017 names
every stored model by its id."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.engine import Connection

from backfill.adapters.db import tables as t
from backfill.adapters.db.migrate import alembic_config
from backfill.adapters.db.store import SqlStore
from backfill.domain.catalog import CatalogModel
from backfill.errors import InvalidInput
from tests.support import create_pg_database, drop_pg_database


@pytest.fixture(params=["postgresql", "sqlite"])
async def url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    pg = request.param == "postgresql"
    made = await create_pg_database() if pg else f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    try:
        yield made
    finally:
        if pg:
            await drop_pg_database(made)


def _differences(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection)
    return list(compare_metadata(context, t.metadata))


async def test_the_migrated_schema_is_the_declared_one(url: str) -> None:
    store = SqlStore(url)
    try:
        await store.init()
        async with store.engine.connect() as conn:
            differences = await conn.run_sync(_differences)
    finally:
        await store.close()
    assert differences == []


async def test_0008_numbers_the_results_of_running_batches(url: str) -> None:
    store = SqlStore(url)
    try:
        async with store.engine.begin() as conn:
            await conn.run_sync(lambda c: command.upgrade(alembic_config(c), "0007"))
            await conn.execute(text("INSERT INTO orgs (id, name, created_at) VALUES ('o', 'o', 1)"))
            for batch_id, status in [("running", "in_progress"), ("over", "completed")]:
                await conn.execute(
                    text(
                        "INSERT INTO batches (id, org_id, seq, endpoint, model, model_config_id,"
                        " input_file_id, completion_window, status, created_at, expires_at,"
                        " total, completed, failed, input_tokens, output_tokens)"
                        " VALUES (:id, 'o', 1, '/v1/chat/completions', 'm', 'm1', 'f', '24h',"
                        " :status, 1, 2, 3, 0, 0, 0, 0)"
                    ),
                    {"id": batch_id, "status": status},
                )
                for idx, result in [(0, b"sealed"), (1, None), (2, b"sealed")]:
                    await conn.execute(
                        text(
                            'INSERT INTO items (batch_id, idx, "offset", length, custom_id,'
                            " state, result) VALUES (:b, :i, 0, 1, :c, :s, :r)"
                        ),
                        {
                            "b": batch_id,
                            "i": idx,
                            "c": f"c{idx}",
                            "s": 2 if result else 0,
                            "r": result,
                        },
                    )
        await store.init()
        async with store.engine.connect() as conn:
            numbered = (
                await conn.execute(
                    text("SELECT batch_id, idx, done_seq FROM items ORDER BY batch_id, idx")
                )
            ).all()
            seqs = {
                row.id: row.results_seq
                for row in await conn.execute(text("SELECT id, results_seq FROM batches"))
            }
    finally:
        await store.close()
    assert [tuple(row) for row in numbered] == [
        ("over", 0, None),
        ("over", 1, None),
        ("over", 2, None),
        ("running", 0, 1),
        ("running", 1, None),
        ("running", 2, 3),
    ]
    assert seqs == {"running": 3, "over": 0}


async def test_0017_gives_every_stored_model_its_id_as_a_name(url: str) -> None:
    """Entries made before aliases existed are known by their ids: none of their ids can
    become another model's alias afterwards."""
    store = SqlStore(url)
    try:
        async with store.engine.begin() as conn:
            await conn.run_sync(lambda c: command.upgrade(alembic_config(c), "0016"))
            for model_id in ("old/a", "old-b"):
                await conn.execute(
                    text(
                        "INSERT INTO models (id, model_config_id, context_length,"
                        " max_output_tokens, modalities, updated_at)"
                        " VALUES (:id, 'v1', 4096, 256, 'text', 1)"
                    ),
                    {"id": model_id},
                )
        await store.init()
        stored = {m.id: m.aliases for m in await store.list_models()}
        assert stored == {"old/a": frozenset(), "old-b": frozenset()}
        taking = CatalogModel("new", "v1", 4096, 256, aliases=frozenset({"old/a"}))
        with pytest.raises(InvalidInput, match="'old/a' is the id of model 'old/a'"):
            await store.upsert_model(taking, 2, replace=True)
    finally:
        await store.close()
