"""Dispatch, alone: claims handed to engine slots, GPU-time orgs without credit paused, and a
stopped batch's backlog given back."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from backfill.domain.catalog import Billing, CatalogModel
from backfill.domain.money import usd_to_pico
from backfill.runner.dispatch import Dispatcher
from backfill.runner.engine_pool import EnginePool
from backfill.runner.gpu_meter import GpuCharger, GpuMeter
from backfill.runner.inputs import Queued
from backfill.runner.slots import EngineSlot
from tests.contract.test_runner_request import Kit, ScriptedEngine, kit
from tests.contract.test_store import NOW, make_org
from tests.support import eventually

__all__ = ["kit"]  # a fixture


class Started:
    """Stands in for the request runner: requests it is handed stay in flight."""

    def __init__(self) -> None:
        self.queued: list[Queued] = []
        self.by_slot: dict[str, list[Queued]] = {}

    def __call__(self, slot: EngineSlot, queued: Queued) -> None:
        self.queued.append(queued)
        self.by_slot.setdefault(slot.engine.name, []).append(queued)


async def dispatcher(
    kit: Kit, *engines: ScriptedEngine, poll_interval_s: float = 0.05
) -> tuple[Dispatcher, EnginePool, Started]:
    started = Started()
    pool = await kit.pool(engines, started)
    return kit.dispatcher(pool, poll_interval_s), pool, started


async def test_claims_fill_each_engine_and_its_backlog_across_orgs(kit: Kit) -> None:
    model = "m-shared"
    a, b = await make_org(kit.store), await make_org(kit.store)
    await kit.batch(a, 5, model=model)
    await kit.batch(b, 5, model=model)
    engine = ScriptedEngine(model, max_concurrency=8)
    idle = ScriptedEngine("m-other")
    dispatch, pool, started = await dispatcher(kit, engine, idle)
    busy, spare = pool.slots

    assert await dispatch.dispatch_once() == 10
    assert busy.in_flight == 8 == len(started.queued)
    assert len(busy.backlog) == busy.prefetch == 2
    assert {q.batch.org_id for q in started.queued} == {a.id, b.id}
    assert spare.in_flight == 0
    assert not spare.backlog
    # Full slots and a full backlog want nothing more.
    assert await dispatch.dispatch_once() == 0


async def test_stop_starting_gives_back_only_that_batchs_backlog(kit: Kit) -> None:
    model = "m-shared"
    first = await kit.batch(await make_org(kit.store), 3, model=model)
    second = await kit.batch(await make_org(kit.store), 3, model=model)
    engine = ScriptedEngine(model, max_concurrency=1)
    dispatch, pool, started = await dispatcher(kit, engine)
    [slot] = pool.slots

    # One slot and two of prefetch: lines of both orgs' lanes, the first one started.
    assert await dispatch.dispatch_once() == 3
    [running] = started.queued
    assert {q.batch.id for q in (running, *slot.backlog)} == {first.id, second.id}
    other = second.id if running.batch.id == first.id else first.id

    dispatch.stop_starting(other)
    await kit.leases.settle()
    kept = slot.backlog
    assert all(q.batch.id == running.batch.id for q in kept)
    assert await kit.store.live_leases(other, NOW) == 0
    assert await kit.store.live_leases(running.batch.id, NOW) == 1 + len(kept)
    # What already runs is not the dispatcher's to stop.
    dispatch.stop_starting(running.batch.id)
    assert slot.in_flight == 1


async def test_a_gpu_time_org_out_of_credit_starts_nothing_until_credit_returns(
    kit: Kit,
) -> None:
    org = await make_org(kit.store)
    await kit.store.credit(org.id, usd_to_pico("1"), None, int(NOW))
    batch = await kit.batch(org, 4, billing=Billing.GPU_TIME)
    engine = ScriptedEngine(batch.model, max_concurrency=1)
    dispatch, pool, started = await dispatcher(kit, engine)
    [slot] = pool.slots
    assert await dispatch.dispatch_once() == 3
    assert len(slot.backlog) == 2

    # Ten seconds of a 1 USD/s deployment: the org is 9 USD short.
    meter = GpuMeter(kit.clock)
    deployment = CatalogModel(
        "dep", "dep-v1", 4096, 1024, owner_org_id=org.id, gpu_count=1,
        microusd_per_gpu_second=1_000_000,
    )  # fmt: skip
    meter.begin(deployment, org.id)
    kit.clock.advance(10)
    meter.end(deployment.id)
    await GpuCharger(meter, kit.store, dispatch.pause).charge()
    await kit.leases.settle()
    assert not slot.backlog
    assert await kit.store.live_leases(batch.id, kit.clock.now()) == 1

    slot.done()  # the running request ends: its slot is free, but the org has no credit
    assert await dispatch.dispatch_once() == 0
    assert not slot.backlog
    assert slot.in_flight == 0

    await kit.store.credit(org.id, usd_to_pico("20"), None, int(NOW))
    assert await dispatch.dispatch_once() == 3
    assert slot.in_flight == 1
    assert len(slot.backlog) == 2
    assert len(started.queued) == 2


async def test_a_round_with_nothing_to_claim_waits_for_a_wake_up(kit: Kit) -> None:
    dispatch, pool, _ = await dispatcher(kit, ScriptedEngine("m-none"), poll_interval_s=3600)
    waiting = asyncio.create_task(dispatch.round())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    pool.wake()
    # Without the wake-up the round would wait four poll intervals: four hours.
    await asyncio.wait_for(waiting, 30)


async def test_an_empty_queue_is_asked_less_and_less_often_and_a_wake_asks_at_once(
    kit: Kit,
) -> None:
    """An idle worker's claims back off to ``idle_poll_s`` apart (each is a query taken from an
    engine sharing the cores); work made in this process wakes the pool and is claimed at once."""
    model = "m-later"
    pool = await kit.pool([ScriptedEngine(model, max_concurrency=4)], Started())
    dispatch = Dispatcher(
        kit.store,
        kit.store,
        kit.blobs,
        pool,
        kit.leases,
        kit.clock,
        poll_interval_s=0.005,  # a base of 0.02 s between empty claims
        gather_s=0.001,
        idle_poll_s=60.0,
    )
    claims: list[float] = []
    claim = kit.store.claim

    async def counted(*args: Any, **kwargs: Any) -> Any:
        claims.append(asyncio.get_running_loop().time())
        return await claim(*args, **kwargs)

    kit.store.claim = counted  # type: ignore[method-assign]

    async def rounds() -> None:
        while True:
            await dispatch.round()

    running = asyncio.create_task(rounds())
    try:
        await asyncio.sleep(1.0)
        # At a fixed 0.02 s that would be about fifty claims; doubling, about six.
        assert 3 <= len(claims) <= 10, claims
        await kit.batch(await make_org(kit.store), 3, model=model)
        pool.wake()
        slot = pool.slots[0]

        async def in_flight() -> int:
            return slot.in_flight

        await eventually(in_flight, lambda n: n == 3, timeout_s=10)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


def prompt(i: int) -> dict[str, object]:
    """Six system prompts, each shared by every sixth line."""
    return {"messages": [{"role": "system", "content": f"p{i % 6}"}, {"content": f"q{i}"}]}


async def test_replicas_claim_together_and_each_prefix_goes_to_one_of_them(kit: Kit) -> None:
    model = "m-replicated"
    await kit.batch(await make_org(kit.store), 60, body=prompt, model=model)
    replicas = [ScriptedEngine(model, max_concurrency=20) for _ in range(3)]
    for n, engine in enumerate(replicas):
        engine.name = f"replica-{n}"
    dispatch, pool, started = await dispatcher(kit, *replicas)

    # One claim for the three takes every line; each prompt's ten lines go to one replica.
    assert await dispatch.dispatch_once() == 60
    by_slot = {
        slot.engine.name: [
            q.item.idx % 6 for q in (*started.by_slot.get(slot.engine.name, ()), *slot.backlog)
        ]
        for slot in pool.slots
    }
    assert sorted(p for prompts in by_slot.values() for p in set(prompts)) == list(range(6))
    assert sum(len(prompts) for prompts in by_slot.values()) == 60
    # Lines of one prompt are sent back to back: each replica sees each prompt in one run.
    for prompts in by_slot.values():
        runs = [p for n, p in enumerate(prompts) if n == 0 or prompts[n - 1] != p]
        assert len(runs) == len(set(runs))


async def test_without_locality_each_engine_claims_on_its_own(kit: Kit) -> None:
    model = "m-replicated"
    await kit.batch(await make_org(kit.store), 60, body=prompt, model=model)
    replicas = [ScriptedEngine(model, max_concurrency=10) for _ in range(3)]
    started = Started()
    pool = await kit.pool(replicas, started)
    dispatch = kit.dispatcher(pool, locality=False)
    assert await dispatch.dispatch_once() == 36
    assert all(s.in_flight == 10 for s in pool.slots)
