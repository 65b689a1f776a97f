"""What each refusal tells a client about retrying (docs/api.md, "When to retry"): a refusal
that waiting a few seconds cannot fix says ``x-should-retry: false`` at once (with an estimate
in ``Retry-After`` only when there is an honest one), a passing fault says ``true`` with a
short ``Retry-After``; and the real openai SDK, at its defaults, fails fast on the former."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest

from backfill.errors import StorageError
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
ADMIN_TOKEN = "admin-secret-for-retry-tests"


@asynccontextmanager
async def queue_only(tmp_path: Path, **overrides: Any) -> AsyncIterator[InProcess]:
    """Backfill without engines: accepted batches stay unfinished as long as the test runs."""
    async with in_process_backfill(tmp_path, NO_ENGINE_URL, engines=[], **overrides) as bf:
        yield bf


async def upload(bf: InProcess, rows: int = 1, max_tokens: int = 16) -> str:
    lines = [chat_line(f"r{i}", max_tokens=max_tokens) for i in range(rows)]
    response = await bf.upload(jsonl(lines))
    assert response.status_code == 200, response.text
    file_id: str = response.json()["id"]
    return file_id


def fails_fast(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert response.headers["x-should-retry"] == "false"


async def test_too_many_unfinished_batches_fails_fast_without_a_wait(tmp_path: Path) -> None:
    async with queue_only(tmp_path, max_unfinished_batches=1) as bf:
        file_id = await upload(bf)
        assert (await bf.create(file_id)).status_code == 200
        refused = await bf.create(file_id)
        fails_fast(refused, 429, "too_many_unfinished_batches")
        assert "retry-after" not in refused.headers
        assert "wait for one to finish or cancel one" in refused.json()["error"]["message"]


async def test_capacity_fails_fast_with_its_estimate_in_retry_after(tmp_path: Path) -> None:
    slow = slow_sim_model()
    async with queue_only(tmp_path, models=[slow], min_completion_window_s=1) as bf:
        refused = await bf.create(await upload(bf, 1, max_tokens=500), completion_window="100s")
        fails_fast(refused, 429, "capacity_exceeded")
        wait = int(refused.headers["retry-after"])
        assert wait >= 60
        assert f"Retry in about {wait}s" in refused.json()["error"]["message"]


async def test_retained_input_fails_fast_without_a_wait(tmp_path: Path) -> None:
    async with queue_only(tmp_path, max_retained_input_bytes=200) as bf:
        refused = await bf.upload(jsonl([chat_line(f"r{i}") for i in range(5)]))
        fails_fast(refused, 429, "retained_input_limit")
        assert "retry-after" not in refused.headers


async def test_insufficient_credit_fails_fast_without_a_wait(tmp_path: Path) -> None:
    pricey = ModelSettings(
        id=SIM_MODEL,
        model_config_id="sim-model-v1",
        context_length=4096,
        max_output_tokens=1024,
        batch=PricingSettings(input=10**12, cached_input=10**12, output=10**12),
    )
    async with queue_only(tmp_path, models=[pricey]) as bf:
        refused = await bf.create(await upload(bf, 5, max_tokens=1000))
        fails_fast(refused, 402, "insufficient_credit")
        assert "retry-after" not in refused.headers


@pytest.mark.parametrize(("window_s", "retry"), [(60.0, "false"), (5.0, "true")])
async def test_an_auth_brake_is_retried_automatically_only_when_short(
    tmp_path: Path, window_s: float, retry: str
) -> None:
    async with queue_only(
        tmp_path, admin_token=ADMIN_TOKEN, auth_failure_limit=2, auth_failure_window_s=window_s
    ) as bf:
        wrong = {"Authorization": "Bearer not-the-admin-token"}
        for _ in range(2):
            assert (await bf.client.get("/admin/v1/models", headers=wrong)).status_code == 401
        braked = await bf.client.get("/admin/v1/models", headers=wrong)
        assert braked.status_code == 429
        assert braked.json()["error"]["code"] == "too_many_auth_failures"
        assert 1 <= int(braked.headers["retry-after"]) <= window_s
        assert braked.headers["x-should-retry"] == retry


def listing_fails(bf: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GET /v1/batches`` meets a passing storage fault (503) until the test ends."""

    async def down(*_: Any, **__: Any) -> Any:
        raise StorageError("The database did not answer; nothing was changed.")

    monkeypatch.setattr(bf.backfill.services.batches, "list", down)


async def test_a_passing_storage_fault_is_retried_after_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with queue_only(tmp_path) as bf:
        listing_fails(bf, monkeypatch)
        response = await bf.client.get("/v1/batches")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "storage_unavailable"
        assert (response.headers["x-should-retry"], response.headers["retry-after"]) == (
            "true",
            "1",
        )


# ---- the openai SDK, as users run it ----------------------------------------------------------


class Counting(httpx2.AsyncBaseTransport):
    """Passes requests to the app in process and counts the attempts the SDK makes."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self.inner = inner
        self.attempts = 0

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        self.attempts += 1
        return await self.inner.handle_async_request(request)


@asynccontextmanager
async def sdk(bf: InProcess, **options: Any) -> AsyncIterator[tuple[openai.AsyncOpenAI, Counting]]:
    transport = Counting(httpx2.ASGITransport(app=bf.backfill.app()))
    http = httpx2.AsyncClient(transport=transport, base_url="http://backfill.test")
    client = openai.AsyncOpenAI(
        api_key=bf.key, base_url="http://backfill.test/v1", http_client=http, **options
    )
    try:
        yield client, transport
    finally:
        await client.close()


async def test_the_sdk_fails_at_once_on_a_refused_create(tmp_path: Path) -> None:
    """Before, this refusal said Retry-After: 60 and x-should-retry: true, and a default SDK
    client slept through two retries before failing."""
    async with queue_only(tmp_path, max_unfinished_batches=1) as bf:
        file_id = await upload(bf)
        assert (await bf.create(file_id)).status_code == 200
        async with sdk(bf) as (client, transport):
            with pytest.raises(openai.RateLimitError) as refused:
                await client.batches.create(
                    input_file_id=file_id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
        assert transport.attempts == 1, "the default SDK did not retry the refusal"
        assert refused.value.code == "too_many_unfinished_batches"


async def test_the_sdk_retries_a_passing_fault_as_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with queue_only(tmp_path) as bf:
        listing_fails(bf, monkeypatch)
        async with sdk(bf, max_retries=1) as (client, transport):
            with pytest.raises(openai.InternalServerError):
                await client.batches.list()
        assert transport.attempts == 2
