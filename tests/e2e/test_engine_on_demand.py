"""An engine started on demand, end to end (docs/fleet.md, "Engines on demand"): ``backfill
up`` with the bundled llama.cpp chat engine as an ``[[engines]]`` entry with ``on_demand``.
Nothing runs until a batch waits; the batch says ``engine_starting`` while the engine loads,
then completes; the start time is learnt and reported; the engine stops once idle and a second
batch starts it again."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from backfill.adapters.engines.managed import llama_cpp_command
from tests.e2e.test_engine_down import admin
from tests.e2e.test_local_embeddings import _engines
from tests.support import (
    ADMIN_TOKEN,
    SIM_MODEL,
    assert_exactly_once,
    batch_of,
    chat_line,
    rows_of,
    serve_config,
    submit,
    until,
    write_sim_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.llama, pytest.mark.timeout(300)]

IDLE_STOP_S = 4


def engine(client: httpx.Client) -> dict[str, Any]:
    listed = client.get("/admin/v1/engines", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert listed.status_code == 200, listed.text
    [chat] = listed.json()["data"]
    return dict(chat)


def drain(client: httpx.Client, tag: str) -> set[str]:
    """A small batch, polled until it completes; what ``waiting_on`` said meanwhile."""
    rows = [chat_line(f"{tag}{i}", f"say {i}", max_tokens=4) for i in range(3)]
    batch_id = submit(client, rows)
    waits: set[str] = set()
    deadline = time.monotonic() + 180
    while (batch := batch_of(client, batch_id))["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        if batch.get("waiting_on"):
            waits.add(batch["waiting_on"]["code"])
        time.sleep(0.05)
    assert batch["status"] == "completed", batch
    out = rows_of(client, batch["output_file_id"])
    err = rows_of(client, batch.get("error_file_id"))
    assert_exactly_once(rows, out, err)
    assert err == []
    return waits


def test_an_engine_on_demand_starts_for_work_reports_its_start_and_stops_when_idle(
    tmp_path: Path,
) -> None:
    command = llama_cpp_command(SIM_MODEL, n_ctx=2048, parallel=1)
    config = tmp_path / "backfill.toml"
    write_sim_config(
        config,
        "",
        extra=f'admin_token = "{ADMIN_TOKEN}"',
        engines=f"""
[[engines]]
name = "chat"
models = ["{SIM_MODEL}"]
max_concurrency = 1
command = {json.dumps(command)}
on_demand = true
idle_stop_s = {IDLE_STOP_S}
""",
    )
    server = serve_config(tmp_path, config)
    process = server.process
    try:
        with server.client() as client:
            time.sleep(3)  # a few of the worker's looks at the queue, with nothing waiting
            assert _engines(process.pid) == [], "nothing waits: the engine must not run"
            assert engine(client)["state"] == "standby"

            waits = drain(client, "a")
            assert "engine_starting" in waits, waits
            assert len(_engines(process.pid)) == 1
            learnt = engine(client)
            assert learnt["state"] == "up"
            assert learnt["start_s"] is not None, learnt
            assert 0 < learnt["start_s"] < 120, learnt
            assert "healthy (starts in ~" in admin(server, "engine", "list")

            # Idle for its idle_stop_s: stopped, its CPU and memory given back.
            until("the idle engine to stop", lambda: _engines(process.pid) == [], 60)
            until("standby reported", lambda: engine(client)["state"] == "standby", 30)

            waits = drain(client, "b")
            assert "engine_starting" in waits, waits
            assert engine(client)["start_s"] > 0
        log = server.log.read_text()
        assert log.count("engine chat starts on demand") == 2, log
        assert "engine chat stops: no request for" in log
    finally:
        server.stop()
