"""Admission of batches: per-org limits, capacity, credit and idempotency (SPEC §4.1, §7.3, §7.6).

Every test runs Backfill in process without engines, so accepted batches stay unfinished
(``in_progress``) for as long as the test needs them to.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from backfill.domain.money import Prices, worst_case
from backfill.settings import ModelSettings, PricingSettings
from tests.support import (
    SIM_MODEL,
    InProcess,
    chat_line,
    in_process_backfill,
    jsonl,
    slow_sim_model,
)

NO_ENGINE_URL = "http://127.0.0.1:9/v1"
# One picodollar per token per price unit: 1e12 uUSD per million tokens is 1 USD per token, so
# a one-line batch reserves a few hundred USD against the 1000 USD of starting credit.
USD_PER_TOKEN = 10**12
EXPENSIVE = ModelSettings(
    id=SIM_MODEL,
    model_config_id="sim-model-v1",
    context_length=4096,
    max_output_tokens=1024,
    batch=PricingSettings(input=USD_PER_TOKEN, cached_input=USD_PER_TOKEN, output=USD_PER_TOKEN),
)
EXPENSIVE_PRICES = Prices(USD_PER_TOKEN, USD_PER_TOKEN, USD_PER_TOKEN)


@asynccontextmanager
async def no_engine_backfill(tmp_path: Path, **overrides: Any) -> AsyncIterator[InProcess]:
    """Backfill with no engine at all: the queue accepts work and nothing drains it."""
    async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], **overrides) as running:
        yield running


async def upload(backfill: InProcess, rows: list[dict[str, Any]]) -> dict[str, Any]:
    response = await backfill.upload(jsonl(rows))
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def create(
    backfill: InProcess,
    file_id: str,
    *,
    key: str | None = None,
    **extra: Any,
) -> httpx.Response:
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **extra,
    }
    headers = {"Idempotency-Key": key} if key is not None else None
    return await backfill.client.post("/v1/batches", json=body, headers=headers)


async def listed_ids(backfill: InProcess) -> list[str]:
    response = await backfill.client.get("/v1/batches", params={"limit": 100})
    assert response.status_code == 200, response.text
    return [b["id"] for b in response.json()["data"]]


async def default_org_id(backfill: InProcess) -> str:
    org = await backfill.backfill.store.org_by_name("default")
    assert org is not None
    return org.id


async def reservation_of(backfill: InProcess, file_id: str, prices: Prices) -> int:
    """The worst case SPEC §7.3 reserves for a batch of this file, from the stored file record."""
    org_id = await default_org_id(backfill)
    record = await backfill.backfill.store.get_file(org_id, file_id)
    assert record is not None
    return worst_case(prices, record.prompt_token_bound, record.max_output_tokens)


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def retry_after(response: httpx.Response) -> int:
    value = response.headers.get("retry-after")
    assert value is not None, f"no Retry-After on {response.status_code}: {response.text}"
    return int(value)


# ---- per-org limits (SPEC §7.6) ------------------------------------------------------------


async def test_fifth_unfinished_batch_is_refused_until_one_finishes(tmp_path: Path) -> None:
    async with no_engine_backfill(tmp_path) as bf:
        file = await upload(bf, [chat_line("a")])
        created = []
        for _ in range(4):
            response = await create(bf, file["id"])
            assert response.status_code == 200, response.text
            created.append(response.json()["id"])

        refused = await create(bf, file["id"])
        assert refused.status_code == 429, refused.text
        assert error_of(refused)["code"] == "too_many_unfinished_batches"
        # Room comes back when a batch ends, maybe hours later: no wait for SDKs to sleep.
        assert refused.headers["x-should-retry"] == "false"
        assert "retry-after" not in refused.headers
        assert sorted(await listed_ids(bf)) == sorted(created)

        cancelled = await bf.client.post(f"/v1/batches/{created[0]}/cancel", json={})
        assert cancelled.status_code == 200, cancelled.text
        assert (await bf.wait(created[0], timeout_s=30))["status"] == "cancelled"

        accepted = await create(bf, file["id"])
        assert accepted.status_code == 200, accepted.text


async def test_retained_input_over_the_limit_is_refused_without_retry(tmp_path: Path) -> None:
    limit = 2000
    async with no_engine_backfill(tmp_path, max_retained_input_bytes=limit) as bf:
        padding = "x " * 200
        first = await upload(bf, [chat_line(f"a{i}", padding) for i in range(3)])
        accepted = await create(bf, first["id"])
        assert accepted.status_code == 200, accepted.text

        # Input files count from upload: the one that would cross the limit is refused there.
        second_rows = [chat_line(f"b{i}", padding) for i in range(3)]
        assert first["bytes"] <= limit < first["bytes"] + len(jsonl(second_rows))
        refused = await bf.upload(jsonl(second_rows))
        assert refused.status_code == 429, refused.text
        assert error_of(refused)["code"] == "retained_input_limit"
        assert refused.headers["x-should-retry"] == "false"
        assert [f["id"] for f in (await bf.client.get("/v1/files")).json()["data"]] == [first["id"]]

        # Freeing retained input (cancel the batch, delete its input) lets the next one in.
        batch_id = accepted.json()["id"]
        assert (await bf.client.post(f"/v1/batches/{batch_id}/cancel", json={})).status_code == 200
        await bf.wait(batch_id, timeout_s=30)
        deleted = await bf.client.delete(f"/v1/files/{first['id']}")
        assert deleted.status_code in (200, 404), deleted.text
        second = await upload(bf, second_rows)
        again = await create(bf, second["id"])
        assert again.status_code == 200, again.text


async def test_batch_beyond_model_throughput_is_refused_with_retry_after(tmp_path: Path) -> None:
    slow_model = slow_sim_model()
    async with no_engine_backfill(tmp_path, models=[slow_model], min_completion_window_s=1) as bf:
        # 8 output tokens fit a 10 s window at 1 token/s; 16 (8 queued + 8 more) do not.
        file = await upload(bf, [chat_line("a", max_tokens=8)])
        first = await create(bf, file["id"], completion_window="10s")
        assert first.status_code == 200, first.text

        refused = await create(bf, file["id"], completion_window="10s")
        assert refused.status_code == 429, refused.text
        assert error_of(refused)["code"] == "capacity_exceeded"
        assert retry_after(refused) > 0
        assert await listed_ids(bf) == [first.json()["id"]]

        too_big = await upload(bf, [chat_line("b", max_tokens=16)])
        alone = await create(bf, too_big["id"], completion_window="10s")
        assert alone.status_code == 429, alone.text
        assert error_of(alone)["code"] == "capacity_exceeded"

        # A window long enough for the queue plus this batch is accepted.
        longer = await create(bf, file["id"], completion_window="60s")
        assert longer.status_code == 200, longer.text


# ---- credit (SPEC §7.3) --------------------------------------------------------------------


async def test_short_credit_is_402_with_nothing_queued_and_the_file_is_reusable(
    tmp_path: Path,
) -> None:
    async with no_engine_backfill(tmp_path, models=[EXPENSIVE]) as bf:
        org_id = await default_org_id(bf)
        store = bf.backfill.store
        file = await upload(bf, [chat_line(f"r{i}", "one two three") for i in range(8)])
        reserve = await reservation_of(bf, file["id"], EXPENSIVE_PRICES)
        before = await store.ledger(org_id)
        assert reserve > before.available, "the file must cost more than the starting credit"

        refused = await create(bf, file["id"])
        assert refused.status_code == 402, refused.text
        assert error_of(refused)["code"] == "insufficient_credit"
        assert refused.headers["x-should-retry"] == "false"
        assert await listed_ids(bf) == []
        assert await store.ledger(org_id) == before

        await bf.backfill.services.billing.add_credit("default", "1000")
        accepted = await create(bf, file["id"])
        assert accepted.status_code == 200, accepted.text
        assert accepted.json()["input_file_id"] == file["id"]
        assert await listed_ids(bf) == [accepted.json()["id"]]
        after = await store.ledger(org_id)
        assert after.reserved == reserve
        assert after.available == before.available + 1000 * 10**12 - reserve >= 0


async def test_concurrent_creates_never_overspend(tmp_path: Path) -> None:
    async with no_engine_backfill(tmp_path, models=[EXPENSIVE], max_unfinished_batches=100) as bf:
        org_id = await default_org_id(bf)
        store = bf.backfill.store
        file = await upload(bf, [chat_line("only", "one two three")])
        reserve = await reservation_of(bf, file["id"], EXPENSIVE_PRICES)
        before = await store.ledger(org_id)
        expected = before.available // reserve
        assert 1 <= expected < 20

        responses = await asyncio.gather(*(create(bf, file["id"]) for _ in range(20)))

        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200] * expected + [402] * (20 - expected), [
            r.text for r in responses if r.status_code not in (200, 402)
        ]
        assert all(
            error_of(r)["code"] == "insufficient_credit" for r in responses if r.status_code == 402
        )
        ids = {r.json()["id"] for r in responses if r.status_code == 200}
        assert len(ids) == expected
        assert set(await listed_ids(bf)) == ids
        after = await store.ledger(org_id)
        assert after.reserved == expected * reserve
        assert after.available == before.available - expected * reserve
        assert after.available >= 0
        assert after.balance == after.credits - after.charges


# ---- idempotency (SPEC §4.1) ---------------------------------------------------------------


async def test_idempotency_key_replay_and_reuse(tmp_path: Path) -> None:
    async with no_engine_backfill(tmp_path) as bf:
        file = await upload(bf, [chat_line("a")])
        first = await create(bf, file["id"], key="key-1", metadata={"run": "1"})
        assert first.status_code == 200, first.text

        replay = await create(bf, file["id"], key="key-1", metadata={"run": "1"})
        assert replay.status_code == 200, replay.text
        assert replay.json()["id"] == first.json()["id"]

        reused = await create(bf, file["id"], key="key-1", metadata={"run": "2"})
        assert reused.status_code == 409, reused.text
        assert reused.headers["x-should-retry"] == "false"

        assert await listed_ids(bf) == [first.json()["id"]]

        # Another key is another submission.
        other = await create(bf, file["id"], key="key-2", metadata={"run": "1"})
        assert other.status_code == 200, other.text
        assert other.json()["id"] != first.json()["id"]


async def test_concurrent_identical_creates_with_one_key_make_one_batch(tmp_path: Path) -> None:
    async with no_engine_backfill(tmp_path) as bf:
        org_id = await default_org_id(bf)
        file = await upload(bf, [chat_line("a"), chat_line("b")])
        responses = await asyncio.gather(*(create(bf, file["id"], key="same") for _ in range(10)))
        assert [r.status_code for r in responses] == [200] * 10, [r.text for r in responses]
        ids = {r.json()["id"] for r in responses}
        assert len(ids) == 1
        assert await listed_ids(bf) == list(ids)
        # One reservation, not ten.
        batch = await bf.backfill.store.get_batch(org_id, ids.pop())
        assert batch is not None
        assert (await bf.backfill.store.ledger(org_id)).reserved == batch.reserved > 0


async def test_concurrent_replays_are_not_refused_for_credit_the_original_holds(
    tmp_path: Path,
) -> None:
    """Credit for one batch only: the first creation reserves it, and the nine concurrent
    retries with the same key must get that batch back (200), not a 402 for a second reserve."""
    async with no_engine_backfill(tmp_path, models=[EXPENSIVE]) as bf:
        org_id = await default_org_id(bf)
        file = await upload(bf, [chat_line(f"r{i}", "one two three") for i in range(4)])
        reserve = await reservation_of(bf, file["id"], EXPENSIVE_PRICES)
        assert (await bf.backfill.store.ledger(org_id)).available // reserve == 1

        responses = await asyncio.gather(*(create(bf, file["id"], key="retry") for _ in range(10)))

        assert [r.status_code for r in responses] == [200] * 10, sorted(
            {f"{r.status_code}: {r.text[:120]}" for r in responses}
        )
        assert len({r.json()["id"] for r in responses}) == 1
        assert (await bf.backfill.store.ledger(org_id)).reserved == reserve


async def test_idempotency_key_can_be_required(tmp_path: Path) -> None:
    async with no_engine_backfill(tmp_path, idempotency_required=True) as bf:
        file = await upload(bf, [chat_line("a")])
        missing = await create(bf, file["id"])
        assert missing.status_code == 400, missing.text
        assert missing.headers["x-should-retry"] == "false"
        assert error_of(missing)["param"] == "Idempotency-Key"
        assert await listed_ids(bf) == []

        accepted = await create(bf, file["id"], key="k")
        assert accepted.status_code == 200, accepted.text
        replay = await create(bf, file["id"], key="k")
        assert replay.json()["id"] == accepted.json()["id"]
