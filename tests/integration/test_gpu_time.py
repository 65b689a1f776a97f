"""Private deployments billed by GPU time, and their isolation (SPEC §7.2, §7.4, §7.5).

Two simulated engines: "catalog" serves the public sim model to every org, "private" serves
only org ``default``'s deployment ``acme-llama`` (2 GPUs at 1000 uUSD per GPU-second). With a
manual clock, GPU time is exactly the clock time during which at least one request of the
deployment was in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from backfill.adapters.clock import ManualClock, SystemClock
from backfill.adapters.db import tables as t
from backfill.container import build
from backfill.domain.catalog import CatalogModel
from backfill.domain.money import (
    MAX_GPU_RECEIPT_MS,
    MAX_GPU_SECOND_PRICE,
    MAX_GPUS,
    gpu_time_charge,
    usd_to_pico,
)
from backfill.domain.records import Ledger
from backfill.ports import Clock
from backfill.runner.gpu_meter import GpuMeter
from backfill.services.tenants import SCOPES
from backfill.settings import DeploymentSettings, EngineSettings
from backfill.simulator.server import Simulator
from tests.support import (
    FAST,
    SIM_MODEL,
    Attempt,
    InProcess,
    chat_line,
    eventually,
    in_flight,
    jsonl,
    recording_simulator,
    sim_settings,
)
from tests.support.in_process import engines_of

DEPLOYMENT = "acme-llama"
DEPLOYMENT_CONFIG = "acme-llama-v1"
GPUS = 2
PRICE = 1000  # uUSD per GPU-second
START = 1_700_000_000.0


def gpu_charge(ms: int) -> int:
    return gpu_time_charge(GPUS, PRICE, ms)


# ---- GpuMeter on its own -------------------------------------------------------------------


def deployment(id_: str = DEPLOYMENT, org_id: str = "org_acme") -> CatalogModel:
    return CatalogModel(
        id=id_,
        model_config_id=f"{id_}-v1",
        context_length=8192,
        max_output_tokens=4096,
        owner_org_id=org_id,
        gpu_count=GPUS,
        microusd_per_gpu_second=PRICE,
    )


def test_one_span_is_charged_by_the_millisecond() -> None:
    clock = ManualClock(START)
    meter = GpuMeter(clock)
    d = deployment()
    meter.begin(d, "org_acme")
    clock.advance(1.5)
    meter.end(d.id)
    clock.advance(7)
    [receipt] = meter.take()
    assert receipt.kind == "gpu_time"
    assert receipt.org_id == "org_acme"
    assert receipt.deployment_id == DEPLOYMENT
    assert receipt.model_config_id == f"{DEPLOYMENT}-v1"
    assert receipt.batch_id is None
    assert receipt.prices is None
    assert receipt.gpu_count == GPUS
    assert receipt.gpu_ms == 1500
    # 2 GPUs x 1000 uUSD/s x 1.5 s = 3000 uUSD = 3e9 pUSD.
    assert receipt.amount == gpu_charge(1500) == 3 * 10**9
    assert receipt.started_at == START
    assert receipt.created_at == START + 8.5
    assert (receipt.input_tokens, receipt.cached_tokens, receipt.output_tokens) == (0, 0, 0)
    assert meter.take() == []


def test_a_span_longer_than_an_hour_becomes_several_receipts_that_fit() -> None:
    clock = ManualClock(START)
    meter = GpuMeter(clock)
    d = replace(deployment(), gpu_count=MAX_GPUS, microusd_per_gpu_second=MAX_GPU_SECOND_PRICE)
    meter.begin(d, "org_acme")
    clock.advance(2.5 * 3600)  # charging held up for hours (a database outage)
    receipts = meter.take()
    assert [r.gpu_ms for r in receipts] == [MAX_GPU_RECEIPT_MS, MAX_GPU_RECEIPT_MS, 1_800_000]
    assert all(r.amount < 2**63 for r in receipts)
    total = sum(r.amount for r in receipts)
    assert total == gpu_time_charge(MAX_GPUS, MAX_GPU_SECOND_PRICE, 9_000_000)


def test_overlapping_requests_are_charged_once_and_idle_time_never() -> None:
    clock = ManualClock(START)
    meter = GpuMeter(clock)
    d = deployment()
    meter.begin(d, "org_acme")  # t=0
    clock.advance(1)
    meter.begin(d, "org_acme")  # t=1, overlaps
    clock.advance(2)
    meter.end(d.id)  # t=3
    clock.advance(1)
    meter.end(d.id)  # t=4: busy 0..4
    clock.advance(10)  # idle
    meter.begin(d, "org_acme")  # t=14
    clock.advance(0.25)
    meter.end(d.id)  # t=14.25
    receipts = meter.take()
    assert sum(r.gpu_ms or 0 for r in receipts) == 4250
    assert sum(r.amount for r in receipts) == gpu_charge(4250)


def test_open_spans_are_charged_up_to_each_take_and_add_up_exactly() -> None:
    clock = ManualClock(START)
    meter = GpuMeter(clock)
    d = deployment()
    meter.begin(d, "org_acme")
    clock.advance(2)
    first = meter.take()
    clock.advance(3)
    second = meter.take()
    clock.advance(0.5)
    meter.end(d.id)
    third = meter.take()
    assert [r.gpu_ms for r in first + second + third] == [2000, 3000, 500]
    assert [r.started_at for r in first + second + third] == [START, START + 2, START + 5]
    assert len({r.request_id for r in first + second + third}) == 3
    assert meter.take() == []


def test_consecutive_spans_add_up_to_the_busy_time() -> None:
    clock = ManualClock(START)
    meter = GpuMeter(clock)
    d = deployment()
    total = 0
    for _ in range(100):
        meter.begin(d, "org_acme")
        clock.advance(0.0123)
        meter.end(d.id)
        total += sum(r.gpu_ms or 0 for r in meter.take())
    # 100 back-to-back spans of 12.3 ms: 1230 ms in all, not 100 x 12 (floored one by one).
    assert abs(total - 1230) <= 1


def test_each_deployment_is_metered_on_its_own() -> None:
    clock = ManualClock(START)
    meter = GpuMeter(clock)
    one, two = deployment("dep-one", "org_a"), deployment("dep-two", "org_b")
    meter.begin(one, "org_a")
    clock.advance(1)
    meter.begin(two, "org_b")
    clock.advance(1)
    meter.end(one.id)
    clock.advance(1)
    meter.end(two.id)
    by_deployment = {r.deployment_id: r for r in meter.take()}
    assert by_deployment["dep-one"].gpu_ms == 2000
    assert by_deployment["dep-one"].org_id == "org_a"
    assert by_deployment["dep-two"].gpu_ms == 2000
    assert by_deployment["dep-two"].org_id == "org_b"


def test_the_meter_says_when_a_span_opens_and_while_it_has_time_to_charge() -> None:
    clock = ManualClock(START)
    meter = GpuMeter(clock)
    opened: list[int] = []
    meter.on_begin = lambda: opened.append(1)
    d = deployment()
    assert not meter.metering
    meter.begin(d, "org_acme")
    meter.begin(d, "org_acme")  # overlaps: the span is open already
    assert len(opened) == 1
    assert meter.metering
    clock.advance(1)
    meter.end(d.id)
    meter.end(d.id)
    assert meter.metering  # closed, its time not charged yet
    meter.take()
    assert not meter.metering
    meter.begin(d, "org_acme")
    assert len(opened) == 2


# ---- a Backfill with a catalog engine and a private one ------------------------------------


@dataclass
class Fleet:
    bf: InProcess
    catalog: Simulator
    private: Simulator
    catalog_seen: list[Attempt]
    private_seen: list[Attempt]

    @property
    def store(self) -> Any:
        return self.bf.backfill.store

    async def org_id(self, name: str = "default") -> str:
        org = await self.store.org_by_name(name)
        assert org is not None
        return str(org.id)

    async def ledger(self, name: str = "default") -> Ledger:
        ledger: Ledger = await self.store.ledger(await self.org_id(name))
        return ledger

    async def flush_gpu_time(self) -> None:
        worker = self.bf.backfill.worker
        assert worker is not None
        await worker.charge_gpu_time()

    async def gpu_receipts(self, name: str = "default") -> list[Any]:
        org_id = await self.org_id(name)
        async with self.store.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(t.receipts).where(
                        t.receipts.c.org_id == org_id, t.receipts.c.kind == "gpu_time"
                    )
                )
            ).all()
        return list(rows)

    async def receipts_of_batch(self, batch_id: str) -> list[Any]:
        async with self.store.engine.connect() as conn:
            rows = (
                await conn.execute(select(t.receipts).where(t.receipts.c.batch_id == batch_id))
            ).all()
        return list(rows)


@asynccontextmanager
async def fleet(
    tmp_path: Path,
    *,
    clock: Clock | None = None,
    credit_usd: str = "1000",
    private_concurrency: int = 4,
    **overrides: Any,
) -> AsyncIterator[Fleet]:
    async with (
        recording_simulator(FAST) as (catalog_url, catalog, catalog_seen),
        recording_simulator(FAST) as (private_url, private, private_seen),
    ):
        settings = sim_settings(
            tmp_path / "data",
            catalog_url,
            deployments=[
                DeploymentSettings(
                    id=DEPLOYMENT,
                    org="default",
                    model_config_id=DEPLOYMENT_CONFIG,
                    gpu_count=GPUS,
                    microusd_per_gpu_second=PRICE,
                    context_length=4096,
                    max_output_tokens=1024,
                )
            ],
            engines=[
                EngineSettings(
                    name="catalog",
                    base_url=catalog_url,
                    models=[SIM_MODEL],
                    max_concurrency=8,
                    request_timeout_s=10.0,
                ),
                EngineSettings(
                    name="private",
                    base_url=private_url,
                    models=[DEPLOYMENT],
                    max_concurrency=private_concurrency,
                    request_timeout_s=10.0,
                ),
            ],
            min_completion_window_s=1,
            # Leases must not lapse when a test moves the manual clock by seconds.
            lease_s=3600.0,
            **overrides,
        )
        clock = clock or ManualClock(START)
        backfill = build(settings, clock=clock, engines=engines_of(settings))
        await backfill.start()
        key = await backfill.services.tenants.bootstrap(credit=usd_to_pico(credit_usd))
        assert key is not None
        # The deployment names org "default", which exists only now.
        await backfill.seed_catalog()
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=backfill.app()),
            base_url="http://backfill.test",
            headers={"Authorization": f"Bearer {key}"},
        )
        try:
            yield Fleet(
                InProcess(backfill, client, key, clock, settings),
                catalog,
                private,
                catalog_seen,
                private_seen,
            )
        finally:
            await client.aclose()
            await backfill.stop()


async def submit(
    bf: InProcess,
    rows: list[dict[str, Any]],
    *,
    key: str | None = None,
    window: str = "24h",
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    uploaded = await bf.client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("input.jsonl", jsonl(rows), "application/jsonl")},
        headers=headers,
    )
    assert uploaded.status_code == 200, uploaded.text
    return await bf.client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": window,
        },
        headers=headers,
    )


async def created(bf: InProcess, rows: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    response = await submit(bf, rows, **kwargs)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def private_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return chat_line(custom_id, content, model=DEPLOYMENT, **body)


# ---- billing ---------------------------------------------------------------------------------


async def test_private_batch_is_billed_by_gpu_time_with_no_token_prices(tmp_path: Path) -> None:
    async with fleet(tmp_path) as f:
        models = (await f.bf.client.get("/v1/models")).json()["data"]
        [listed] = [m for m in models if m["id"] == DEPLOYMENT]
        assert listed["batch"]["billing"] == "gpu_time"
        assert listed["batch"]["pricing"] is None
        assert listed["model_config_id"] == DEPLOYMENT_CONFIG

        batch = await created(f.bf, [private_line(f"p{i}", f"private {i}") for i in range(3)])
        assert batch["billing"] == "gpu_time"
        assert batch["pricing"] is None
        assert batch["model"] == DEPLOYMENT
        assert batch["model_config_id"] == DEPLOYMENT_CONFIG

        done = await f.bf.wait(batch["id"], timeout_s=30)
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert done["billing"] == "gpu_time"
        assert done["pricing"] is None
        # No per-request token charge, and no reservation held.
        assert await f.receipts_of_batch(batch["id"]) == []
        ledger = await f.ledger()
        assert ledger.reserved == 0
        assert ledger.balance == ledger.credits - ledger.charges
        assert sorted(s.model for s in f.private_seen) == [DEPLOYMENT] * 3
        assert f.catalog_seen == []


async def test_gpu_time_is_charged_by_the_worker_within_its_interval_after_an_idle_spell(
    tmp_path: Path,
) -> None:
    # With nothing metered the charging loop sleeps ever longer (up to an hour); a request
    # that starts brings it back to the interval, so its time is charged without a flush.
    async with fleet(tmp_path, clock=SystemClock(), gpu_time_flush_s=0.1) as f:
        await asyncio.sleep(4.0)  # the loop's sleeps have grown past three seconds
        before = await f.ledger()
        batch = await created(f.bf, [private_line("p", "slow [[sim:delay_ms=300]]")])
        assert (await f.bf.wait(batch["id"], timeout_s=30))["status"] == "completed"

        async def charged() -> bool:
            return bool(await f.gpu_receipts())

        await eventually(charged, timeout_s=1.0, what="the worker charges the GPU time")
        receipts = await f.gpu_receipts()
        assert sum(r.gpu_ms for r in receipts) >= 300
        assert (await f.ledger()).charges - before.charges == sum(r.amount for r in receipts)


async def test_overlapping_batches_are_charged_once_for_the_union_of_busy_time(
    tmp_path: Path,
) -> None:
    clock = ManualClock(START)
    async with fleet(tmp_path, clock=clock) as f:
        before = await f.ledger()
        # A is busy from t=0; B from t=2; A ends by t=5 while B runs; B ends at t=9.
        a = await created(f.bf, [private_line("a", "first [[sim:delay_ms=1500]]")])
        await eventually(in_flight(f.private), lambda n: n == 1, what="A is in flight")
        clock.advance(2)
        # B holds its slot far longer than A in real time (the charge follows the manual
        # clock), within the engine's 10 s timeout: A's batch must end while B runs, and a
        # busy machine took 4.4 s from B's start until A's batch was seen completed.
        b = await created(f.bf, [private_line("b", "second [[sim:delay_ms=8000]]")])
        await eventually(in_flight(f.private), lambda n: n == 2, what="A and B are in flight")
        clock.advance(3)
        assert (await f.bf.wait(a["id"], timeout_s=30))["status"] == "completed"
        assert f.private.stats.in_flight == 1, "B must still be running when A ends"
        clock.advance(4)
        assert (await f.bf.wait(b["id"], timeout_s=30))["status"] == "completed"
        clock.advance(100)  # idle: never charged
        await f.flush_gpu_time()

        receipts = await f.gpu_receipts()
        assert receipts
        for r in receipts:
            assert r.deployment_id == DEPLOYMENT
            assert r.gpu_count == GPUS
            assert r.amount == gpu_charge(r.gpu_ms)
            assert r.batch_id is None
        # The union 0..9 s, not A's 5 s + B's 7 s.
        assert sum(r.gpu_ms for r in receipts) == 9000
        after = await f.ledger()
        assert before.balance - after.balance == gpu_charge(9000)
        assert after.balance == after.credits - after.charges


async def test_gpu_time_before_cancel_is_charged(tmp_path: Path) -> None:
    clock = ManualClock(START)
    async with fleet(tmp_path, clock=clock, private_concurrency=1) as f:
        rows = [private_line(f"c{i}", f"cancel me {i} [[sim:delay_ms=800]]") for i in range(3)]
        batch = await created(f.bf, rows)
        await eventually(
            in_flight(f.private), lambda n: n == 1, what="the first request is in flight"
        )
        clock.advance(3)
        cancelled = await f.bf.client.post(f"/v1/batches/{batch['id']}/cancel", json={})
        assert cancelled.status_code == 200, cancelled.text
        done = await f.bf.wait(batch["id"], timeout_s=30)
        assert done["status"] == "cancelled"
        assert done["request_counts"]["total"] == 3
        await f.flush_gpu_time()
        assert sum(r.gpu_ms for r in await f.gpu_receipts()) == 3000
        assert f.private.stats.requests == 1, "no request starts after cancel"


async def test_dispatch_pauses_at_zero_balance_and_resumes_after_credit(tmp_path: Path) -> None:
    clock = ManualClock(START)
    # 0.01 USD buys 5 s of the 2-GPU deployment (0.002 USD per second).
    async with fleet(tmp_path, clock=clock, credit_usd="0.01", private_concurrency=1) as f:
        rows = [private_line(f"z{i}", f"pay me {i} [[sim:delay_ms=1000]]") for i in range(3)]
        batch = await created(f.bf, rows)
        await eventually(
            in_flight(f.private), lambda n: n == 1, what="the first request is in flight"
        )
        clock.advance(6)
        await f.flush_gpu_time()
        ledger = await f.ledger()
        assert ledger.balance == usd_to_pico("0.01") - gpu_charge(6000) < 0

        async def first_done() -> bool:
            counts = (await f.bf.batch(batch["id"]))["request_counts"]
            return bool(counts["completed"] >= 1)

        await eventually(first_done, what="the running request finishes")
        await asyncio.sleep(1.0)  # many dispatch rounds
        paused = await f.bf.batch(batch["id"])
        assert paused["status"] == "in_progress"
        assert paused["request_counts"]["completed"] == 1
        assert f.private.stats.requests == 1, "a request started while the balance was <= 0"

        # Acceptance of private work needs a positive balance.
        refused = await submit(f.bf, [private_line("late", "late")])
        assert refused.status_code == 402, refused.text
        assert refused.json()["error"]["code"] == "insufficient_credit"

        await f.bf.backfill.services.billing.add_credit("default", "1")
        done = await f.bf.wait(batch["id"], timeout_s=30)
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert f.private.stats.requests == 3
        await f.flush_gpu_time()
        # The clock stood still after t=6: the resumed requests took no GPU time.
        assert sum(r.gpu_ms for r in await f.gpu_receipts()) == 6000
        final = await f.ledger()
        assert final.balance == final.credits - final.charges


# ---- isolation (SPEC §7.5) -----------------------------------------------------------------


async def test_private_engine_serves_only_its_org_and_catalog_engine_serves_all(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, clock=ManualClock(START)) as f:
        tenants = f.bf.backfill.services.tenants
        await tenants.create_org("other")
        other_key = await tenants.create_key("other", SCOPES)
        await f.bf.backfill.services.billing.add_credit("other", "10")
        other_headers = {"Authorization": f"Bearer {other_key}"}

        # The deployment is invisible to the other org: not listed, not usable.
        models = (await f.bf.client.get("/v1/models", headers=other_headers)).json()["data"]
        assert DEPLOYMENT not in {m["id"] for m in models}
        assert SIM_MODEL in {m["id"] for m in models}
        upload = await f.bf.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("x.jsonl", jsonl([private_line("x", "steal")]), "application/jsonl")},
            headers=other_headers,
        )
        assert upload.status_code == 400, upload.text
        assert upload.json()["error"]["code"] == "model_not_found"

        slow = " [[sim:delay_ms=50]]"
        private = await created(
            f.bf, [private_line(f"dp{i}", f"default private {i}{slow}") for i in range(4)]
        )
        mine = await created(
            f.bf, [chat_line(f"dc{i}", f"default catalog {i}{slow}") for i in range(3)]
        )
        theirs = [
            await created(
                f.bf,
                [chat_line(f"oc{j}-{i}", f"other catalog {j} {i}{slow}") for i in range(3)],
                key=other_key,
            )
            for j in range(2)
        ]
        assert private["billing"] == "gpu_time"
        assert mine["billing"] == theirs[0]["billing"] == "catalog"

        for batch_id in (private["id"], mine["id"]):
            assert (await f.bf.wait(batch_id, timeout_s=30))["status"] == "completed"
        for batch in theirs:
            done = await f.bf.wait(batch["id"], timeout_s=30, key=other_key)
            assert done["status"] == "completed"
            # Another org's batch is not found.
            assert (await f.bf.client.get(f"/v1/batches/{batch['id']}")).status_code == 404

        assert dict(f.private.stats.models) == {DEPLOYMENT: 4}
        assert dict(f.catalog.stats.models) == {SIM_MODEL: 9}
        assert sorted(s.prompt.split(" [[")[0] for s in f.private_seen) == [
            f"default private {i}" for i in range(4)
        ]
        catalog_prompts = [s.prompt for s in f.catalog_seen]
        assert sum(p.startswith("default catalog") for p in catalog_prompts) == 3
        assert sum(p.startswith("other catalog") for p in catalog_prompts) == 6
        assert not any("private" in s.prompt for s in f.catalog_seen)

        # Each org pays for its own work only.
        await f.flush_gpu_time()
        assert await f.gpu_receipts("other") == []
        other = await f.ledger("other")
        assert other.credits == usd_to_pico("10")
        assert other.charges > 0
        assert other.balance == other.credits - other.charges
        assert other.reserved == 0
        other_receipts = [r for b in theirs for r in await f.receipts_of_batch(b["id"])]
        assert len(other_receipts) == 6
        assert {r.org_id for r in other_receipts} == {await f.org_id("other")}
        assert sum(r.amount for r in other_receipts) == other.charges
