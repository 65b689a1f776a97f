"""Engines managed at run time, end to end (docs/fleet.md): an API process and three worker
processes on one PostgreSQL database. An engine added through ``POST /admin/v1/engines`` is
served by all three within seconds, with no restart; the config file's engine, removed
mid-drain through ``DELETE``, drains: nothing is lost, nothing is answered or charged twice.
The engine's API key is never shown, nor logged."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import (
    ADMIN_TOKEN,
    SIM_MODEL,
    Api,
    SimulatorProcess,
    assert_exactly_once,
    chat_line,
    free_port,
    serve_role,
    start_simulator_process,
    stop_all,
    wait_http,
    write_sim_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SECRET = "engine-key-never-shown-0123"
# Per worker: three workers hold at most 3 x 2 requests on the added engine.
PER_WORKER = 2


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def up_on(client: httpx.AsyncClient, engine: str) -> set[str]:
    """The workers whose health check finds ``engine`` up."""
    listed = (await client.get("/admin/v1/engines", headers=ADMIN)).json()["data"]
    return {e["worker"] for e in listed if e["id"] == engine and e["state"] == "up"}


async def test_an_engine_added_through_the_api_serves_on_every_worker_and_one_removed_drains(
    tmp_path: Path, pg_url: str
) -> None:
    slow = ("--ttft-ms", "20", "--itl-ms", "5", "--output-tokens", "16")
    first: SimulatorProcess = start_simulator_process(*slow)
    added: SimulatorProcess = start_simulator_process(*slow)
    config = tmp_path / "engines.toml"
    write_sim_config(
        config,
        first.base_url,
        max_concurrency=4,
        extra=f"""
database_url = "{pg_url}"
storage_url = "file://{tmp_path / "blobs"}"
master_key = "{base64.b64encode(os.urandom(32)).decode()}"
admin_token = "{ADMIN_TOKEN}"
worker.engine_config_poll_s = 0.5
""",
    )
    processes: list[subprocess.Popen[bytes]] = []
    try:
        port = free_port()
        processes.append(serve_role(config, "api", tmp_path / "api.log", port))
        wait_http(f"http://127.0.0.1:{port}/healthz", processes[0])
        processes += [serve_role(config, "worker", tmp_path / f"worker{i}.log") for i in range(3)]
        api = Api(port)
        client = api.client
        org = await api.org("acme", 1)

        async def on_three(engine: str) -> bool:
            return len(await up_on(client, engine)) == 3

        await until("the file's engine on three workers", lambda: on_three("sim"))
        body: dict[str, Any] = {
            "name": "sim-added",
            "base_url": added.base_url,
            "models": [SIM_MODEL],
            "max_concurrency": PER_WORKER,
            "request_timeout_s": 5.0,
            "api_key": SECRET,
        }
        made = await client.post("/admin/v1/engines", json=body, headers=ADMIN)
        assert made.status_code == 200, made.text
        assert made.json()["has_api_key"] is True
        assert SECRET not in made.text
        assert "api_key" not in made.json()
        taken = await client.post("/admin/v1/engines", json=body, headers=ADMIN)
        assert taken.status_code == 409, taken.text
        bad = await client.post(
            "/admin/v1/engines", json=body | {"name": "x", "max_concurrency": 0}, headers=ADMIN
        )
        assert bad.status_code == 400, bad.text
        assert "max_concurrency" in bad.json()["error"]["message"]
        await until("the added engine on three workers", lambda: on_three("sim-added"))

        rows = [chat_line(f"r{i}", f"question {i}") for i in range(600)]
        batch_id = await api.submit(org, rows)

        async def done_at_least(count: int) -> bool:
            batch = await api.batch(org, batch_id)
            return int(batch["request_counts"]["completed"]) >= count

        await until("a third of the batch", lambda: done_at_least(200))
        gone = await client.delete("/admin/v1/engines/sim", headers=ADMIN)
        assert gone.status_code == 200, gone.text

        async def sim_gone() -> bool:
            return not await up_on(client, "sim")

        await until("the removed engine gone from every worker", sim_gone)

        async def ended() -> bool:
            return bool((await api.batch(org, batch_id))["status"] == "completed")

        await until("the batch's end", ended, timeout_s=120)
        batch = await api.batch(org, batch_id)
        out = await api.rows(org, batch["output_file_id"])
        assert_exactly_once(rows, out, [])
        charged = 0
        for row in out:
            receipt = await client.get(f"/v1/receipts/{row['response']['request_id']}", headers=org)
            charged += int(receipt.json()["amount"]["value"])
        ledger = (await client.get("/v1/organization/ledger", headers=org)).json()["data"]
        charge = next(e for e in ledger if e["batch_id"] == batch_id)
        assert -int(charge["amount"]["value"]) == charged > 0
        shown = (await client.get("/admin/v1/engine_settings", headers=ADMIN)).json()["data"]
        assert [e["id"] for e in shown] == ["sim-added"]
        assert SECRET not in str(shown)
        # Three workers held up to PER_WORKER each on the added engine: more than two workers'
        # worth at once means all three served it.
        assert added.stats()["peak_in_flight"] > 2 * PER_WORKER, added.stats()
        for log in tmp_path.glob("*.log"):
            assert SECRET not in log.read_text(), log
    finally:
        stop_all(processes)
        first.stop()
        added.stop()
