"""``POST /v1/batches/estimate`` against the creation that follows it (docs/api.md, "Estimating a
batch"), and the cost the batch object carries, on SQLite and PostgreSQL.

An estimate must say what creating the same body would do at that moment: the same reservation
to the picodollar, the same admission (accepted, or refused with the same status and code), and
store nothing. The creation right after it is the reference.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from backfill.adapters.clock import ManualClock
from backfill.domain.money import Prices, pico_to_usd, token_charge, usd_to_pico, worst_case
from backfill.domain.scheduling.planning import ModelRate, Plan
from tests.integration.test_admission import EXPENSIVE, NO_ENGINE_URL
from tests.support import (
    SIM_MODEL,
    SIM_PRICES,
    InProcess,
    chat_line,
    create_pg_database,
    drop_pg_database,
    eventually,
    in_process_backfill,
    jsonl,
    running_simulator,
)

TOKEN = "admin-token-for-estimate-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PRICES = Prices.of(SIM_PRICES.input, SIM_PRICES.cached_input, SIM_PRICES.output)
NOW = 1_773_500_400.0
# EXPENSIVE's 1 USD per token: a line allowed 1,000 output tokens needs more than the 1,000 USD
# of credit.


@pytest.fixture(params=["sqlite", "postgresql"])
async def database_url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The database of the test's Backfill: SQLite in its data folder (""), or a fresh
    PostgreSQL database."""
    if request.param == "sqlite":
        yield ""
        return
    url = await create_pg_database()
    try:
        yield url
    finally:
        await drop_pg_database(url)


@asynccontextmanager
async def queue_only(
    tmp_path: Path, database_url: str, **overrides: Any
) -> AsyncIterator[InProcess]:
    """Backfill without engines on a clock that stands still: accepted batches stay queued."""
    async with in_process_backfill(
        tmp_path,
        NO_ENGINE_URL,
        engines=[],
        clock=ManualClock(NOW),
        admin_token=TOKEN,
        database_url=database_url,
        **overrides,
    ) as bf:
        yield bf


def body(file_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **extra,
    }


async def upload(bf: InProcess, rows: list[dict[str, Any]]) -> str:
    response = await bf.upload(jsonl(rows))
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


async def estimate(bf: InProcess, file_id: str, **extra: Any) -> dict[str, Any]:
    response = await bf.client.post("/v1/batches/estimate", json=body(file_id, **extra))
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


async def bounds(bf: InProcess, file_id: str) -> tuple[int, int]:
    """The file's prompt-token bound and summed max_tokens, as validation stored them."""
    org = await bf.backfill.store.org_by_name("default")
    assert org is not None
    record = await bf.backfill.store.get_file(org.id, file_id)
    assert record is not None
    return record.prompt_token_bound, record.max_output_tokens


async def state(bf: InProcess, file_id: str) -> tuple[Any, ...]:
    """What an estimate must leave as it was: the batches, the org's credit and caps, and the
    input file's expiry (a creation extends it)."""
    batches = (await bf.client.get("/v1/batches", params={"limit": 100})).json()["data"]
    org = (await bf.client.get("/v1/organization")).json()
    file = (await bf.client.get(f"/v1/files/{file_id}")).json()
    return [b["id"] for b in batches], org["credit"], org["spend_caps"], file["expires_at"]


async def agree(bf: InProcess, file_id: str, status: int, code: str) -> dict[str, Any]:
    """An estimate that says creation would be refused with ``status`` and ``code``, which
    stores nothing; then the creation itself, refused the same way."""
    before = await state(bf, file_id)
    found = await estimate(bf, file_id)
    assert await state(bf, file_id) == before
    admission = found["admission"]
    assert admission["admitted"] is False
    error = admission["error"]
    assert (error["status"], error["code"]) == (status, code), error
    created = await bf.client.post("/v1/batches", json=body(file_id))
    assert created.status_code == status, created.text
    refused = created.json()["error"]
    assert (refused["code"], refused["type"]) == (error["code"], error["type"])
    assert refused["message"] == error["message"]
    assert await state(bf, file_id) == before
    return found


