"""BatchRouter assignment fields in batch metadata, through the HTTP API (SPEC §4.1, §8.2):
accepted fields come back unchanged and set ``expires_at``; each bad one is a 400 naming it;
rates must be the published prices; free-form metadata is untouched."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from backfill.adapters.clock import ManualClock
from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.settings import DeploymentSettings
from tests.support import (
    FAST,
    SIM_MODEL,
    InProcess,
    assert_exactly_once,
    chat_line,
    eventually,
    in_flight,
    in_process_backfill,
    jsonl,
    running_simulator,
)

HOUR = 3600
DAY = 24 * HOUR
DEPLOYMENT = "acme-llama"


def iso(unix: float) -> str:
    return datetime.fromtimestamp(int(unix), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def upload(bf: InProcess, content: bytes) -> str:
    response = await bf.upload(content)
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


async def plain_file(bf: InProcess) -> str:
    return await upload(bf, jsonl([chat_line("only", "hello")]))


def sectioned() -> bytes:
    return jsonl(
        [
            {"format": "batchrouter.sectioned.v1"},
            {
                "section": {
                    "id": "s1",
                    "body": {"model": SIM_MODEL, "max_tokens": 8},
                    "messages": [{"role": "system", "content": "x"}],
                }
            },
            {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}},
        ]
    )


async def published_prices(bf: InProcess, model: str = SIM_MODEL) -> dict[str, str]:
    response = await bf.client.get("/v1/models")
    assert response.status_code == 200, response.text
    entry = next(m for m in response.json()["data"] if m["id"] == model)
    pricing: dict[str, str] = entry["batch"]["pricing"]
    return pricing


def all_fields(now: float, prices: dict[str, str]) -> dict[str, str]:
    return {
        "batchrouter_work_unit_id": "wu-2026-06-01/0042",
        "batchrouter_deadline": iso(now + 3 * HOUR),
        "batchrouter_assignment_window": "PT90M",
        "batchrouter_tier": "standard",
        "batchrouter_role": "standard",
        "batchrouter_input_rate": prices["input"],
        "batchrouter_cached_input_rate": prices["cached_input"],
        "batchrouter_output_rate": prices["output"],
    }


async def batches(bf: InProcess) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = (await bf.client.get("/v1/batches")).json()["data"]
    return data


def assert_refused(response: httpx.Response, param: str, *words: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["param"] == param, error
    assert error["code"] in {"invalid_value", "missing_required_parameter"}, error
    assert error["type"] == "invalid_request_error"
    assert param.removeprefix("metadata.") in error["message"], error
    for word in words:
        assert word in error["message"], error
    assert response.headers["x-should-retry"] == "false"
    return error


# ---- accepted ---------------------------------------------------------------------------------


async def test_all_fields_are_returned_unchanged_and_set_expires_at(backfill: InProcess) -> None:
    file_id = await plain_file(backfill)
    metadata = {**all_fields(time.time(), await published_prices(backfill)), "run": "nightly"}
    response = await backfill.create(file_id, metadata=metadata)
    assert response.status_code == 200, response.text
    batch = response.json()
    assert batch["metadata"] == metadata
    assert batch["completion_window"] == "24h"
    # The assignment window (90 minutes) ends before the deadline (3 hours).
    assert batch["expires_at"] == batch["created_at"] + 90 * 60
    fetched = (await backfill.client.get(f"/v1/batches/{batch['id']}")).json()
    assert fetched["metadata"] == metadata
    assert fetched["expires_at"] == batch["expires_at"]


async def test_the_deadline_wins_when_it_is_earlier(backfill: InProcess) -> None:
    file_id = await plain_file(backfill)
    deadline = iso(time.time() + 2 * HOUR)
    metadata = {
        "batchrouter_work_unit_id": "wu-1",
        "batchrouter_deadline": deadline,
        "batchrouter_assignment_window": "6h",
    }
    response = await backfill.create(file_id, metadata=metadata)
    assert response.status_code == 200, response.text
    expected = datetime.strptime(deadline, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert response.json()["expires_at"] == int(expected.timestamp())


async def test_a_day_caps_a_longer_deadline(backfill: InProcess) -> None:
    file_id = await plain_file(backfill)
    metadata = {
        "batchrouter_work_unit_id": "wu-1",
        "batchrouter_deadline": iso(time.time() + 3 * DAY),
        "batchrouter_assignment_window": "P2D",
    }
    response = await backfill.create(file_id, metadata=metadata, completion_window="168h")
    assert response.status_code == 200, response.text
    batch = response.json()
    assert batch["expires_at"] == batch["created_at"] + DAY
    assert batch["completion_window"] == "168h"


async def test_the_completion_window_is_never_lengthened(tmp_path: Path) -> None:
    async with running(tmp_path, min_completion_window_s=60) as bf:
        file_id = await plain_file(bf)
        metadata = {
            "batchrouter_work_unit_id": "wu-1",
            "batchrouter_deadline": iso(time.time() + 2 * HOUR),
        }
        response = await bf.create(file_id, metadata=metadata, completion_window="1h")
    assert response.status_code == 200, response.text
    assert response.json()["expires_at"] == response.json()["created_at"] + HOUR


async def test_free_form_metadata_still_works(backfill: InProcess) -> None:
    file_id = await plain_file(backfill)
    metadata = {"description": "nightly eval job", "batch_router": "not ours", "router": "x"}
    response = await backfill.create(file_id, metadata=metadata)
    assert response.status_code == 200, response.text
    batch = response.json()
    assert batch["metadata"] == metadata
    assert batch["expires_at"] == batch["created_at"] + DAY


async def test_an_idempotent_replay_returns_the_same_batch(tmp_path: Path) -> None:
    clock = ManualClock()
    async with running(tmp_path, clock=clock) as bf:
        file_id = await plain_file(bf)
        metadata = {
            "batchrouter_work_unit_id": "wu-1",
            "batchrouter_deadline": iso(clock.now() + 2 * HOUR),
        }
        body: dict[str, Any] = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "metadata": metadata,
        }
        headers = {"Idempotency-Key": "wu-1"}
        first = await bf.client.post("/v1/batches", json=body, headers=headers)
        # The replay comes after the deadline: it still names the batch already accepted.
        clock.advance(3 * HOUR)
        again = await bf.client.post("/v1/batches", json=body, headers=headers)
        body["metadata"] = {**metadata, "batchrouter_tier": "standard"}
        changed = await bf.client.post("/v1/batches", json=body, headers=headers)
    assert first.status_code == 200, first.text
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["expires_at"] == first.json()["expires_at"]
    assert again.json()["metadata"] == first.json()["metadata"]
    assert changed.status_code == 409, changed.text


# ---- refused ----------------------------------------------------------------------------------

ID = {"batchrouter_work_unit_id": "wu-1"}


@pytest.mark.parametrize(
    ("metadata", "param", "words"),
    [
        ({"batchrouter_tier": "standard"}, "batchrouter_work_unit_id", ["required"]),
        ({"batchrouter_work_unit_id": "has space"}, "batchrouter_work_unit_id", ["printable"]),
        ({"batchrouter_work_unit_id": "x" * 129}, "batchrouter_work_unit_id", ["128"]),
        ({**ID, "batchrouter_deadline": "2026-12-01 18:00"}, "batchrouter_deadline", ["RFC 3339"]),
        ({**ID, "batchrouter_deadline": "2026-12-01T18:00:00"}, "batchrouter_deadline", ["zone"]),
        ({**ID, "batchrouter_deadline": "2020-01-01T00:00:00Z"}, "batchrouter_deadline", ["60s"]),
        ({**ID, "batchrouter_assignment_window": "6 hours"}, "batchrouter_assignment_window", []),
        ({**ID, "batchrouter_assignment_window": "PT0S"}, "batchrouter_assignment_window", []),
        ({**ID, "batchrouter_assignment_window": "P1M"}, "batchrouter_assignment_window", []),
        ({**ID, "batchrouter_tier": "priority"}, "batchrouter_tier", ["standard"]),
        ({**ID, "batchrouter_role": "lead"}, "batchrouter_role", ["standard"]),
        ({**ID, "batchrouter_input_rate": "cheap"}, "batchrouter_input_rate", ["decimal"]),
        ({**ID, "batchrouter_input_format": "jsonl"}, "batchrouter_input_format", ["sectioned"]),
        ({**ID, "batchrouter_priority": "high"}, "batchrouter_priority", ["Unknown"]),
        ({**ID, "BatchRouter_Tier": "standard"}, "BatchRouter_Tier", ["lower case"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_each_bad_field_is_a_400_naming_it(
    backfill: InProcess, metadata: dict[str, str], param: str, words: list[str]
) -> None:
    file_id = await plain_file(backfill)
    response = await backfill.create(file_id, metadata={"description": "kept", **metadata})
    assert_refused(response, f"metadata.{param}", *words)
    assert await batches(backfill) == []


@pytest.mark.parametrize("price", ["input", "cached_input", "output"])
async def test_a_rate_must_equal_the_published_price(backfill: InProcess, price: str) -> None:
    file_id = await plain_file(backfill)
    prices = await published_prices(backfill)
    assert prices["unit"] == "microusd_per_million_tokens"
    field = f"batchrouter_{price}_rate"
    same = await backfill.create(file_id, metadata={**ID, field: prices[price]})
    spelled = await backfill.create(file_id, metadata={**ID, field: f"{prices[price]}.000"})
    other = str(int(prices[price]) + 1)
    different = await backfill.create(file_id, metadata={**ID, field: other})
    assert same.status_code == 200, same.text
    assert same.json()["metadata"][field] == prices[price]
    assert spelled.status_code == 200, spelled.text
    assert spelled.json()["metadata"][field] == f"{prices[price]}.000"
    # Metadata never changes what the batch costs.
    assert same.json()["pricing"][price] == prices[price]
    assert_refused(
        different, f"metadata.{field}", repr(other), prices[price], "never overrides prices"
    )


async def test_sectioned_format_with_a_plain_file_is_refused(backfill: InProcess) -> None:
    file_id = await plain_file(backfill)
    metadata = {**ID, "batchrouter_input_format": "sectioned.v1"}
    response = await backfill.create(file_id, metadata=metadata)
    assert_refused(response, "metadata.batchrouter_input_format", "'jsonl'")
    assert await batches(backfill) == []


async def test_rates_for_a_gpu_time_deployment_are_refused(tmp_path: Path) -> None:
    deployment = DeploymentSettings(
        id=DEPLOYMENT, org="default", model_config_id="acme-llama-v1", microusd_per_gpu_second=10
    )
    async with running(tmp_path, deployments=[deployment]) as bf:
        # The deployment names org "default", which exists only once the test has started.
        await bf.backfill.seed_catalog()
        file_id = await upload(bf, jsonl([chat_line("only", model=DEPLOYMENT)]))
        plain = await bf.create(file_id, metadata=ID)
        rated = await bf.create(file_id, metadata={**ID, "batchrouter_output_rate": "0"})
    assert plain.status_code == 200, plain.text
    assert plain.json()["billing"] == "gpu_time"
    assert_refused(rated, "metadata.batchrouter_output_rate", "GPU time")


# ---- sectioned input --------------------------------------------------------------------------


async def test_sectioned_file_with_all_fields_is_accepted(backfill: InProcess) -> None:
    file_id = await upload(backfill, sectioned())
    prices = await published_prices(backfill)
    metadata = {**all_fields(time.time(), prices), "batchrouter_input_format": "sectioned.v1"}
    response = await backfill.create(file_id, metadata=metadata)
    assert response.status_code == 200, response.text
    batch = response.json()
    assert batch["metadata"] == metadata
    assert batch["expires_at"] == batch["created_at"] + 90 * 60
    # A sectioned file needs no format field either.
    bare = await backfill.create(file_id, metadata=ID)
    assert bare.status_code == 200, bare.text


# ---- expiry by the BatchRouter deadline -------------------------------------------------------


@asynccontextmanager
async def running(tmp_path: Path, **overrides: Any) -> AsyncIterator[InProcess]:
    """Backfill on the simulator, which also answers for the private deployment."""
    async with running_simulator(FAST) as (url, _):
        models = {SIM_MODEL: SIM_MODEL, DEPLOYMENT: DEPLOYMENT}
        engine = OpenAIHttpEngine("sim", url, models, max_concurrency=1)
        async with in_process_backfill(tmp_path, url, engines=[engine], **overrides) as bf:
            yield bf


async def test_a_batch_past_its_batchrouter_deadline_expires(tmp_path: Path) -> None:
    clock = ManualClock()
    async with running_simulator(FAST) as (url, sim):
        engine = OpenAIHttpEngine("sim", url, {SIM_MODEL: SIM_MODEL}, max_concurrency=1)
        async with in_process_backfill(tmp_path, url, clock=clock, engines=[engine]) as bf:
            rows = [chat_line(f"s-{i}", f"[[sim:delay_ms=60000]] slow {i}") for i in range(3)]
            file_id = await upload(bf, jsonl(rows))
            deadline = int(clock.now()) + 120
            metadata = {**ID, "batchrouter_deadline": iso(deadline)}
            created = await bf.create(file_id, metadata=metadata)
            assert created.status_code == 200, created.text
            batch_id = created.json()["id"]
            assert created.json()["expires_at"] == deadline
            assert created.json()["completion_window"] == "24h"
            await eventually(in_flight(sim), lambda n: n >= 1, what="a request to start")
            clock.advance(121)
            batch = await bf.wait(batch_id, timeout_s=30)
            out = await bf.rows(batch["output_file_id"])
            err = await bf.rows(batch["error_file_id"])
    assert batch["status"] == "expired"
    assert batch["expired_at"] >= deadline
    assert batch["metadata"] == metadata
    assert_exactly_once(rows, out, err)
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
