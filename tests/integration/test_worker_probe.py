"""A real ``backfill serve --role worker`` with ``BACKFILL_WORKER__HTTP_PORT``: it answers
/healthz, /readyz once started and /metrics with what only the worker counts (the results it
stored), behind the metrics token; a second worker on the same port is refused with a clear
message; SIGTERM stops it cleanly and closes the port. An API process on the same SQLite file
takes the batch (docs/deployment.md, "One machine, the API apart from the worker")."""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support import (
    ADMIN_TOKEN,
    Api,
    SimulatorProcess,
    chat_line,
    eventually,
    free_port,
    serve_role,
    start_simulator_process,
    stop_all,
    wait_http,
    wait_terminal,
    write_sim_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

METRICS_TOKEN = "metrics-token-for-the-worker-probe-e2e-0123456789"
LINES = 6


async def readiness(client: httpx.AsyncClient, process: subprocess.Popen[bytes]) -> int:
    """The status /readyz answers (0 while nothing listens); fails once the worker exited."""
    assert process.poll() is None, f"the worker exited with {process.returncode}"
    try:
        return (await client.get("/readyz")).status_code
    except httpx.HTTPError:
        return 0


def results_ok(text: str) -> float:
    """The value of ``backfill_results_total{outcome="ok"}``, 0 when it has no sample."""
    found = re.search(r'^backfill_results_total\{outcome="ok"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def test_a_worker_serves_its_probes_and_metrics_and_stops_on_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim: SimulatorProcess = start_simulator_process(
        "--ttft-ms", "5", "--itl-ms", "0", "--output-tokens", "8"
    )
    config = tmp_path / "backfill.toml"
    write_sim_config(
        config,
        sim.base_url,
        extra=f"""
data_dir = "{tmp_path / "data"}"
master_key = "{base64.b64encode(os.urandom(32)).decode()}"
admin_token = "{ADMIN_TOKEN}"
metrics_token = "{METRICS_TOKEN}"
worker.idle_poll_s = 0.2
""",
    )
    processes: list[subprocess.Popen[bytes]] = []
    clients: list[httpx.AsyncClient] = []
    try:
        api_port = free_port()
        api_process = serve_role(config, "api", tmp_path / "api.log", api_port)
        processes.append(api_process)
        wait_http(f"http://127.0.0.1:{api_port}/healthz", api_process)

        probe_port = free_port()
        monkeypatch.setenv("BACKFILL_WORKER__HTTP_PORT", str(probe_port))
        probe = httpx.AsyncClient(base_url=f"http://127.0.0.1:{probe_port}", timeout=10)
        clients.append(probe)
        worker = serve_role(config, "worker", tmp_path / "worker.log")
        processes.append(worker)
        wait_http(f"http://127.0.0.1:{probe_port}/healthz", worker)
        await eventually(
            lambda: readiness(probe, worker), lambda status: status == 200, 60, what="ready"
        )
        assert (await probe.get("/healthz")).json() == {"status": "ok"}
        assert (await probe.get("/readyz")).json() == {"status": "ready"}

        # The metrics token is asked as the API asks it; the probes need none.
        for headers in ({}, {"Authorization": "Bearer not-the-token"}):
            refused = await probe.get("/metrics", headers=headers)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "invalid_metrics_token"
        token = {"Authorization": f"Bearer {METRICS_TOKEN}"}
        scraped = await probe.get("/metrics", headers=token)
        assert scraped.status_code == 200
        assert scraped.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert "# TYPE backfill_results_total counter" in scraped.text

        api = Api(api_port)
        clients.append(api.client)
        org = await api.org("acme", 1)
        batch_id = await api.submit(org, [chat_line(f"r{i}") for i in range(LINES)])
        batch = await wait_terminal(api.client, batch_id, headers=org)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"]["completed"] == LINES

        # What the worker stored is counted by the worker, and only its port reports it.
        worker_text = (await probe.get("/metrics", headers=token)).text
        assert results_ok(worker_text) == LINES
        assert re.search(r'^backfill_tokens_total\{kind="output"\} [1-9]', worker_text, re.M)
        api_text = (await api.client.get("/metrics", headers=token)).text
        assert results_ok(api_text) == 0

        # A second worker on the same port is refused before it claims anything.
        second_log = tmp_path / "second.log"
        second = serve_role(config, "worker", second_log)
        processes.append(second)
        assert second.wait(60) == 1
        assert f"127.0.0.1:{probe_port} is already in use" in second_log.read_text()
        assert (await probe.get("/readyz")).status_code == 200

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(40) == 0, (tmp_path / "worker.log").read_text()
        with pytest.raises(httpx.ConnectError):
            await probe.get("/healthz")
    finally:
        stop_all(processes)
        sim.stop()
        for client in clients:
            await client.aclose()