async def test_an_estimate_stores_nothing_and_the_creation_reserves_its_worst_case(
    tmp_path: Path, database_url: str
) -> None:
    async with queue_only(tmp_path, database_url) as bf:
        rows = [chat_line(f"r{i}", f"question {i}", max_tokens=32 + i) for i in range(5)]
        file_id = await upload(bf, rows)
        before = await state(bf, file_id)
        found = await estimate(bf, file_id, metadata={"team": "search"})
        again = await estimate(bf, file_id, metadata={"team": "search"})
        assert found == again
        assert await state(bf, file_id) == before

        bound, max_output = await bounds(bf, file_id)
        reserve = worst_case(PRICES, bound, max_output)
        assert found["object"] == "batch.estimate"
        assert (found["model"], found["model_config_id"]) == (SIM_MODEL, "sim-model-v1")
        assert (found["request_count"], found["billing"], found["unit"]) == (5, "catalog", "usd")
        assert found["expires_at"] == NOW + 24 * 3600
        assert max_output == sum(32 + i for i in range(5))
        assert found["worst_case"] == {
            "input_tokens": bound,
            "output_tokens": max_output,
            "cost": pico_to_usd(reserve),
        }
        # Nothing answered yet: every line at its max_tokens, priced without cached input.
        assert found["expected"] == {
            "input_tokens": bound,
            "output_tokens": max_output,
            "cost": pico_to_usd(token_charge(PRICES, bound, 0, max_output)),
            "basis": "max_tokens",
            "sample": {"size": 0, "output_tokens_per_request": None},
        }
        assert found["admission"] == {
            "admitted": True,
            "available_credit": before[1]["available"],
            "error": None,
        }
        # No rate is measured for the model yet.
        assert found["estimated_completion_at"] is None

        created = await bf.client.post("/v1/batches", json=body(file_id, metadata={"team": "x"}))
        assert created.status_code == 200, created.text
        batch = created.json()
        assert batch["cost"] == {
            "unit": "usd",
            "charged": "0",
            "reserved": found["worst_case"]["cost"],
        }
        assert (batch["expires_at"], batch["model"]) == (found["expires_at"], found["model"])
        charges = (
            await bf.client.get("/v1/organization/batch_charges", params={"ids": batch["id"]})
        ).json()["data"]
        # To the picodollar.
        assert charges[0]["reserved"]["value"] == str(reserve)
        assert usd_to_pico(found["worst_case"]["cost"]) == reserve
        org = (await bf.client.get("/v1/organization")).json()["credit"]
        assert org["reserved"] == pico_to_usd(reserve)


async def test_refused_for_credit_as_the_creation_is(tmp_path: Path, database_url: str) -> None:
    async with queue_only(tmp_path, database_url, models=[EXPENSIVE]) as bf:
        file_id = await upload(bf, [chat_line("big", max_tokens=1000)])
        found = await agree(bf, file_id, 402, "insufficient_credit")
        assert "add credit" in found["admission"]["error"]["message"]
        assert found["admission"]["available_credit"] == "1000"


async def test_refused_by_a_spend_cap_as_the_creation_is(tmp_path: Path, database_url: str) -> None:
    async with queue_only(tmp_path, database_url) as bf:
        file_id = await upload(bf, [chat_line("a"), chat_line("b")])
        cap = await bf.client.put(
            "/admin/v1/orgs/default/spend_caps/day", json={"usd": "0.000001"}, headers=ADMIN
        )
        assert cap.status_code == 200, cap.text
        found = await agree(bf, file_id, 402, "spend_cap_reached")
        assert found["admission"]["error"]["retry_after_s"] is None
        # Room again: the estimate says so, and the creation agrees.
        removed = await bf.client.delete("/admin/v1/orgs/default/spend_caps/day", headers=ADMIN)
        assert removed.status_code == 200, removed.text
        assert (await estimate(bf, file_id))["admission"]["admitted"] is True
        assert (await bf.client.post("/v1/batches", json=body(file_id))).status_code == 200


async def test_refused_by_the_unfinished_batch_limit_as_the_creation_is(
    tmp_path: Path, database_url: str
) -> None:
    async with queue_only(tmp_path, database_url, max_unfinished_batches=1) as bf:
        first = await upload(bf, [chat_line("a")])
        assert (await estimate(bf, first))["admission"]["admitted"] is True
        assert (await bf.client.post("/v1/batches", json=body(first))).status_code == 200
        second = await upload(bf, [chat_line("b")])
        await agree(bf, second, 429, "too_many_unfinished_batches")


