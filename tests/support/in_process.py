"""Backfill and the simulator in this test's process and event loop."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

import backfill.container
from backfill.adapters.blobs.raw import LocalRawStore
from backfill.adapters.clock import ManualClock, SystemClock
from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.container import Backfill, build
from backfill.domain.money import usd_to_pico
from backfill.ports import Clock, Engine
from backfill.services.retention import Janitor
from backfill.settings import Settings
from backfill.simulator.server import Simulator, SimulatorConfig
from bench.common import free_port
from tests.support.lines import SIM_MODEL, STARTING_CREDIT_USD, jsonl
from tests.support.settings import sim_settings
from tests.support.waits import wait_terminal

# Quick short answers. Shared: a test that changes its simulator's config passes its own copy.
FAST = SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4)

Sim = tuple[str, Simulator]


@asynccontextmanager
async def _serving(
    app: web.Application, *, shutdown_timeout_s: float, handler_cancellation: bool
) -> AsyncIterator[str]:
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        handler_cancellation=handler_cancellation,
    )
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def running_simulator(config: SimulatorConfig | None = None) -> AsyncIterator[Sim]:
    """The simulator in this loop: (base URL ending in /v1, simulator). A request its client
    abandons is cancelled. Without ``config``, a copy of ``FAST`` the test may change."""
    simulator = Simulator(config or replace(FAST))
    async with _serving(simulator.app(), shutdown_timeout_s=1.0, handler_cancellation=True) as url:
        yield url, simulator


def in_flight(sim: Simulator) -> Callable[[], Awaitable[int]]:
    """A reader of how many requests ``sim`` is answering now, for ``eventually``."""

    async def read() -> int:
        return sim.stats.in_flight

    return read


@dataclass(frozen=True)
class Attempt:
    """One POST as the simulator saw it: its model, its prompt (the messages' contents), the
    status it answered (0: none, the handler raised or was abandoned), when, and the request
    priority it carried."""

    model: str
    prompt: str
    status: int
    started: float
    ended: float
    priority: object = 0


def _recorder(attempts: list[Attempt]) -> Any:
    """A middleware appending every POST it sees, once answered, to ``attempts``."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST":
            return await handler(request)
        started = time.monotonic()
        body = orjson.loads(await request.read())
        prompt = "\n".join(str(m.get("content")) for m in body.get("messages") or [])
        status = 0
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            attempts.append(
                Attempt(
                    str(body.get("model")),
                    prompt,
                    status,
                    started,
                    time.monotonic(),
                    body.get("priority", 0),
                )
            )

    return record


@asynccontextmanager
async def recording_simulator(
    config: SimulatorConfig,
) -> AsyncIterator[tuple[str, Simulator, list[Attempt]]]:
    """The simulator in this loop, recording every POST it answers; it does not wait for hung
    handlers at exit."""
    sim = Simulator(config)
    attempts: list[Attempt] = []
    app = sim.app()
    app.middlewares.append(_recorder(attempts))
    async with _serving(app, shutdown_timeout_s=0.5, handler_cancellation=False) as url:
        yield url, sim, attempts


@dataclass
class InProcess:
    """A started in-process Backfill and an HTTP client authenticated as org ``default``."""

    backfill: Backfill
    client: httpx.AsyncClient
    key: str
    clock: Clock
    settings: Settings

    async def upload(self, content: bytes, purpose: str = "batch") -> httpx.Response:
        return await self.client.post(
            "/v1/files",
            data={"purpose": purpose},
            files={"file": ("input.jsonl", content, "application/jsonl")},
        )

    async def create(self, file_id: str, **extra: Any) -> httpx.Response:
        body = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **extra,
        }
        return await self.client.post("/v1/batches", json=body)

    async def submit(self, rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """Upload ``rows`` and create a 24h batch of them (``extra`` in the create body); the
        created batch."""
        uploaded = await self.upload(jsonl(rows))
        assert uploaded.status_code == 200, uploaded.text
        created = await self.create(uploaded.json()["id"], **extra)
        assert created.status_code == 200, created.text
        batch: dict[str, Any] = created.json()
        return batch

    async def batch(self, batch_id: str, key: str | None = None) -> dict[str, Any]:
        """The batch as org ``default`` (or the holder of ``key``) reads it."""
        headers = {"Authorization": f"Bearer {key}"} if key else None
        response = await self.client.get(f"/v1/batches/{batch_id}", headers=headers)
        assert response.status_code == 200, response.text
        batch: dict[str, Any] = response.json()
        return batch

    async def run_batch(self, rows: list[dict[str, Any]], timeout_s: float = 60) -> dict[str, Any]:
        created = await self.submit(rows)
        return await self.wait(created["id"], timeout_s)

    async def wait(
        self, batch_id: str, timeout_s: float = 60, *, key: str | None = None
    ) -> dict[str, Any]:
        """The batch once it ends, as org ``default`` (or the holder of ``key``) reads it."""
        headers = {"Authorization": f"Bearer {key}"} if key else None
        return await wait_terminal(self.client, batch_id, headers=headers, timeout_s=timeout_s)

    async def rows(self, file_id: str | None) -> list[dict[str, Any]]:
        if not file_id:
            return []
        response = await self.client.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 200, response.text
        return [orjson.loads(line) for line in response.content.splitlines()]


def engines_of(settings: Settings) -> list[Engine]:
    """The engines ``settings`` lists, as the container builds them (no managed processes)."""
    return [
        OpenAIHttpEngine(
            e.name,
            e.base_url,
            {m: m for m in e.models},
            max_concurrency=e.max_concurrency,
            request_timeout_s=e.request_timeout_s,
        )
        for e in settings.engines
    ]


@asynccontextmanager
async def in_process_backfill(
    tmp_path: Path,
    sim_url: str,
    *,
    clock: Clock | None = None,
    engines: list[Engine] | None = None,
    stored_engines: bool = False,
    **overrides: Any,
) -> AsyncIterator[InProcess]:
    """Backfill in this loop on the simulator at ``sim_url``. Its engines are ``engines``, or
    those of its settings; with ``stored_engines``, those stored for every worker, which the
    settings seed, as ``backfill up`` serves them."""
    settings = sim_settings(tmp_path / "data", sim_url, **overrides)
    clock = clock or SystemClock()
    if engines is None and not stored_engines:
        engines = engines_of(settings)
    app_backfill = build(settings, clock=clock, engines=engines)
    await app_backfill.start()
    key = await app_backfill.services.tenants.bootstrap(credit=usd_to_pico(STARTING_CREDIT_USD))
    assert key is not None
    transport = httpx.ASGITransport(app=app_backfill.app())
    client = httpx.AsyncClient(
        transport=transport,
        base_url="http://backfill.test",
        headers={"Authorization": f"Bearer {key}"},
    )
    try:
        yield InProcess(app_backfill, client, key, clock, settings)
    finally:
        await client.aclose()
        await app_backfill.stop()


@asynccontextmanager
async def backfill_with(tmp_path: Path, sim: Sim, **overrides: Any) -> AsyncIterator[InProcess]:
    """An in-process Backfill on ``sim`` (the ``sim`` fixture) with settings overrides."""
    async with in_process_backfill(tmp_path, sim[0], **overrides) as running:
        yield running


def sim_engine(
    url: str, *, max_concurrency: int = 16, request_timeout_s: float = 10.0
) -> OpenAIHttpEngine:
    """The simulator at ``url`` as an engine with these limits."""
    return OpenAIHttpEngine(
        "sim",
        url,
        {SIM_MODEL: SIM_MODEL},
        max_concurrency=max_concurrency,
        request_timeout_s=request_timeout_s,
    )


@asynccontextmanager
async def backfill_on(
    tmp_path: Path,
    config: SimulatorConfig,
    *,
    max_concurrency: int = 16,
    request_timeout_s: float = 600.0,
    attempts: list[Attempt] | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[InProcess, Simulator]]:
    """A simulator with ``config`` in this loop (recording every POST in ``attempts`` when
    given), and Backfill in process with it as its only engine, limited to ``max_concurrency``
    requests at a time. Abandoned slow answers are not waited for at exit."""
    sim = Simulator(config)
    app = sim.app()
    if attempts is not None:
        app.middlewares.append(_recorder(attempts))
    async with _serving(app, shutdown_timeout_s=0.5, handler_cancellation=False) as url:
        engine = sim_engine(
            url, max_concurrency=max_concurrency, request_timeout_s=request_timeout_s
        )
        async with in_process_backfill(tmp_path, url, engines=[engine], **overrides) as bf:
            yield bf, sim


@asynccontextmanager
async def retained(tmp_path: Path) -> AsyncIterator[tuple[InProcess, ManualClock, Janitor]]:
    """Backfill in process on a manual clock, and a janitor on that clock: the built-in one
    never runs, so each test sweeps when it wants to."""
    clock = ManualClock()
    async with (
        running_simulator() as (url, _),
        in_process_backfill(tmp_path, url, clock=clock, janitor_interval_s=10**9) as bf,
    ):
        yield bf, clock, Janitor(bf.backfill.store, bf.backfill.services.files, clock)


StoreT = TypeVar("StoreT", bound=LocalRawStore)


@asynccontextmanager
async def backfill_on_raw_store(
    tmp_path: Path,
    sim_url: str,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[Path], StoreT],
    **overrides: Any,
) -> AsyncIterator[tuple[InProcess, StoreT]]:
    """An in-process Backfill whose local blob store is ``make(root)``: a real store with a
    fault the test injects where a real disk or bucket would raise it."""
    made: list[StoreT] = []

    def raw_store(settings: Settings) -> StoreT:
        made.append(make(settings.resolved_storage_path))
        return made[-1]

    monkeypatch.setattr(backfill.container, "_raw_store", raw_store)
    async with in_process_backfill(tmp_path, sim_url, **overrides) as running:
        yield running, made[0]
