"""The migrations build exactly the schema ``tables.py`` declares, on SQLite and PostgreSQL;
0008 numbers the stored results of batches that were running when it ran, 0017 names every
stored model by its id, and 0018 counts what was spent before spend caps existed."""

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
from backfill.domain.spend_caps import CapScope, Period, SpendCap
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


async def test_0018_counts_what_was_spent_before_caps_existed(url: str) -> None:
    """Every batch, every span of GPU time and the charges of batches deleted before 0018 count
    under the caps set after it, each in its own window."""
    store = SqlStore(url)
    try:
        async with store.engine.begin() as conn:
            await conn.run_sync(lambda c: command.upgrade(alembic_config(c), "0017"))
            await conn.execute(text("INSERT INTO orgs (id, name, created_at) VALUES ('o', 'o', 1)"))
            for batch_id, status, created, charged, reserved in [
                ("running", "in_progress", 86_400 * 10 + 5, 30, 70),
                ("over", "completed", 86_400 * 10 + 9, 40, 0),
                ("yesterday", "cancelled", 86_400 * 9, 1000, 0),
            ]:
                await conn.execute(
                    text(
                        "INSERT INTO batches (id, org_id, seq, endpoint, model, model_config_id,"
                        " input_file_id, completion_window, status, created_at, expires_at,"
                        " total, completed, failed, input_tokens, output_tokens, charged,"
                        " reserved) VALUES (:id, 'o', 1, '/v1/chat/completions', 'm', 'm1', 'f',"
                        " '24h', :status, :created, :created, 3, 0, 0, 0, 0, :charged, :reserved)"
                    ),
                    {
                        "id": batch_id,
                        "status": status,
                        "created": created,
                        "charged": charged,
                        "reserved": reserved,
                    },
                )
            for request_id, kind, charged_batch, amount, at in [
                ("req_gpu", "gpu_time", None, 5, 86_400 * 10 + 100.75),
                ("req_gpu_2", "gpu_time", None, 2, 86_400 * 11 - 0.5),
                ("req_gone_1", "tokens", "gone", 200, 86_400 * 10 + 7.5),
                ("req_gone_2", "tokens", "gone", 300, 86_400 * 10 + 8.0),
                ("req_over", "tokens", "over", 40, 86_400 * 10 + 10.0),
            ]:
                await conn.execute(
                    text(
                        "INSERT INTO receipts (request_id, org_id, kind, batch_id, amount,"
                        " created_at) VALUES (:id, 'o', :kind, :batch, :amount, :at)"
                    ),
                    {
                        "id": request_id,
                        "kind": kind,
                        "batch": charged_batch,
                        "amount": amount,
                        "at": at,
                    },
                )
        await store.init()
        async with store.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT id, api_key_id, created_at, amount, settled FROM spend ORDER BY id"
                    )
                )
            ).all()
        day = SpendCap(CapScope.ORG, "o", "o", Period.DAY, 10**6, 1)
        await store.put_spend_cap(day, 86_400 * 10 + 50)
        today = (await store.spend_cap_uses("o", 86_400 * 10 + 50))[0]
    finally:
        await store.close()
    assert [tuple(row) for row in rows] == [
        ("gone", None, 86_400 * 10 + 7, 500, True),
        ("gpu_o_10", None, 86_400 * 10, 7, True),
        ("over", None, 86_400 * 10 + 9, 40, True),
        ("running", None, 86_400 * 10 + 5, 30, False),
        ("yesterday", None, 86_400 * 9, 1000, True),
    ]
    # The running batch is read live: 30 charged so far and 70 still reserved.
    assert (today.charged, today.reserved) == (30 + 40 + 500 + 7, 70)