async def test_completion_is_behind_the_models_queue_and_capacity_refusals_agree(
    tmp_path: Path, database_url: str
) -> None:
    async with queue_only(tmp_path, database_url, max_unfinished_batches=10) as bf:
        # The model serves 0.01 requests a second, as the planner measured it.
        rate = ModelRate(SIM_MODEL, 0.01, NOW - 1, 0, busy=False)
        await bf.backfill.store.apply_plan(Plan(rates=[rate], lanes=[], estimates={}))
        ahead = await upload(bf, [chat_line(f"a{i}") for i in range(30)])
        assert (await bf.client.post("/v1/batches", json=body(ahead))).status_code == 200

        mine = await upload(bf, [chat_line(f"m{i}") for i in range(20)])
        found = await estimate(bf, mine)
        # 30 lines ahead and 20 of its own at 0.01 a second.
        assert found["estimated_completion_at"] == math.ceil(NOW + 50 / 0.01)
        assert found["admission"]["admitted"] is True

        # More than the 24h window holds behind them (864 requests at that rate).
        too_many = await upload(bf, [chat_line(f"t{i}") for i in range(900)])
        found = await agree(bf, too_many, 429, "capacity_exceeded")
        assert found["estimated_completion_at"] > found["expires_at"]
        assert found["admission"]["error"]["retry_after_s"] is not None


async def test_a_faulty_body_is_refused_as_creation_refuses_it(
    tmp_path: Path, database_url: str
) -> None:
    async with queue_only(tmp_path, database_url) as bf:
        file_id = await upload(bf, [chat_line("a")])
        for faulty in (
            body(file_id, webhook="https://example.com"),
            body(file_id, completion_window="1h"),
            body("file-doesnotexist"),
            body(file_id, endpoint="/v1/completions"),
        ):
            estimated = await bf.client.post("/v1/batches/estimate", json=faulty)
            created = await bf.client.post("/v1/batches", json=faulty)
            assert estimated.status_code == created.status_code >= 400, estimated.text
            assert estimated.json() == created.json()
            assert estimated.headers["x-should-retry"] == "false"
        assert (await bf.client.get("/v1/batches")).json()["data"] == []


async def test_the_estimate_needs_the_scope_of_creation(tmp_path: Path, database_url: str) -> None:
    async with queue_only(tmp_path, database_url) as bf:
        file_id = await upload(bf, [chat_line("a")])
        made = await bf.client.post(
            "/admin/v1/keys",
            json={"org": "default", "scopes": ["requests:read"], "name": "viewer"},
            headers=ADMIN,
        )
        assert made.status_code == 200, made.text
        reader = {"Authorization": f"Bearer {made.json()['key']}"}
        refused = await bf.client.post("/v1/batches/estimate", json=body(file_id), headers=reader)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "insufficient_scope"
        # Only POST is the estimate: a GET asks for a batch of that id, and there is none.
        got = await bf.client.get("/v1/batches/estimate")
        assert got.status_code == 404, got.text
        assert got.json()["error"]["param"] == "batch_id"


@asynccontextmanager
async def with_engine(tmp_path: Path, database_url: str) -> AsyncIterator[InProcess]:
    """Backfill on a simulator whose answers are 4 tokens long."""
    async with (
        running_simulator() as (url, _),
        in_process_backfill(tmp_path, url, database_url=database_url) as bf,
    ):
        yield bf


async def receipts_total(bf: InProcess, batch: dict[str, Any]) -> int:
    rows = await bf.rows(batch["output_file_id"])
    total = 0
    for row in rows:
        request_id = row["response"]["request_id"]
        receipt = await bf.client.get(f"/v1/receipts/{request_id}")
        assert receipt.status_code == 200, receipt.text
        total += int(receipt.json()["amount"]["value"])
    return total


