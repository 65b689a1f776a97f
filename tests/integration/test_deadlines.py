"""Deadlines (SPEC §9.4, §4.8): a batch whose slack runs low is served first, creation is
refused when the measured throughput cannot finish a batch inside its window, and every batch
object carries ``estimated_completion_at``.

Time here is work: the clock moves only as the engine takes requests (``WorkClock``), so the
engine serves exactly ``PER_S`` requests per clock second however fast or loaded this machine
is, and "in time" means the same on every run.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.services.tenants import SCOPES
from backfill.simulator.server import Simulator, SimulatorConfig
from tests.support import (
    SIM_MODEL,
    STARTING_CREDIT_USD,
    TERMINAL,
    InProcess,
    chat_line,
    eventually,
    in_process_backfill,
    jsonl,
    running_simulator,
)

PER_S = 50  # requests the engine takes per clock second
START = 1_800_000_000.0


class WorkClock:
    """A clock that advances by one second for every ``per_s`` requests the engine takes."""

    def __init__(self, sim: Simulator, per_s: float) -> None:
        self._sim = sim
        self._per_s = per_s

    def now(self) -> float:
        return START + self._sim.stats.requests / self._per_s

    def monotonic(self) -> float:
        # Only the wall clock follows the work; backoffs and pauses take real time.
        return time.monotonic()


@dataclass
class Deadlines:
    bf: InProcess
    clock: WorkClock
    other: dict[str, str]

    async def create(
        self, lines: int, window: str, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        rows = [chat_line(f"r{i}", f"question {i}") for i in range(lines)]
        uploaded = await self.bf.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", jsonl(rows), "application/jsonl")},
            headers=headers or {},
        )
        assert uploaded.status_code == 200, uploaded.text
        return await self.bf.client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": window,
            },
            headers=headers or {},
        )

    async def batch(self, batch_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
        response = await self.bf.client.get(f"/v1/batches/{batch_id}", headers=headers or {})
        assert response.status_code == 200, response.text
        batch: dict[str, Any] = response.json()
        return batch

    async def rate(self) -> float | None:
        rates = (await self.bf.backfill.store.plan_inputs()).rates
        return next((r.rps for r in rates if r.model == SIM_MODEL), None)


@asynccontextmanager
async def on_work_clock(tmp_path: Path, **overrides: Any) -> AsyncIterator[Deadlines]:
    # An engine slow enough that the planner (every 50 ms) looks a few times per clock second.
    async with running_simulator(SimulatorConfig(ttft_ms=10, itl_ms=0, output_tokens=4)) as (
        url,
        sim,
    ):
        clock = WorkClock(sim, PER_S)
        engine = OpenAIHttpEngine("sim", url, {SIM_MODEL: SIM_MODEL}, max_concurrency=8)
        async with in_process_backfill(
            tmp_path,
            url,
            engines=[engine],
            clock=clock,
            min_completion_window_s=1,
            plan_interval_s=0.05,
            # Leases and their heartbeat run on the clock too: keep them out of the way.
            lease_s=3600.0,
            **overrides,
        ) as bf:
            services = bf.backfill.services
            await services.tenants.create_org("other")
            key = await services.tenants.create_key("other", SCOPES)
            await services.billing.add_credit("other", STARTING_CREDIT_USD)
            yield Deadlines(bf, clock, {"Authorization": f"Bearer {key}"})


async def test_the_batch_with_the_earlier_deadline_finishes_first_and_in_time(
    tmp_path: Path,
) -> None:
    """Capacity for one of the two: A alone needs 40 s of its 42, B alone 6 s of its 10, both
    together 46 s. At equal shares B would need 12 s and expire; served first it makes it."""
    async with on_work_clock(tmp_path, deadline_admission=False, deadline_margin_fraction=0.2) as d:
        first = await d.create(40 * PER_S, "42s")
        assert first.status_code == 200, first.text
        a = first.json()["id"]

        async def measured() -> bool:
            return bool(await d.rate())

        await eventually(measured, timeout_s=120, what="a measured rate")
        rate = await d.rate()
        assert rate is not None
        assert 0.7 * PER_S < rate < 1.3 * PER_S, rate

        second = await d.create(6 * PER_S, "10s", d.other)
        assert second.status_code == 200, second.text
        b = second.json()["id"]
        estimates: list[int] = []

        async def b_ended() -> bool:
            batch = await d.batch(b, d.other)
            if batch["estimated_completion_at"] is not None:
                estimates.append(batch["estimated_completion_at"])
            return batch["status"] in TERMINAL

        await eventually(b_ended, timeout_s=120, what="the urgent batch to end")
        done_b = await d.batch(b, d.other)
        now_a = await d.batch(a)
        slack = done_b["expires_at"] - done_b["completed_at"]
        print(f"\nurgent batch: completed {slack}s before its deadline; the other ran on")
        assert done_b["status"] == "completed", done_b
        assert done_b["request_counts"]["completed"] == 6 * PER_S
        assert done_b["completed_at"] <= done_b["expires_at"]
        assert now_a["status"] not in TERMINAL or now_a["status"] == "expired"
        assert done_b["estimated_completion_at"] is None  # over: no estimate
        # While it ran, B's estimate was a time before its deadline (once it was urgent).
        assert estimates, "the running batch never showed an estimate"
        assert estimates[-1] <= done_b["expires_at"]

        async def a_ended() -> bool:
            return (await d.batch(a))["status"] in TERMINAL

        await eventually(a_ended, timeout_s=120, what="the other batch to end")
        final_a = await d.batch(a)
        # A could not also finish: it expires with what it had done.
        assert final_a["status"] == "expired", final_a
        assert final_a["expired_at"] > done_b["completed_at"]


async def test_a_batch_the_measured_rate_cannot_finish_in_its_window_is_refused(
    tmp_path: Path,
) -> None:
    async with on_work_clock(tmp_path) as d:
        # No rate yet: nothing is refused for its window.
        first = await d.create(30 * PER_S, "24h")
        assert first.status_code == 200, first.text
        running = first.json()
        assert running["estimated_completion_at"] is None

        async def measured() -> bool:
            return bool(await d.rate())

        await eventually(measured, timeout_s=120, what="a measured rate")

        async def estimated() -> bool:
            return (await d.batch(running["id"]))["estimated_completion_at"] is not None

        await eventually(estimated, timeout_s=120, what="an estimate")
        batch = await d.batch(running["id"])
        left = batch["request_counts"]["total"] - batch["request_counts"]["completed"]
        # The estimate is where the remaining lines end at the measured rate, give or take.
        ahead = batch["estimated_completion_at"] - d.clock.now()
        assert 0.5 * left / PER_S < ahead < 2 * left / PER_S, (ahead, left)

        # 10 s hold about 500 requests; about 1,000 are still ahead of this one.
        refused = await d.create(100, "10s", d.other)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "capacity_exceeded"
        assert "would fit in that window now" in error["message"]
        assert int(refused.headers["retry-after"]) >= 60
        listed = (await d.bf.client.get("/v1/batches", headers=d.other)).json()["data"]
        assert listed == []

        # A window the backlog and the batch fit in is accepted.
        fits = await d.create(100, "2m", d.other)
        assert fits.status_code == 200, fits.text
