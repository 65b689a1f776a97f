"""The demand signal for autoscalers (``GET /admin/v1/queue``, ``backfill_model_*`` on
/metrics) while a batch drains over two simulated replicas, on SQLite and PostgreSQL: the
replicas up, the rate one replica serves, and the replicas that finish every accepted batch
before its deadline less the margin, checked against the same figures worked out here; and the
same answer from an API process without a worker.

Time here is work, as in test_deadlines.py: the clock moves one second for every ``PER_S``
requests the two replicas take, so each replica serves ``PER_S / 2`` requests per clock
second however fast this machine is, and a queue whose requests all hang stands still.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.cli.main import app
from backfill.container import build
from backfill.ports import Engine
from backfill.settings import Settings
from backfill.simulator.server import Simulator, SimulatorConfig
from tests.support import (
    ADMIN_TOKEN,
    SIM_MODEL,
    TERMINAL,
    InProcess,
    chat_line,
    create_pg_database,
    drop_pg_database,
    eventually,
    in_process_backfill,
    jsonl,
    running_simulator,
    write_sim_config,
)

PER_S = 50  # requests the two replicas take together per clock second
START = 1_800_000_000.0
MARGIN = 0.1  # scheduling.deadline_margin_fraction, the default
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class WorkClock:
    """A clock that advances by one second for every ``per_s`` requests the engines take."""

    def __init__(self, sims: list[Simulator], per_s: float) -> None:
        self._sims = sims
        self._per_s = per_s

    def now(self) -> float:
        return START + sum(sim.stats.requests for sim in self._sims) / self._per_s

    def monotonic(self) -> float:
        return time.monotonic()


def replica(name: str, url: str) -> OpenAIHttpEngine:
    return OpenAIHttpEngine(name, url, {SIM_MODEL: SIM_MODEL}, max_concurrency=4)


def needed(queued: int, batch: dict[str, Any], per_replica: float, now: float) -> int:
    """The replicas one batch needs, by hand: its queued requests over the time left until its
    deadline less the margin, over one replica's rate, rounded up."""
    window: int = batch["expires_at"] - batch["created_at"]
    due: float = batch["expires_at"] - MARGIN * window
    return max(1, math.ceil(queued / (max(due - now, 1.0) * per_replica) - 1e-9))


def metric(text: str, name: str) -> float | None:
    match = re.search(rf'^{name}{{model="{SIM_MODEL}"}} (\S+)$', text, re.MULTILINE)
    return None if match is None else float(match.group(1))


def demand_metrics(text: str) -> dict[str, float | None]:
    names = ("queued_requests", "replicas", "replica_requests_per_s", "replicas_needed")
    return {name: metric(text, f"backfill_model_{name}") for name in names}


@asynccontextmanager
async def api_process(settings: Settings, clock: WorkClock) -> AsyncIterator[httpx.AsyncClient]:
    """A second process of the deployment that serves the API only (no worker, no engines)."""
    other = build(settings, role="api", clock=clock)
    await other.start()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=other.app()), base_url="http://api.test"
    )
    try:
        yield client
    finally:
        await client.aclose()
        await other.stop()


