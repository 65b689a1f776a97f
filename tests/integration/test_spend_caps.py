"""Spend caps through the API (docs/billing.md, "Spend caps"): the admin API and CLI that set
them, the 402 ``spend_cap_reached`` the openai SDK gets, the caps the org reads on
``GET /v1/organization``, room given back by a cancel, an expiry and a batch that costs less
than it reserved, and parallel creations on SQLite and PostgreSQL that never pass a cap."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from typer.testing import CliRunner

from backfill.adapters.clock import ManualClock
from backfill.cli.admin import app as admin_cli
from backfill.domain.money import Prices, pico_to_usd, worst_case
from backfill.ports import Clock
from tests.support import (
    FAST,
    SIM_PRICES,
    InProcess,
    backfill_on,
    chat_line,
    create_pg_database,
    drop_pg_database,
    in_process_backfill,
    jsonl,
)

NO_ENGINE_URL = "http://127.0.0.1:9/v1"
TOKEN = "admin-token-for-spend-cap-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PRICES = Prices.of(SIM_PRICES.input, SIM_PRICES.cached_input, SIM_PRICES.output)


def at(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp())


# A Saturday afternoon: the day resets at midnight, the ISO week on Monday, the month on the 1st.
NOW = at("2026-03-14T15:00:00")


@asynccontextmanager
async def queue_only(
    tmp_path: Path, *, clock: Clock | None = None, **overrides: Any
) -> AsyncIterator[InProcess]:
    """Backfill without engines on a clock set to ``NOW``: accepted batches stay unfinished."""
    async with in_process_backfill(
        tmp_path,
        NO_ENGINE_URL,
        engines=[],
        clock=clock or ManualClock(NOW),
        admin_token=TOKEN,
        max_unfinished_batches=100,
        **overrides,
    ) as bf:
        yield bf


async def upload(bf: InProcess, rows: int = 1) -> tuple[str, int]:
    """A file of ``rows`` lines, and what a batch of it reserves (picodollars)."""
    response = await bf.upload(jsonl([chat_line(f"r{i}", "one two three") for i in range(rows)]))
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    org = await bf.backfill.store.org_by_name("default")
    assert org is not None
    record = await bf.backfill.store.get_file(org.id, file_id)
    assert record is not None
    return file_id, worst_case(PRICES, record.prompt_token_bound, record.max_output_tokens)


async def set_cap(bf: InProcess, path: str, usd: str) -> dict[str, Any]:
    response = await bf.client.put(f"/admin/v1/{path}", json={"usd": usd}, headers=ADMIN)
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


def refusal(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 402, response.text
    assert response.headers["x-should-retry"] == "false"
    error: dict[str, Any] = response.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "spend_cap_reached",
        "spend_cap_reached",
        None,
    )
    return error


async def batch_count(bf: InProcess) -> int:
    listed = await bf.client.get("/v1/batches", params={"limit": 100})
    return len(listed.json()["data"])


@asynccontextmanager
async def sdk(bf: InProcess) -> AsyncIterator[tuple[openai.AsyncOpenAI, list[int]]]:
    """The openai SDK at its defaults against the app in process; the list counts attempts."""
    attempts: list[int] = []
    inner = httpx2.ASGITransport(app=bf.backfill.app())

    class Counting(httpx2.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            attempts.append(1)
            return await inner.handle_async_request(request)

    http = httpx2.AsyncClient(transport=Counting(), base_url="http://backfill.test")
    client = openai.AsyncOpenAI(
        api_key=bf.key, base_url="http://backfill.test/v1", http_client=http
    )
    try:
        yield client, attempts
    finally:
        await client.close()


async def test_the_sdk_gets_402_spend_cap_reached_naming_the_cap_and_its_reset(
    tmp_path: Path,
) -> None:
    async with queue_only(tmp_path) as bf:
        file_id, reserve = await upload(bf)
        cap = await set_cap(bf, "orgs/default/spend_caps/month", pico_to_usd(2 * reserve))
        org_id = (await bf.client.get("/v1/organization")).json()["id"]
        assert cap == {
            "id": f"{org_id}:month",
            "object": "spend_cap",
            "scope": "org",
            "key_id": None,
            "period": "month",
            "unit": "usd",
            "limit": pico_to_usd(2 * reserve),
            "charged": "0",
            "reserved": "0",
            "left": pico_to_usd(2 * reserve),
            "window_start": at("2026-03-01T00:00:00"),
            "resets_at": at("2026-04-01T00:00:00"),
            "updated_at": NOW,
        }
        async with sdk(bf) as (client, attempts):
            for _ in range(2):
                await client.batches.create(
                    input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
                )
            with pytest.raises(openai.APIStatusError) as refused:
                await client.batches.create(
                    input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
                )
        # One attempt for the refusal: the SDK does not retry it.
        assert len(attempts) == 3
        error = refused.value
        assert (error.status_code, error.code) == (402, "spend_cap_reached")
        limit = pico_to_usd(2 * reserve)
        assert f"this organization's monthly spend cap of {limit} USD" in error.message
        assert f"0 USD charged and {limit} USD still reserved" in error.message
        assert "since 2026-03-01T00:00:00Z" in error.message
        assert "The cap resets at 2026-04-01T00:00:00Z." in error.message
        assert f"needs up to {pico_to_usd(reserve)} USD" in error.message
        assert error.response.headers["retry-after"] == str(at("2026-04-01T00:00:00") - NOW)
        # Nothing was reserved or stored for it.
        assert await batch_count(bf) == 2
        org = (await bf.client.get("/v1/organization")).json()
        assert org["credit"]["reserved"] == limit
        assert [(c["period"], c["reserved"], c["left"]) for c in org["spend_caps"]] == [
            ("month", limit, "0")
        ]


async def test_a_key_cap_limits_that_key_only(tmp_path: Path) -> None:
    async with queue_only(tmp_path) as bf:
        file_id, reserve = await upload(bf)
        made = await bf.client.post(
            "/admin/v1/keys", json={"org": "default", "name": "nightly"}, headers=ADMIN
        )
        key_id, secret = made.json()["id"], made.json()["key"]
        as_key = {"Authorization": f"Bearer {secret}"}
        cap = await set_cap(bf, f"keys/{key_id}/spend_caps/day", pico_to_usd(reserve))
        assert (cap["scope"], cap["key_id"], cap["resets_at"]) == (
            "key",
            key_id,
            at("2026-03-15T00:00:00"),
        )
        body = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        assert (await bf.client.post("/v1/batches", json=body, headers=as_key)).status_code == 200
        refused = await bf.client.post("/v1/batches", json=body, headers=as_key)
        error = refusal(refused)
        assert (
            f"API key {key_id}'s daily spend cap of {pico_to_usd(reserve)} USD"
            in (error["message"])
        )
        assert "The cap resets at 2026-03-15T00:00:00Z." in error["message"]
        # Another key of the org is not limited by it.
        for _ in range(2):
            assert (await bf.client.post("/v1/batches", json=body)).status_code == 200
        org = (await bf.client.get("/v1/organization", headers=as_key)).json()
        assert [(c["scope"], c["key_id"], c["reserved"]) for c in org["spend_caps"]] == [
            ("key", key_id, pico_to_usd(reserve))
        ]


async def test_cancel_and_expiry_give_room_back(tmp_path: Path) -> None:
    clock = ManualClock(NOW)
    async with queue_only(tmp_path, clock=clock, min_completion_window_s=60) as bf:
        file_id, reserve = await upload(bf)
        await set_cap(bf, "orgs/default/spend_caps/week", pico_to_usd(reserve))
        first = await bf.create(file_id)
        assert first.status_code == 200, first.text
        refusal(await bf.create(file_id))

        cancelled = await bf.client.post(f"/v1/batches/{first.json()['id']}/cancel")
        assert cancelled.status_code == 200
        assert (await bf.wait(first.json()["id"]))["status"] == "cancelled"
        # An ended batch's input goes with it: each batch here gets a new upload.
        file_id, _ = await upload(bf)
        second = await bf.create(file_id, completion_window="60s")
        assert second.status_code == 200, second.text
        refusal(await bf.create(file_id))

        clock.advance(120)
        assert (await bf.wait(second.json()["id"]))["status"] == "expired"
        file_id, _ = await upload(bf)
        assert (await bf.create(file_id)).status_code == 200


async def test_an_ended_batch_counts_what_it_was_charged(tmp_path: Path) -> None:
    async with backfill_on(tmp_path, FAST, admin_token=TOKEN) as (bf, _):
        file_id, reserve = await upload(bf, rows=2)
        await set_cap(bf, "orgs/default/spend_caps/total", pico_to_usd(reserve))
        created = await bf.create(file_id)
        assert created.status_code == 200, created.text
        ended = await bf.wait(created.json()["id"])
        assert ended["status"] == "completed"
        charges = await bf.client.get("/v1/organization/batch_charges", params={"ids": ended["id"]})
        charged = int(charges.json()["data"][0]["charged"]["value"])
        assert 0 < charged < reserve
        caps = await bf.client.get("/admin/v1/orgs/default/spend_caps", headers=ADMIN)
        (cap,) = caps.json()["data"]
        assert (cap["charged"], cap["reserved"], cap["left"]) == (
            pico_to_usd(charged),
            "0",
            pico_to_usd(reserve - charged),
        )
        assert (cap["window_start"], cap["resets_at"]) == (None, None)
        # What it did not use is room again: a batch of one of its lines fits, but not one of
        # both (the ended batch's input went with it: new uploads).
        again, _ = await upload(bf, rows=2)
        refused = await bf.create(again)
        assert "An all-time cap does not reset" in refusal(refused)["message"]
        assert "retry-after" not in refused.headers
        smaller, half = await upload(bf, rows=1)
        assert half <= reserve - charged
        assert (await bf.create(smaller)).status_code == 200


async def test_the_admin_api_checks_what_it_is_given_and_is_audited(tmp_path: Path) -> None:
    async with queue_only(tmp_path) as bf:

        async def put(path: str, body: Any) -> httpx.Response:
            return await bf.client.put(f"/admin/v1/{path}", json=body, headers=ADMIN)

        for body, param in [
            ({"usd": "-1"}, "usd"),
            ({"usd": "abc"}, "usd"),
            ({"usd": 5}, "usd"),
            ({"usd": "9000000.000000000001"}, "usd"),
            ({"usd": "5", "currency": "eur"}, "currency"),
        ]:
            refused = await put("orgs/default/spend_caps/day", body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param
        refused = await put("orgs/default/spend_caps/year", {"usd": "5"})
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "period")
        assert (await put("orgs/nobody/spend_caps/day", {"usd": "5"})).status_code == 404
        assert (await put("keys/key_nothing/spend_caps/day", {"usd": "5"})).status_code == 404
        assert (await bf.client.get("/admin/v1/orgs/default/spend_caps")).status_code == 401

        await set_cap(bf, "orgs/default/spend_caps/day", "5")
        await set_cap(bf, "orgs/default/spend_caps/total", "0")
        listed = await bf.client.get("/admin/v1/orgs/default/spend_caps", headers=ADMIN)
        assert [(c["period"], c["limit"]) for c in listed.json()["data"]] == [
            ("day", "5"),
            ("total", "0"),
        ]
        removed = await bf.client.delete("/admin/v1/orgs/default/spend_caps/day", headers=ADMIN)
        assert removed.json() == {
            "object": "spend_cap.deleted",
            "scope": "org",
            "org": "default",
            "key_id": None,
            "period": "day",
            "deleted": True,
        }
        again = await bf.client.delete("/admin/v1/orgs/default/spend_caps/day", headers=ADMIN)
        assert again.status_code == 404

        audit = await bf.client.get(
            "/admin/v1/audit", params={"action": "spend_cap.set"}, headers=ADMIN
        )
        assert [(e["target"], e["outcome"]) for e in audit.json()["data"]][:2] == [
            ("default", "succeeded"),
            ("default", "succeeded"),
        ]
        audit = await bf.client.get(
            "/admin/v1/audit", params={"action": "spend_cap.delete"}, headers=ADMIN
        )
        assert [(e["outcome"], e["status"]) for e in audit.json()["data"]] == [
            ("failed", 404),
            ("succeeded", 200),
        ]


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_parallel_creates_never_pass_a_cap(tmp_path: Path, database: str) -> None:
    """Twelve creations at once, each of which fits the cap alone: three are accepted, the
    others get 402, and only three reservations are held."""
    url = await create_pg_database() if database == "postgresql" else ""
    try:
        async with queue_only(tmp_path, database_url=url) as bf:
            file_id, reserve = await upload(bf)
            await set_cap(bf, "orgs/default/spend_caps/day", pico_to_usd(3 * reserve))
            answers = await asyncio.gather(*(bf.create(file_id) for _ in range(12)))
            codes = sorted(a.status_code for a in answers)
            assert codes == [200] * 3 + [402] * 9, [a.text for a in answers]
            for answer in answers:
                if answer.status_code == 402:
                    refusal(answer)
            assert await batch_count(bf) == 3
            org = (await bf.client.get("/v1/organization")).json()
            assert org["credit"]["reserved"] == pico_to_usd(3 * reserve)
            assert org["spend_caps"][0]["left"] == "0"
    finally:
        if url:
            await drop_pg_database(url)


def test_the_cli_sets_lists_and_removes_caps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BACKFILL_CONFIG", raising=False)
    data = str(tmp_path / "data")
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> str:
        result = runner.invoke(admin_cli, [*args, "--data", data])
        assert result.exit_code == code, result.output
        return result.output

    cli("org", "create", "acme")
    cli("key", "create", "--org", "acme", "--name", "ci")
    key_id = json.loads(cli("key", "list", "--org", "acme", "--json"))["data"][0]["id"]
    shown = json.loads(
        cli("spend-cap", "set", "--org", "acme", "--period", "month", "--usd", "100")
    )
    assert (shown["scope"], shown["period"], shown["limit"], shown["left"]) == (
        "org",
        "month",
        "100",
        "100",
    )
    cli("spend-cap", "set", "--key", key_id, "--period", "day", "--usd", "2.5")
    assert "give either --org NAME or --key KEY_ID" in cli(
        "spend-cap", "set", "--period", "day", "--usd", "1", code=2
    )
    assert "'period' must be one of day, week, month, total" in cli(
        "spend-cap", "set", "--org", "acme", "--period", "year", "--usd", "1", code=1
    )
    table = cli("spend-cap", "list", "acme")
    assert "the org" in table
    assert key_id in table
    assert "2.5" in table
    listed = json.loads(cli("spend-cap", "list", "acme", "--json"))
    assert [(c["scope"], c["period"], c["limit"]) for c in listed["data"]] == [
        ("org", "month", "100"),
        ("key", "day", "2.5"),
    ]
    assert "Removed the day spend cap of API key" in cli(
        "spend-cap", "remove", "--key", key_id, "--period", "day"
    )
    cli("spend-cap", "remove", "--key", key_id, "--period", "day", code=1)
    cli("spend-cap", "remove", "--org", "acme", "--period", "month")
    assert "have no spend caps" in cli("spend-cap", "list", "acme")
    audit = json.loads(cli("audit", "--json"))
    assert [(e["action"], e["outcome"]) for e in audit["data"][:4]] == [
        ("spend_cap.delete", "succeeded"),
        ("spend_cap.delete", "failed"),
        ("spend_cap.delete", "succeeded"),
        ("spend_cap.set", "failed"),
    ]
