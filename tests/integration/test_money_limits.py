"""Money at any size Backfill accepts, on SQLite and PostgreSQL (SPEC §7.3, §7.7, §11.3).

Balances are int64 picodollars: credits and balances have documented caps that are checked
before anything is written, the ledger's sums are exact past int64 (lifetime credits can exceed
any balance), and the admin answer is what the crediting transaction committed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select, text

from backfill.adapters.db import tables
from backfill.domain.money import MAX_BALANCE_USD, MAX_CREDIT_USD, PICO_PER_USD
from tests.support import (
    InProcess,
    create_pg_database,
    drop_pg_database,
    in_process_backfill,
    running_simulator,
)

TOKEN = "admin-secret-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(params=["sqlite", "postgresql"])
async def bf(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InProcess]:
    url = await create_pg_database() if request.param == "postgresql" else ""
    try:
        async with (
            running_simulator() as (sim_url, _),
            in_process_backfill(tmp_path, sim_url, database_url=url, admin_token=TOKEN) as running,
        ):
            yield running
    finally:
        if url:
            await drop_pg_database(url)


async def post(bf: InProcess, path: str, body: dict[str, Any]) -> Any:
    return await bf.client.post(path, json=body, headers=ADMIN)


def refused(response: Any, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    message: str = error["message"]
    return message


async def test_balance_cap_is_checked_before_writing(bf: InProcess) -> None:
    await post(bf, "/admin/v1/orgs", {"name": "whale"})
    # Nine credits of the per-credit maximum reach the balance cap exactly.
    for n in range(1, MAX_BALANCE_USD // MAX_CREDIT_USD + 1):
        added = await post(bf, "/admin/v1/credits", {"org": "whale", "usd": str(MAX_CREDIT_USD)})
        assert added.status_code == 200, added.text
        # The answer is the crediting transaction's own view of the ledger.
        assert added.json()["balance"] == str(n * MAX_CREDIT_USD)
        assert added.json()["credits"] == str(n * MAX_CREDIT_USD)
    over = await post(bf, "/admin/v1/credits", {"org": "whale", "usd": "0.000000000001"})
    message = refused(over, "usd")
    assert f"at most {MAX_BALANCE_USD} USD" in message
    assert "Nothing was credited" in message

    ledger = (await bf.client.get("/admin/v1/orgs/whale/ledger", headers=ADMIN)).json()
    assert ledger["balance"] == ledger["credits"] == str(MAX_BALANCE_USD)
    engine = bf.backfill.store.engine
    async with engine.connect() as conn:
        credits = (await conn.execute(select(tables.credits.c.amount))).scalars().all()
        assert len(credits) == 1 + MAX_BALANCE_USD // MAX_CREDIT_USD  # with default's start
        if bf.backfill.store.is_sqlite:
            kind = await conn.execute(text("SELECT typeof(balance) FROM orgs WHERE name='whale'"))
            assert kind.scalar_one() == "integer"


async def test_amounts_beyond_the_limits_are_400_not_500(bf: InProcess) -> None:
    for usd in ("1e30", "12345678901234567890", "1000000.000000000001", "NaN", "-5", "0", "x"):
        message = refused(
            await post(bf, "/admin/v1/credits", {"org": "default", "usd": usd}), "usd"
        )
        assert f"at most {MAX_CREDIT_USD}" in message
    too_long = await post(bf, "/admin/v1/credits", {"org": "default", "usd": "1" * 65})
    assert refused(too_long, "usd")
    ledger = (await bf.client.get("/admin/v1/orgs/default/ledger", headers=ADMIN)).json()
    assert ledger["credits"] == "1000"  # only the starting credit

    model = {"model_config_id": "m-1", "batch": {"input": 10**30, "output": 1}}
    message = refused(
        await bf.client.put("/admin/v1/models/m", json=model, headers=ADMIN), "pricing.input"
    )
    assert "10000000000" in message
    for field in ("context_length", "max_output_tokens", "throughput_tokens_per_s"):
        body = {"model_config_id": "m-1", field: 10**30}
        put = await bf.client.put("/admin/v1/models/m", json=body, headers=ADMIN)
        refused(put, field)
    gpu = {"org": "default", "model_config_id": "d-1", "microusd_per_gpu_second": 10**30}
    put = await bf.client.put("/admin/v1/deployments/d", json=gpu, headers=ADMIN)
    refused(put, "microusd_per_gpu_second")
    models = (await bf.client.get("/admin/v1/models", headers=ADMIN)).json()["data"]
    assert {m["id"] for m in models} == {"sim-model"}


async def test_org_names_are_printable_and_bounded(bf: InProcess) -> None:
    for name in ("evil\u0000\n\u202e", "tab\tname", "\u200bhidden", " padded", "n" * 65, ""):
        assert refused(await post(bf, "/admin/v1/orgs", {"name": name}), "name")
    assert (await post(bf, "/admin/v1/orgs", {"name": "Ünïcode Org 42"})).status_code == 200
    # Lookups by such names are simply not found, on PostgreSQL too (no NUL reaches it).
    for name in ("evil%00", "x" * 300):
        missing = await bf.client.get(f"/admin/v1/orgs/{name}/ledger", headers=ADMIN)
        assert missing.status_code == 404, missing.text
    nul = await post(bf, "/admin/v1/credits", {"org": "a\u0000b", "usd": "1"})
    assert nul.status_code == 404, nul.text
    note = await post(bf, "/admin/v1/credits", {"org": "default", "usd": "1", "note": "a\u0000"})
    assert refused(note, "note")


async def test_ledger_sums_past_int64_are_exact(bf: InProcess) -> None:
    """Lifetime credits of a long-lived org can exceed 2**63 pUSD while its balance cannot."""
    store: Any = bf.backfill.store
    org = await store.org_by_name("default")
    big = MAX_CREDIT_USD * PICO_PER_USD
    count = 10_000  # 10**4 x 10**18 = 10**22 pUSD, far past 2**63 (about 9.2 x 10**18)
    async with store.engine.begin() as conn:
        await conn.execute(
            insert(tables.credits),
            [
                {"id": f"cr_{uuid.uuid4().hex}", "org_id": org.id, "amount": big, "created_at": 1}
                for _ in range(count)
            ],
        )
    ledger = await store.ledger(org.id)
    assert ledger.credits == count * big + 1000 * PICO_PER_USD
    shown = (await bf.client.get("/admin/v1/orgs/default/ledger", headers=ADMIN)).json()
    assert shown["credits"] == str(count * MAX_CREDIT_USD + 1000)