async def queue_of(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    answer = await client.get("/admin/v1/queue", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    assert answer.json()["object"] == "list"
    data: list[dict[str, Any]] = answer.json()["data"]
    return data


async def metrics_of(client: httpx.AsyncClient) -> str:
    answer = await client.get("/metrics")
    assert answer.status_code == 200, answer.text
    return answer.text


async def create(bf: InProcess, rows: list[dict[str, Any]], window: str) -> dict[str, Any]:
    uploaded = await bf.upload(jsonl(rows))
    assert uploaded.status_code == 200, uploaded.text
    created = await bf.create(uploaded.json()["id"], completion_window=window)
    assert created.status_code == 200, created.text
    batch: dict[str, Any] = created.json()
    return batch


async def drain_observed(
    bf: InProcess, clock: WorkClock, batch: dict[str, Any]
) -> list[tuple[float, dict[str, Any], float]]:
    """Read the queue until the batch ends: (clock before, the model's object, clock after)."""
    seen: list[tuple[float, dict[str, Any], float]] = []
    deadline = time.monotonic() + 180
    while (await bf.batch(batch["id"]))["status"] not in TERMINAL:
        assert time.monotonic() < deadline, "the batch never ended"
        before = clock.now()
        found = await queue_of(bf.client)
        after = clock.now()
        seen += [(before, q, after) for q in found if q["model"] == SIM_MODEL]
        await asyncio.sleep(0.02)
    return seen


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_replicas_needed_follow_a_drain_and_every_process_answers_the_same(
    tmp_path: Path, database: str
) -> None:
    url = await create_pg_database() if database == "postgresql" else ""
    config = SimulatorConfig(ttft_ms=10, itl_ms=0, output_tokens=4)
    try:
        async with (
            running_simulator(config) as (url_a, sim_a),
            running_simulator(config) as (url_b, sim_b),
        ):
            clock = WorkClock([sim_a, sim_b], PER_S)
            engines: list[Engine] = [replica("a", url_a), replica("b", url_b)]
            async with (
                in_process_backfill(
                    tmp_path,
                    url_a,
                    engines=engines,
                    clock=clock,
                    min_completion_window_s=1,
                    plan_interval_s=0.05,
                    lease_s=3600.0,  # leases run on the clock too: out of the way
                    deadline_admission=False,
                    admin_token=ADMIN_TOKEN,
                    database_url=url,
                ) as bf,
                api_process(bf.settings, clock) as api,
            ):
                await check_a_drain(bf, api, clock)
                await check_a_queue_standing_still(bf, api, clock, [sim_a, sim_b])
    finally:
        if url:
            await drop_pg_database(url)


async def check_a_drain(bf: InProcess, api: httpx.AsyncClient, clock: WorkClock) -> None:
    """The figures while 2,000 requests drain, each as worked out here from the queue and the
    rate it was made from; and once the batch ended, 0 needed in the process with the worker
    and in the one without."""
    # Both replicas up, nothing queued: the model is listed on /metrics at 0 needed.
    idle = await eventually(
        lambda: metrics_of(bf.client),
        lambda text: metric(text, "backfill_model_replicas") == 2,
        what="both replicas up on /metrics",
    )
    assert demand_metrics(idle) == {
        "queued_requests": 0,
        "replicas": 2,
        "replica_requests_per_s": None,  # not measured yet: absent
        "replicas_needed": 0,
    }
    assert await queue_of(bf.client) == []

    # 2,000 requests due 54 s after creation (60 s less the 10% margin); two replicas take
    # 40 s. Each serves 25/s: at t s in, 2 x (40 - t) / (54 - t) replicas are needed, 1.48 at
    # the start (so 2), 1 from t = 26 on.
    rows = [chat_line(f"r{i}", f"question {i}") for i in range(40 * PER_S)]
    drained = await create(bf, rows, "60s")
    seen = await drain_observed(bf, clock, drained)
    assert seen, "the queue never showed the batch"
    measured = []
    for before, q, after in seen:
        assert q["deadline_margin_fraction"] == MARGIN
        assert q["replicas"] == 2
        # Read just after the counts: never more.
        assert q["queued_requests"] <= q["remaining_requests"]
        # At most the output limits (16 a request) plus the prompt bound.
        assert q["queued_tokens_bound"] >= 16 * q["queued_requests"]
        per_replica = q["requests_per_s_per_replica"]
        if q["queued_requests"] == 0:
            assert q["replicas_needed"] == 0, q  # every line done, the batch finalizing
            continue
        if per_replica is None:
            # Until one replica's rate is measured, the fleet up is kept.
            assert q["replicas_needed"] == 2, q
            continue
        assert 0.7 * PER_S / 2 < per_replica < 1.3 * PER_S / 2, per_replica
        # The figure at the clock's reading just before and just after it was made.
        low = needed(q["queued_requests"], drained, per_replica, before)
        high = needed(q["queued_requests"], drained, per_replica, after)
        assert low <= q["replicas_needed"] <= high, (before, q, after)
        measured.append(q["replicas_needed"])
    runs = [f"{need} x{len(list(run))}" for need, run in itertools.groupby(measured)]
    print(f"\nreplicas needed as it drained, read after read: {', '.join(runs)}")
    assert 2 in measured, measured
    assert 1 in measured, measured

    # Done: nothing listed in the queue, 0 needed on /metrics, the rate per replica kept;
    # the same in the process without a worker.
    for client in (bf.client, api):
        assert await queue_of(client) == []
        done = demand_metrics(await metrics_of(client))
        assert (done["queued_requests"], done["replicas"], done["replicas_needed"]) == (0, 2, 0)
        per_replica = done["replica_requests_per_s"]
        assert per_replica is not None
        assert 0.7 * PER_S / 2 < per_replica < 1.3 * PER_S / 2


async def check_a_queue_standing_still(
    bf: InProcess, api: httpx.AsyncClient, clock: WorkClock, sims: list[Simulator]
) -> None:
    """Every request hangs, 8 in flight (4 a replica), and the clock with them: the process
    with the worker and the one without answer alike, to the request, and as worked out here.
    240 requests are due in 4.5 s (5 s less 10%), which deadline admission (no margin:
    5 s x 50/s = 250) would let in; with the margin they need more than the two replicas."""
    hang = [chat_line(f"h{i}", "[[sim:delay_ms=8000]]") for i in range(240)]
    held = await create(bf, hang, "5s")

    async def all_in_flight() -> int:
        return sum(sim.stats.in_flight for sim in sims)

    await eventually(all_in_flight, lambda n: n == 8, what="8 requests hanging")
    now = clock.now()
    [worker_q] = await queue_of(bf.client)
    [api_q] = await queue_of(api)
    assert clock.now() == now, "the queue moved: the figures below assume it stood still"
    assert worker_q == api_q
    org = await bf.backfill.store.org_by_name("default")
    assert org is not None
    source = await bf.backfill.store.get_file(org.id, held["input_file_id"])
    assert source is not None
    per_replica = worker_q["requests_per_s_per_replica"]
    assert worker_q == {
        "object": "queue.model",
        "model": SIM_MODEL,
        "batches": 1,
        "in_progress": 1,
        "remaining_requests": 240,
        "requests_per_s": worker_q["requests_per_s"],
        "queued_requests": 240,
        # Nothing done: the whole file's prompt bound and 16 output tokens a request.
        "queued_tokens_bound": source.prompt_token_bound + 240 * 16,
        "replicas": 2,
        "requests_per_s_per_replica": per_replica,
        "replicas_needed": needed(240, held, per_replica, now),
        "deadline_margin_fraction": MARGIN,
    }
    # 240 / ((4.5 - 0.16) s x 25/s) = 2.2 replicas at the rate the simulator is set to.
    assert worker_q["replicas_needed"] >= 2
    on_worker = demand_metrics(await metrics_of(bf.client))
    on_api = demand_metrics(await metrics_of(api))
    assert (
        on_worker
        == on_api
        == {
            "queued_requests": 240,
            "replicas": 2,
            "replica_requests_per_s": pytest.approx(per_replica),
            "replicas_needed": worker_q["replicas_needed"],
        }
    )


async def test_backfill_admin_queue_prints_what_the_api_answers(tmp_path: Path) -> None:
    config = tmp_path / "backfill.toml"
    async with (
        running_simulator() as (url, sim),
        in_process_backfill(tmp_path, url, admin_token=ADMIN_TOKEN) as bf,
    ):
        write_sim_config(config, url)
        cli = ["admin", "queue", "--config", str(config), "--data", str(tmp_path / "data")]

        def run(*extra: str) -> str:
            done = CliRunner().invoke(app, [*cli, *extra])
            assert done.exit_code == 0, done.output
            return done.output

        assert "The queue is empty" in await asyncio.to_thread(run)
        # Requests that hang: the queue stands still while both read it, and no rate is
        # measured, so the one replica up is what it needs.
        rows = [chat_line(f"r{i}", "[[sim:delay_ms=5000]]") for i in range(10)]
        await create(bf, rows, "24h")

        async def hanging() -> int:
            return sim.stats.in_flight

        await eventually(hanging, lambda n: n > 0, what="requests in flight")
        [shown] = await queue_of(bf.client)
        assert (shown["queued_requests"], shown["replicas"]) == (10, 1)
        assert (shown["requests_per_s_per_replica"], shown["replicas_needed"]) == (None, 1)
        printed = json.loads(await asyncio.to_thread(run, "--json"))
        assert printed == {"object": "list", "data": [shown], "has_more": False}
        table = await asyncio.to_thread(run)
        assert SIM_MODEL in table
        assert "replicas needed" in table
