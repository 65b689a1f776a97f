"""An org with history on a model comes back while another org drains a large batch: its new
lines move in step with the other's at once, on SQLite (one ``backfill up``) and on PostgreSQL
(an API and three worker processes). Before lanes were levelled from above, the returning org
waited until the other had claimed as many lines as it had once run itself (the 2026-12-05
review, M1)."""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    ADMIN_TOKEN,
    Api,
    SimulatorProcess,
    chat_line,
    create_pg_database,
    drop_pg_database,
    eventually,
    free_port,
    serve_role,
    start_server_process,
    stop_all,
    wait_http,
    write_sim_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HISTORY = 4_000
BUSY = 20_000
RETURNING = 400


@pytest.fixture(params=["sqlite", "postgresql"])
async def deployment(
    request: pytest.FixtureRequest, tmp_path: Path, fast_sim: SimulatorProcess
) -> AsyncIterator[Api]:
    """The API of a Backfill with the admin API on: one process on SQLite, or an API and three
    workers on PostgreSQL."""
    settings = f'admin_token = "{ADMIN_TOKEN}"\nplan_interval_s = 0.5\n'
    if request.param == "sqlite":
        server = start_server_process(
            tmp_path, fast_sim.base_url, max_concurrency=8, extra=settings
        )
        try:
            yield Api(server.port)
        finally:
            server.stop()
        return
    pg_url = await create_pg_database()
    config = tmp_path / "returning.toml"
    write_sim_config(
        config,
        fast_sim.base_url,
        max_concurrency=8,
        extra=settings
        + f"""
database_url = "{pg_url}"
storage_url = "file://{tmp_path / "blobs"}"
master_key = "{base64.b64encode(os.urandom(32)).decode()}"
""",
    )
    port = free_port()
    processes: list[subprocess.Popen[bytes]] = [
        serve_role(config, "api", tmp_path / "api.log", port)
    ]
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", processes[0])
        processes += [serve_role(config, "worker", tmp_path / f"w{i}.log") for i in range(3)]
        yield Api(port)
    finally:
        stop_all(processes)
        await drop_pg_database(pg_url)


def lines(name: str, n: int) -> list[dict[str, Any]]:
    return [chat_line(f"{name}-{i}", f"{name} {i}") for i in range(n)]


async def completed(api: Api, headers: dict[str, str], batch_id: str) -> int:
    batch = await api.batch(headers, batch_id)
    assert batch["status"] not in {"failed", "expired", "cancelled"}, batch
    done: int = batch["request_counts"]["completed"]
    return done


async def reach(
    api: Api, headers: dict[str, str], batch_id: str, count: int, timeout_s: float = 120
) -> None:
    """Wait until ``count`` of the batch's requests completed."""
    await eventually(
        lambda: completed(api, headers, batch_id),
        lambda done: done >= count,
        timeout_s,
        what=f"{count} completed requests of {batch_id}",
        interval_s=0.05,
    )


async def test_a_returning_org_moves_in_step_at_once(deployment: Api) -> None:
    api = deployment
    back = await api.org("back", 1)
    busy = await api.org("busy", 1)
    await reach(api, back, await api.submit(back, lines("history", HISTORY)), HISTORY)

    # The busy org is new to the model: its lane starts from nothing while no other is busy.
    backlog = await api.submit(busy, lines("busy", BUSY))
    await reach(api, busy, backlog, 100)
    before = await completed(api, busy, backlog)
    await reach(api, back, await api.submit(back, lines("back", RETURNING)), RETURNING)
    ahead = await completed(api, busy, backlog) - before
    assert before + ahead < BUSY, "the backlog must outlast it"
    # At equal weights the returning lines need 2 x RETURNING of the model's requests. Owed its
    # history, the org would wait for about HISTORY of the other's first (ratio about 5.5).
    ratio = (ahead + RETURNING) / (2 * RETURNING)
    print(f"\nreturning org: {ratio:.2f}x its fair-share time ({ahead} of the other's lines)")
    assert ratio <= 2.5, ahead
    await api.client.aclose()
