"""``worker.http_port`` and the worker's own HTTP server: liveness, readiness through the
worker's start and stop, and /metrics behind the metrics token as on the API."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from backfill.adapters.http.auth import FailureBrake
from backfill.adapters.http.worker_probe import METRICS_CONTENT_TYPE, WorkerProbe
from backfill.errors import BackfillError
from backfill.metrics import Metrics
from backfill.settings import Settings
from tests.support import free_port

TOKEN = "metrics-token-for-the-worker-probe-0123456789"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("BACKFILL_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_the_port_is_off_by_default(clean_env: pytest.MonkeyPatch) -> None:
    # Several workers on one machine (and the tests) must not collide on a port.
    assert Settings().worker.http_port is None


def test_the_port_comes_from_the_file_or_the_environment(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "backfill.toml"
    config.write_text("[worker]\nhttp_port = 9091\n")
    clean_env.setenv("BACKFILL_CONFIG", str(config))
    assert Settings().worker.http_port == 9091
    clean_env.setenv("BACKFILL_WORKER__HTTP_PORT", "9090")
    assert Settings().worker.http_port == 9090


@pytest.mark.parametrize("port", [0, -1, 65536, 70000])
def test_a_port_out_of_range_is_refused(port: int, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("BACKFILL_WORKER__HTTP_PORT", str(port))
    with pytest.raises(ValidationError) as refused:
        Settings()
    [error] = refused.value.errors()
    assert error["loc"] == ("worker", "http_port")


@pytest.mark.parametrize("port", [1, 65535])
def test_the_ends_of_the_range_are_ports(port: int) -> None:
    assert Settings(worker={"http_port": port}).worker.http_port == port


class Scrapes:
    """What /metrics renders: a registry with one worker counter, or a failure."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.metrics.results.labels("ok").inc(3)
        self.fail = False

    async def render(self) -> bytes:
        if self.fail:
            raise ConnectionError("database unreachable")
        return self.metrics.render()


async def started(
    scrapes: Scrapes, token: str | None, brake: FailureBrake | None = None
) -> WorkerProbe:
    probe = WorkerProbe(
        "127.0.0.1", free_port(), render_metrics=scrapes.render, metrics_token=token, brake=brake
    )
    await probe.start()
    return probe


@pytest.fixture
async def probe() -> AsyncIterator[WorkerProbe]:
    running = await started(Scrapes(), None)
    try:
        yield running
    finally:
        await running.stop()


def client(probe: WorkerProbe) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{probe.port}", timeout=5)


async def test_readiness_follows_the_workers_start_and_stop(probe: WorkerProbe) -> None:
    async with client(probe) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        starting = await http.get("/readyz")
        assert starting.status_code == 503
        assert starting.json() == {"status": "not ready", "reason": "starting"}
        probe.mark_ready()
        ready = await http.get("/readyz")
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        probe.mark_stopping()
        stopping = await http.get("/readyz")
        assert stopping.status_code == 503
        assert stopping.json() == {"status": "not ready", "reason": "stopping"}
        # Alive while it stops: the kubelet must not kill a worker draining its requests.
        assert (await http.get("/healthz")).status_code == 200


async def test_metrics_are_this_process_registry_in_prometheus_text(probe: WorkerProbe) -> None:
    async with client(probe) as http:
        scraped = await http.get("/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"] == METRICS_CONTENT_TYPE
    assert 'backfill_results_total{outcome="ok"} 3.0' in scraped.text


async def test_the_metrics_token_is_asked_as_the_api_asks_it() -> None:
    probe = await started(Scrapes(), TOKEN)
    try:
        async with client(probe) as http:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": f"Basic {TOKEN}"},
            ):
                refused = await http.get("/metrics", headers=headers)
                assert refused.status_code == 401, headers
                assert refused.json()["error"]["code"] == "invalid_metrics_token"
                assert refused.headers["x-should-retry"] == "false"
                assert "backfill_" not in refused.text
            scraped = await http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert scraped.status_code == 200
            assert "backfill_results_total" in scraped.text
            # The probes need no token: the kubelet sends none.
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).status_code == 503
    finally:
        await probe.stop()


async def test_wrong_tokens_are_braked_per_address() -> None:
    probe = await started(Scrapes(), TOKEN, FailureBrake(2, 60))
    try:
        async with client(probe) as http:
            for _ in range(2):
                assert (await http.get("/metrics")).status_code == 401
            braked = await http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert braked.status_code == 429
            assert braked.json()["error"]["code"] == "too_many_auth_failures"
            assert int(braked.headers["retry-after"]) > 0
    finally:
        await probe.stop()


async def test_a_failed_scrape_answers_503_and_the_probes_go_on() -> None:
    scrapes = Scrapes()
    probe = await started(scrapes, None)
    try:
        scrapes.fail = True
        async with client(probe) as http:
            failed = await http.get("/metrics")
            assert failed.status_code == 503
            assert failed.json()["error"]["code"] == "metrics_unavailable"
            assert (await http.get("/healthz")).status_code == 200
    finally:
        await probe.stop()


async def test_a_port_in_use_is_refused_with_an_operator_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        probe = WorkerProbe("127.0.0.1", port, render_metrics=Scrapes().render, metrics_token=None)
        with pytest.raises(BackfillError) as refused:
            await probe.start()
    message = str(refused.value)
    assert f"127.0.0.1:{port} is already in use" in message
    assert "BACKFILL_WORKER__HTTP_PORT" in message


async def test_a_stopped_probe_closes_its_port(probe: WorkerProbe) -> None:
    await probe.stop()
    with pytest.raises(httpx.ConnectError):
        async with client(probe) as http:
            await http.get("/healthz")
    await probe.stop()  # a second stop is harmless