async def test_the_expected_cost_uses_the_answers_measured_since(
    tmp_path: Path, database_url: str
) -> None:
    async with with_engine(tmp_path, database_url) as bf:
        ran = await bf.run_batch([chat_line(f"r{i}", max_tokens=64) for i in range(6)])
        assert ran["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        assert ran["usage"]["output_tokens"] == 6 * 4

        file_id = await upload(bf, [chat_line(f"n{i}", max_tokens=64) for i in range(10)])
        found = await estimate(bf, file_id)
        bound, max_output = await bounds(bf, file_id)
        assert found["expected"] == {
            "input_tokens": bound,
            "output_tokens": 40,
            "cost": pico_to_usd(token_charge(PRICES, bound, 0, 40)),
            "basis": "measured",
            "sample": {"size": 6, "output_tokens_per_request": 4.0},
        }
        assert found["worst_case"]["output_tokens"] == max_output == 640
        # The batch that ran: charged what its receipts add up to, nothing held any more.
        assert ran["cost"] == {
            "unit": "usd",
            "charged": pico_to_usd(await receipts_total(bf, ran)),
            "reserved": "0",
        }
        assert usd_to_pico(ran["cost"]["charged"]) > 0


async def test_the_batch_object_carries_its_cost_while_it_runs(
    tmp_path: Path, database_url: str
) -> None:
    async with with_engine(tmp_path, database_url) as bf:
        slow = "[[sim:delay_ms=1500]]"
        rows = [chat_line(f"fast{i}") for i in range(3)]
        rows += [chat_line(f"slow{i}", slow) for i in range(3)]
        file_id = await upload(bf, rows)
        reserve = usd_to_pico((await estimate(bf, file_id))["worst_case"]["cost"])
        created = await bf.create(file_id)
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]

        def part_done(batch: dict[str, Any]) -> bool:
            counts = batch["request_counts"]
            return bool(batch["status"] == "in_progress" and 0 < counts["completed"] < 6)

        batch = await eventually(
            lambda: bf.batch(batch_id), part_done, timeout_s=30, what="some answers stored"
        )
        charged, held = (usd_to_pico(batch["cost"][k]) for k in ("charged", "reserved"))
        # Each answer's charge comes out of the reservation: the two add up to it.
        assert charged > 0
        assert held > 0
        assert charged + held == reserve

        ended = await bf.wait(batch_id)
        assert ended["status"] == "completed"
        assert ended["cost"]["reserved"] == "0"
        assert usd_to_pico(ended["cost"]["charged"]) == await receipts_total(bf, ended)
        listed = (await bf.client.get("/v1/batches")).json()["data"]
        assert listed[0]["cost"] == ended["cost"]


async def test_the_openai_sdk_estimates_and_reads_the_cost(tmp_path: Path) -> None:
    async with queue_only(tmp_path, "") as bf:
        file_id = await upload(bf, [chat_line("a"), chat_line("b")])
        http = httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=bf.backfill.app()), base_url="http://backfill.test"
        )
        client = openai.AsyncOpenAI(
            api_key=bf.key, base_url="http://backfill.test/v1", http_client=http
        )
        try:
            # Any route, with the SDK's own retries and errors: the answer as a plain dict.
            estimated = await client.post("/batches/estimate", body=body(file_id), cast_to=dict)
            assert estimated["object"] == "batch.estimate"
            assert estimated["admission"]["admitted"] is True
            batch = await client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            # Beside usage, where the SDK's batch keeps the keys it does not know.
            cost = (batch.model_extra or {})["cost"]
            assert cost == {
                "unit": "usd",
                "charged": "0",
                "reserved": estimated["worst_case"]["cost"],
            }
            again = await client.batches.retrieve(batch.id)
            assert (again.model_extra or {})["cost"] == cost
        finally:
            await client.close()


async def test_the_openapi_document_describes_the_estimate_and_the_cost(tmp_path: Path) -> None:
    async with queue_only(tmp_path, "") as bf:
        spec = (await bf.client.get("/openapi.json")).json()
        operation = spec["paths"]["/v1/batches/estimate"]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/CreateBatchRequest"
        }
        answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert answer == {"$ref": "#/components/schemas/BatchEstimate"}
        schemas = spec["components"]["schemas"]
        assert set(schemas["BatchEstimate"]["required"]) >= {
            "worst_case",
            "expected",
            "admission",
            "estimated_completion_at",
        }
        assert "cost" in schemas["Batch"]["required"]
        assert schemas["BatchCost"]["required"] == ["unit", "charged", "reserved"]


async def test_parallel_estimates_and_a_creation_agree_on_the_reservation(
    tmp_path: Path, database_url: str
) -> None:
    async with queue_only(tmp_path, database_url) as bf:
        file_id = await upload(bf, [chat_line(f"r{i}", max_tokens=100 + i) for i in range(40)])
        answers = await asyncio.gather(*(estimate(bf, file_id) for _ in range(8)))
        assert len({a["worst_case"]["cost"] for a in answers}) == 1
        created = await bf.client.post("/v1/batches", json=body(file_id))
        assert created.status_code == 200, created.text
        assert created.json()["cost"]["reserved"] == answers[0]["worst_case"]["cost"]
