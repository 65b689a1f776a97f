"""The priority probe against the simulator: an engine whose scheduling policy is ``fcfs``
takes ``priority`` and ignores it, one with ``priority`` applies it, and the probe tells them
apart, leaving the engine idle; it does not guess on an engine that is busy or has fewer slots
than the settings say. Backfill probes each shared engine with a ``priority``: the admin
engine list (and an API process reading the database) shows what it found, and an engine that
ignores priority is a warning saying what to do."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import aiohttp
import httpx
import pytest

from backfill.adapters.engines.priority_probe import VllmPriorityProbe
from backfill.container import build
from backfill.domain.engine_health import PriorityOutcome
from backfill.settings import EngineSettings
from backfill.simulator.server import Simulator, SimulatorConfig
from tests.support import SIM_MODEL, eventually, running_simulator, sim_settings

SLOTS = 4
# Each token takes 5 ms: the first filler holds its slot 32 tokens, long enough to queue X
# and Y behind it; a request asked for more tokens than the answer needs is cut at max_tokens.
ENGINE = SimulatorConfig(ttft_ms=1, itl_ms=5, output_tokens=4096, slots=SLOTS)
ADMIN = "admin-secret-for-the-priority-probe"


async def _idle(sim: Simulator) -> bool:
    model = sim.model
    assert model is not None
    return model.running + model.waiting == 0


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", PriorityOutcome.IGNORED), ("priority", PriorityOutcome.APPLIED)],
)
async def test_the_probe_tells_whether_the_engine_applies_priority(
    policy: Literal["fcfs", "priority"], expected: PriorityOutcome
) -> None:
    async with running_simulator(replace(ENGINE, scheduling_policy=policy)) as (url, sim):
        probe = VllmPriorityProbe(url, SIM_MODEL, SLOTS, 10)
        assert await probe.check() == expected, probe.unknown_reason
        assert probe.unknown_reason is None
        assert list(probe.timings) == ["slots held", "both queued", "first answer"]
        # The fillers were ended, not left to run their length.
        await eventually(lambda: _idle(sim), timeout_s=2)
        assert sim.stats.requests == SLOTS + 2


async def test_a_busy_engine_is_not_measured() -> None:
    async with (
        running_simulator(replace(ENGINE, scheduling_policy="priority")) as (url, sim),
        aiohttp.ClientSession() as session,
    ):
        body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}]}
        # Someone's long request, running while the probe looks.
        ask = _post(session, f"{url}/chat/completions", {**body, "max_tokens": 2000})
        task = asyncio.create_task(ask)
        try:
            await eventually(lambda: _idle(sim), lambda idle: not idle)
            probe = VllmPriorityProbe(url, SIM_MODEL, SLOTS, 10)
            assert await probe.check() is None
            assert probe.unknown_reason == "the engine is busy"
            assert sim.stats.requests == 1  # nothing of its own was sent
        finally:
            task.cancel()


async def test_an_engine_with_fewer_slots_than_the_settings_say_is_not_measured() -> None:
    async with running_simulator(replace(ENGINE, scheduling_policy="fcfs")) as (url, sim):
        probe = VllmPriorityProbe(url, SIM_MODEL, SLOTS + 2, 10, settle_timeout_s=2)
        assert await probe.check() is None
        assert probe.unknown_reason == f"the fillers did not hold all {SLOTS + 2} slots"
        await eventually(lambda: _idle(sim), timeout_s=2)


@pytest.mark.parametrize(("policy", "expected"), [("fcfs", "ignored"), ("priority", "applied")])
async def test_the_engine_list_shows_what_the_probe_found(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    policy: Literal["fcfs", "priority"],
    expected: str,
) -> None:
    caplog.set_level(logging.INFO, "backfill.runner")
    async with running_simulator(replace(ENGINE, scheduling_policy=policy)) as (url, _):
        engine = EngineSettings(
            name="vllm-shared",
            base_url=url,
            models=[SIM_MODEL],
            max_concurrency=8,
            mode="shared",
            slots=SLOTS,
            priority=10,
        )
        settings = sim_settings(tmp_path / "data", url, engines=[engine], admin_token=ADMIN)
        bf = build(settings)
        await bf.start()
        transport = httpx.ASGITransport(app=bf.app())
        headers = {"Authorization": f"Bearer {ADMIN}"}
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://bf.test") as c:

                async def listed() -> list[dict[str, Any]]:
                    answer = await c.get("/admin/v1/engines", headers=headers)
                    assert answer.status_code == 200, answer.text
                    data: list[dict[str, Any]] = answer.json()["data"]
                    return data

                [shown] = await eventually(listed, lambda e: e[0]["priority"] is not None)
                assert shown["priority"] == expected
            # What the worker stored: an API process without a worker shows the same.
            api = build(settings, role="api")
            await api.init()
            try:
                stored = await eventually(
                    api.services.operations.engines, lambda r: r and r[0].priority is not None
                )
                assert stored[0].priority == expected
            finally:
                await api.stop()
        finally:
            await bf.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    about = [w for w in warnings if "priority" in w]
    if expected == "ignored":
        assert about == [
            "engine vllm-shared ignores the request priority Backfill sends: it served queued "
            "requests in arrival order, so batch requests do not yield to people's; start vLLM "
            "with --scheduling-policy priority, or remove priority from the engine's settings"
        ]
    else:
        assert about == []
        assert any(
            "engine vllm-shared applies request priority" in r.getMessage() for r in caplog.records
        )


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with session.post(url, json=body) as response:
        await response.read()
        return response.status
