"""Why a batch waits, through the API, for each reason a worker observes on a real engine (the
simulator over HTTP): its engine answers 429 (``rate_limited``), a shared engine is full of
people (``interactive_load``), another org's lines fill the engine (``fair_share``), a GPU-time
deployment's org has no credit (``credit``). Each reason comes with its message, a ``since``
that holds while the reason does, and goes once the batch moves; the batch then completes by
itself. (``no_healthy_engine`` and ``engine_starting``: test_engine_health.py,
tests/e2e/test_engine_on_demand.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from backfill.adapters.clock import ManualClock, SystemClock
from backfill.container import build
from backfill.domain.money import pico_to_usd, usd_to_pico
from backfill.services.tenants import SCOPES
from backfill.settings import EngineSettings
from backfill.simulator.server import SimulatorConfig
from tests.integration.test_gpu_time import START, created, fleet, private_line
from tests.support import (
    FAST,
    SIM_MODEL,
    STARTING_CREDIT_USD,
    InProcess,
    backfill_on,
    chat_line,
    eventually,
    in_process_backfill,
    jsonl,
    running_simulator,
    sim_settings,
)


async def waiting(bf: InProcess, batch_id: str, key: str | None = None) -> dict[str, Any] | None:
    found: dict[str, Any] | None = (await bf.batch(batch_id, key))["waiting_on"]
    return found


async def waits_on(
    bf: InProcess, batch_id: str, code: str, key: str | None = None, timeout_s: float = 15
) -> dict[str, Any]:
    """The batch's ``waiting_on`` once it says ``code``; then the same twice more, ``since``
    unchanged (the reason holds)."""
    shown = await eventually(
        lambda: waiting(bf, batch_id, key),
        lambda w: w is not None and w["code"] == code,
        timeout_s,
        what=f"{batch_id} waits on {code}",
        interval_s=0.02,
    )
    assert shown is not None
    for _ in range(2):
        await asyncio.sleep(0.1)
        again = await waiting(bf, batch_id, key)
        assert again is not None
        assert again["code"] == code
        assert again["since"] == shown["since"], "since holds while the reason does"
    # And the listing shows the same.
    listed = (
        await bf.client.get(
            "/v1/batches", headers={"Authorization": f"Bearer {key}"} if key else None
        )
    ).json()["data"]
    [mine] = [b for b in listed if b["id"] == batch_id]
    assert mine["waiting_on"]["code"] == code
    return shown


async def test_an_engine_answering_429_makes_its_batch_wait_rate_limited(tmp_path: Path) -> None:
    async with (
        running_simulator() as (url, sim),
        in_process_backfill(tmp_path, url, max_attempts=100_000) as bf,
    ):
        sim.config.rate_limit_rate = 1.0  # every request: 429 with Retry-After 0.05
        batch = await bf.submit([chat_line(f"r{i}") for i in range(3)])
        shown = await waits_on(bf, batch["id"], "rate_limited")
        assert shown["since"] >= batch["created_at"]
        assert shown["resumes_at"] is not None
        assert shown["resumes_at"] >= shown["since"]
        message = shown["message"]
        assert f"Engine 'sim' serving model '{SIM_MODEL}'" in message
        assert "answered Backfill with 429 Too Many Requests" in message
        assert "retried after its Retry-After" in message
        assert sim.stats.by_status[429] > 0

        sim.config.rate_limit_rate = 0.0
        finished = await bf.wait(batch["id"], timeout_s=30)
        assert finished["status"] == "completed"
        assert finished["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert finished["waiting_on"] is None


@asynccontextmanager
async def shared_backfill(
    tmp_path: Path, url: str, engine: EngineSettings
) -> AsyncIterator[InProcess]:
    """Backfill in process with ``engine`` as the container builds it from its settings (a
    shared engine gets its governor and its metrics probe)."""
    settings = sim_settings(tmp_path / "data", url, engines=[engine])
    backfill = build(settings)
    await backfill.start()
    key = await backfill.services.tenants.bootstrap(credit=usd_to_pico(STARTING_CREDIT_USD))
    assert key is not None
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=backfill.app()),
        base_url="http://backfill.test",
        headers={"Authorization": f"Bearer {key}"},
    )
    try:
        yield InProcess(backfill, client, key, SystemClock(), settings)
    finally:
        await client.aclose()
        await backfill.stop()


# One shared engine of 4 slots: each token takes 5 ms, so a person's 2,000 tokens hold a slot
# 10 s, until the test ends them.
PEOPLE_ENGINE = SimulatorConfig(ttft_ms=1, itl_ms=5, output_tokens=4096, slots=4)


async def test_a_shared_engine_full_of_people_makes_batches_wait_on_interactive_load(
    tmp_path: Path,
) -> None:
    async with running_simulator(replace(PEOPLE_ENGINE)) as (url, sim):
        engine = EngineSettings(
            name="shared",
            base_url=url,
            models=[SIM_MODEL],
            max_concurrency=4,
            mode="shared",
            slots=4,
        )
        async with (
            shared_backfill(tmp_path, url, engine) as bf,
            aiohttp.ClientSession() as people,
        ):
            body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}]}
            asks = [
                asyncio.create_task(
                    people.post(f"{url}/chat/completions", json={**body, "max_tokens": 2000})
                )
                for _ in range(6)
            ]
            try:
                model = sim.model
                assert model is not None

                async def busy() -> float:
                    return model.running + model.waiting

                await eventually(busy, lambda n: n >= 6, what="people fill the engine")
                batch = await bf.submit([chat_line(f"b{i}") for i in range(3)])
                shown = await waits_on(bf, batch["id"], "interactive_load")
                message = shown["message"]
                assert f"Engine 'shared' serving model '{SIM_MODEL}' is shared" in message
                assert "batch work takes only what people leave" in message
                assert (await bf.batch(batch["id"]))["request_counts"]["completed"] == 0
            finally:
                for ask in asks:
                    ask.cancel()
                await asyncio.gather(*asks, return_exceptions=True)
            # People left: the batch goes on by itself.
            finished = await bf.wait(batch["id"], timeout_s=60)
            assert finished["status"] == "completed"
            assert finished["waiting_on"] is None


async def test_a_batch_behind_another_orgs_lines_waits_on_fair_share(tmp_path: Path) -> None:
    # Two requests at a time; the first org's take 3 s each and fill both slots and the
    # backlog, so the second org's batch has nothing out until two of them end.
    async with backfill_on(tmp_path, replace(FAST), max_concurrency=2, plan_interval_s=0.2) as (
        bf,
        _,
    ):
        services = bf.backfill.services
        await services.tenants.create_org("other")
        other = await services.tenants.create_key("other", SCOPES)
        await services.billing.add_credit("other", STARTING_CREDIT_USD)
        first = await bf.submit(
            [chat_line(f"a{i}", "slow [[sim:delay_ms=3000]]") for i in range(6)]
        )
        await eventually(
            lambda: bf.batch(first["id"]),
            lambda b: b["request_counts"]["completed"] == 0 and b["waiting_on"] is None,
            what="the first org's lines are out",
        )
        uploaded = await bf.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={
                "file": (
                    "in.jsonl",
                    jsonl([chat_line(f"b{i}") for i in range(2)]),
                    "application/jsonl",
                )
            },
            headers={"Authorization": f"Bearer {other}"},
        )
        assert uploaded.status_code == 200, uploaded.text
        answer = await bf.client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
            headers={"Authorization": f"Bearer {other}"},
        )
        assert answer.status_code == 200, answer.text
        second = answer.json()
        shown = await waits_on(bf, second["id"], "fair_share", key=other)
        message = shown["message"]
        assert f"The engines of model '{SIM_MODEL}' are busy with requests of 1 other" in message
        assert "this one's is 1 of 2 (50%)" in message
        # The first org's batch moves: it waits on nothing.
        assert (await bf.batch(first["id"]))["waiting_on"] is None

        finished = await bf.wait(second["id"], timeout_s=60, key=other)
        assert finished["status"] == "completed"
        assert finished["waiting_on"] is None


async def test_gpu_time_work_without_credit_waits_on_credit_until_credit_is_added(
    tmp_path: Path,
) -> None:
    clock = ManualClock(START)
    # 0.01 USD buys 5 s of the 2-GPU deployment (0.002 USD per second): the first request's
    # 6 s spend it.
    async with fleet(
        tmp_path, clock=clock, credit_usd="0.01", private_concurrency=1, plan_interval_s=0.2
    ) as f:
        rows = [private_line(f"z{i}", f"pay me {i} [[sim:delay_ms=1000]]") for i in range(3)]
        batch = await created(f.bf, rows)
        model = f.private
        await eventually(
            lambda: _in_flight(model), lambda n: n == 1, what="the first request is in flight"
        )
        clock.advance(6)
        await f.flush_gpu_time()
        balance = (await f.ledger()).balance
        assert balance < 0

        shown = await waits_on(f.bf, batch["id"], "credit")
        assert shown["since"] == int(START) + 6
        assert shown["resumes_at"] is None
        message = shown["message"]
        assert f"its balance is ${pico_to_usd(balance)}" in message
        assert f"any amount over ${pico_to_usd(-balance)} brings it above zero" in message
        assert "resumes within seconds" in message

        await f.bf.backfill.services.billing.add_credit("default", "1")
        done = await f.bf.wait(batch["id"], timeout_s=30)
        assert done["status"] == "completed"
        assert done["waiting_on"] is None


async def _in_flight(sim: Any) -> int:
    return int(sim.stats.in_flight)
