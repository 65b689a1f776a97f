"""An engine nobody answers at: the admin API says so with the reason, a batch for its model
tells its owner it waits (``waiting_on``), ``/metrics`` counts it, an API process without a
worker sees the same from the database; and once the engine answers, all of it clears and the
batch finishes by itself."""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

from backfill.container import build
from backfill.domain.engine_health import EngineState
from backfill.simulator.server import Simulator, SimulatorConfig
from tests.support import (
    SIM_MODEL,
    InProcess,
    chat_line,
    eventually,
    in_process_backfill,
    jsonl,
)

ADMIN = {"Authorization": "Bearer admin-secret-for-engine-health"}


@asynccontextmanager
async def simulator_on(port: int) -> AsyncIterator[None]:
    """The engine comes up at the address Backfill was told about."""
    simulator = Simulator(SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4))
    runner = web.AppRunner(simulator.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def engines(bf: InProcess) -> list[dict[str, Any]]:
    response = await bf.client.get("/admin/v1/engines", headers=ADMIN)
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


async def batch(bf: InProcess, batch_id: str) -> dict[str, Any]:
    response = await bf.client.get(f"/v1/batches/{batch_id}")
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def metric(bf: InProcess, name: str, label: str) -> float | None:
    text = (await bf.client.get("/metrics")).text
    found = re.search(rf"^{name}\{{{label}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


async def test_a_down_engine_is_shown_everywhere_and_its_batch_resumes_when_it_answers(
    tmp_path: Path,
) -> None:
    # Bound without listening: connections are refused, and no other process can take the
    # port before the simulator starts on it.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = int(held.getsockname()[1])
    url = f"http://127.0.0.1:{port}/v1"
    async with in_process_backfill(tmp_path, url, admin_token=ADMIN["Authorization"][7:]) as bf:
        [down] = await eventually(lambda: engines(bf), lambda e: e[0]["checked_at"] is not None)
        assert down["id"] == "sim"
        assert down["object"] == "engine"
        assert down["url"] == url
        assert down["models"] == [SIM_MODEL]
        assert down["healthy"] is False
        assert down["state"] == "down"
        assert down["last_error"] == f"cannot connect to 127.0.0.1:{port} (connection refused)"
        assert down["down_since"] <= down["checked_at"]
        assert down["healthy_since"] is None
        assert (down["in_flight"], down["concurrency_limit"], down["max_concurrency"]) == (
            0,
            32,
            32,
        )

        uploaded = await bf.upload(jsonl([chat_line(f"r{i}") for i in range(3)]))
        created = await bf.create(uploaded.json()["id"])
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        waiting = (await batch(bf, batch_id))["waiting_on"]
        assert waiting["code"] == "no_healthy_engine"
        assert waiting["since"] == down["down_since"]
        assert f"No engine serving model '{SIM_MODEL}'" in waiting["message"]
        assert "resumes by itself" in waiting["message"]
        listed = (await bf.client.get("/v1/batches")).json()["data"]
        assert listed[0]["waiting_on"] == waiting

        assert await metric(bf, "backfill_engine_healthy", 'engine="sim"') == 0
        assert await metric(bf, "backfill_batches_waiting_on_engine", f'model="{SIM_MODEL}"') == 1

        # An API process without a worker reads the same from the database.
        api = build(bf.settings, role="api")
        await api.init()
        try:
            [stored] = await api.services.operations.engines()
            assert (stored.engine, stored.state, stored.last_error) == (
                "sim",
                EngineState.DOWN,
                down["last_error"],
            )
            assert stored.worker == down["worker"]
            org = await api.store.org_by_name("default")
            assert org is not None
            seen = await api.services.batches.get(org.id, batch_id)
            assert seen.waiting_on is not None
            assert seen.waiting_on.code == "no_healthy_engine"
        finally:
            await api.store.close()

        held.close()
        async with simulator_on(port):
            finished = await bf.wait(batch_id, timeout_s=30)
            assert finished["status"] == "completed"
            assert finished["request_counts"]["completed"] == 3
            assert finished["waiting_on"] is None
            [up] = await eventually(lambda: engines(bf), lambda e: e[0]["healthy"])
            assert (up["state"], up["last_error"], up["down_since"]) == ("up", None, None)
            assert up["healthy_since"] >= down["down_since"]
            assert await metric(bf, "backfill_engine_healthy", 'engine="sim"') == 1
            waiting_metric = await metric(
                bf, "backfill_batches_waiting_on_engine", f'model="{SIM_MODEL}"'
            )
            assert waiting_metric == 0


async def test_a_batch_whose_model_no_worker_serves_says_so(tmp_path: Path) -> None:
    """An API with no engine for the model at all (no worker runs, or none serves it)."""
    async with in_process_backfill(tmp_path, "http://127.0.0.1:9/v1", engines=[]) as bf:
        uploaded = await bf.upload(jsonl([chat_line("r0")]))
        created = (await bf.create(uploaded.json()["id"])).json()
        waiting = (await batch(bf, created["id"]))["waiting_on"]
        assert waiting["code"] == "no_healthy_engine"
        assert waiting["since"] == created["created_at"]
        assert f"No running worker has an engine for model '{SIM_MODEL}'" in waiting["message"]
        cancelled = await bf.client.post(f"/v1/batches/{created['id']}/cancel", json={})
        assert cancelled.json()["waiting_on"] is None, "a cancelling batch waits on no engine"
