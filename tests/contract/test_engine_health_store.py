"""Engine health reports, on SQLite and PostgreSQL: a worker's row per engine replaced by its
next report, rows of a worker that stopped reporting ignored after their ``until`` and removed
a day later, the running batches by model that may wait on them; and the worker's writer,
which stores what the health watch finds as soon as it changes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from backfill.adapters.clock import ManualClock, SystemClock
from backfill.adapters.db.store import SqlStore
from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.domain.engine_health import EngineReport, EngineState
from backfill.domain.lifecycle import BatchStatus
from backfill.runner.engine_pool import EnginePool
from backfill.runner.engine_reports import EngineReports
from backfill.runner.inputs import Queued
from backfill.runner.loops import Loops
from backfill.runner.slots import EngineSlot
from tests.contract.test_store import LEASE, NOW, make_batch, make_org, ok, take
from tests.support import free_port


def report(worker: str, engine: str, **changes: Any) -> EngineReport:
    made = EngineReport(
        worker=worker,
        engine=engine,
        url="http://10.0.0.7:8000/v1",
        models=("m-a", "m-b"),
        state=EngineState.DOWN,
        last_error="cannot connect to 10.0.0.7:8000 (connection refused)",
        since=NOW - 5,
        checked_at=NOW,
        in_flight=3,
        max_concurrency=16,
        concurrency_limit=12,
        mode="shared",
        signal="metrics",
        pressure=4.5,
        until=NOW + LEASE,
    )
    return dataclasses.replace(made, **changes)


async def test_reports_read_back_as_written_by_engine_then_worker(store: SqlStore) -> None:
    written = [
        report("w2", "vllm", priority="ignored"),
        report("w1", "vllm", priority="applied"),
        report("w1", "llama", models=(), state=EngineState.STARTING, start_s=7.5),
    ]
    await store.report_engines(written, NOW)
    assert await store.engine_reports(NOW) == [written[2], written[1], written[0]]


async def test_a_new_report_replaces_the_workers_row_for_that_engine(store: SqlStore) -> None:
    await store.report_engines([report("w1", "vllm"), report("w2", "vllm")], NOW)
    up = report("w1", "vllm", state=EngineState.UP, last_error=None, since=NOW + 1)
    await store.report_engines([up], NOW + 1)
    assert await store.engine_reports(NOW + 1) == [up, report("w2", "vllm")]


async def test_rows_of_a_worker_that_stopped_reporting_stop_counting(store: SqlStore) -> None:
    await store.report_engines([report("dead", "vllm"), report("live", "vllm")], NOW)
    later = NOW + LEASE + 1
    await store.report_engines([report("live", "vllm", until=later + LEASE)], later)
    assert [r.worker for r in await store.engine_reports(later)] == ["live"]
    # Still there for a day (what a crashed worker last saw), then removed.
    await store.report_engines([], NOW + LEASE + 24 * 3600 + 1)
    assert [r.worker for r in await store.engine_reports(0)] == ["live"]


async def test_a_stopping_worker_forgets_only_its_own_rows(store: SqlStore) -> None:
    await store.report_engines([report("w1", "a"), report("w1", "b"), report("w2", "a")], NOW)
    await store.forget_engines("w1")
    assert [(r.worker, r.engine) for r in await store.engine_reports(NOW)] == [("w2", "a")]


async def test_running_batches_by_model_count_those_with_lines_left(store: SqlStore) -> None:
    org = await make_org(store)
    await make_batch(store, org, 2, model="m-a")
    await make_batch(store, org, 2, model="m-a")
    await make_batch(store, org, 2, model="m-b", status=BatchStatus.CANCELLING)
    drained = await make_batch(store, org, 1, model="m-c")
    [item] = await take(store, drained, 1, "t", NOW + LEASE, NOW)
    assert await store.write_results([ok(item, "t")]) == [True]
    assert await store.running_batches_by_model() == {"m-a": 2}


@asynccontextmanager
async def engine_on(port: int) -> AsyncIterator[None]:
    """An OpenAI-compatible server comes up where the engine was said to be."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m-a", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


def no_start(_slot: EngineSlot, _queued: Queued) -> None:
    raise AssertionError("no request runs in this test")


async def stored_state(store: SqlStore, wanted: EngineState) -> EngineReport:
    """The worker's row once it says ``wanted``; the writer runs on its own, so wait for it."""
    deadline = time.monotonic() + 30
    while True:
        rows = await store.engine_reports(NOW)
        if rows and rows[0].state == wanted:
            return rows[0]
        assert time.monotonic() < deadline, f"still {rows!r}"
        await asyncio.sleep(0.05)


async def test_the_writer_stores_each_health_change_without_waiting_for_a_heartbeat(
    store: SqlStore,
) -> None:
    port = free_port()
    engine = OpenAIHttpEngine("vllm", f"http://127.0.0.1:{port}/v1", {"m-a": "m-a"})
    pool = EnginePool([engine], no_start, clock=SystemClock())
    reports = EngineReports(
        store, pool, "w1", ManualClock(NOW), ttl_s=LEASE, heartbeat_s=3600.0, min_gap_s=0.0
    )
    pool.on_health_change = reports.changed
    loops = Loops()
    pool.start()
    loops.repeat("engine-reports", lambda: reports.step(loops.stopping))
    try:
        down = await stored_state(store, EngineState.DOWN)
        assert down.last_error == f"cannot connect to 127.0.0.1:{port} (connection refused)"
        assert (down.worker, down.engine, down.url, down.until) == (
            "w1",
            "vllm",
            f"http://127.0.0.1:{port}/v1",
            NOW + LEASE,
        )
        async with engine_on(port):
            up = await stored_state(store, EngineState.UP)
            assert up.last_error is None
    finally:
        loops.stopping.set()
        await asyncio.gather(*loops.tasks)
        await pool.stop()
    await reports.withdraw()
    assert await store.engine_reports(NOW) == []
