"""The lifecycle, alone: a cancel waits for what runs, an expiry abandons it and closes the
rest with ``batch_expired``, a drained batch is finalized."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from backfill.domain.input_format import Limits
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord
from backfill.runner.dispatch import Dispatcher
from backfill.runner.engine_pool import EnginePool
from backfill.runner.finalize import Finalizer
from backfill.runner.lifecycle import Lifecycle
from backfill.runner.request import RequestRunner
from backfill.runner.validating import ValidatingTakeover
from backfill.services.batches import BatchStarter
from backfill.services.files import FileService
from tests.contract.test_runner_request import Kit, NoDeployments, ScriptedEngine, kit, settle
from tests.contract.test_store import make_org

__all__ = ["kit"]  # a fixture


@dataclass
class Parts:
    runner: RequestRunner
    pool: EnginePool
    dispatch: Dispatcher
    lifecycle: Lifecycle

    async def once(self) -> None:
        """One lifecycle pass, and the finalizes it started."""
        await self.lifecycle.once()
        await asyncio.gather(*self.lifecycle.tasks)


async def parts(kit: Kit, engine: ScriptedEngine) -> Parts:
    runner = kit.runner()
    pool = await kit.pool([engine], runner.start)
    dispatch = kit.dispatcher(pool)
    finalizer = Finalizer(kit.store, kit.blobs, kit.keyring, kit.clock, 3600, lease_s=120)
    files = FileService(
        kit.store, kit.blobs, NoDeployments(), kit.clock, Limits(1 << 20, 1000, 1 << 16), 3600
    )
    validating = ValidatingTakeover(
        kit.store,
        BatchStarter(kit.store, files, kit.clock),
        finalizer,
        grace_s=30,
        retry_base_s=0.01,
        retry_max_s=0.1,
        on_started=lambda _batch_id: pool.wake(),
        clock=kit.clock,
    )
    lifecycle = Lifecycle(kit.store, kit.store, finalizer, validating, dispatch, runner, kit.clock)
    return Parts(runner, pool, dispatch, lifecycle)


async def status(kit: Kit, batch: BatchRecord) -> BatchStatus:
    got = await kit.store.get_batch(None, batch.id)
    assert got is not None
    return got.status


async def test_a_cancel_waits_for_the_running_request_then_closes_the_rest(kit: Kit) -> None:
    batch = await kit.batch(await make_org(kit.store), 3)
    engine = ScriptedEngine(batch.model, max_concurrency=1)
    engine.gate = asyncio.Event()
    p = await parts(kit, engine)
    [slot] = p.pool.slots
    assert await p.dispatch.dispatch_once() == 3
    assert await kit.store.transition(
        batch.id, [BatchStatus.IN_PROGRESS], BatchStatus.CANCELLING, int(kit.clock.now())
    )

    await p.once()
    assert slot.backlog == (), "nothing more of a cancelled batch starts"
    assert await status(kit, batch) == BatchStatus.CANCELLING, "it waits for the running one"

    engine.gate.set()
    await settle(p.runner)
    await kit.leases.settle()
    await p.once()
    assert await status(kit, batch) == BatchStatus.CANCELLED
    rows = await kit.rows(batch)
    assert rows[0]["response"]["status_code"] == 200
    assert [rows[i]["error"]["code"] for i in (1, 2)] == ["batch_cancelled"] * 2
    assert engine.sends == 1


async def test_an_expired_batch_abandons_what_runs_and_closes_it_as_batch_expired(
    kit: Kit,
) -> None:
    batch = await kit.batch(await make_org(kit.store), 3)
    engine = ScriptedEngine(batch.model, max_concurrency=2)
    engine.gate = asyncio.Event()
    p = await parts(kit, engine)
    [slot] = p.pool.slots
    assert await p.dispatch.dispatch_once() == 3
    assert (slot.in_flight, len(slot.backlog)) == (2, 1)

    kit.clock.advance(batch.expires_at - kit.clock.now() + 1)
    await p.once()
    assert not p.runner.busy(batch.id)
    assert (slot.in_flight, slot.backlog) == (0, ())
    assert await status(kit, batch) == BatchStatus.EXPIRED
    rows = await kit.rows(batch)
    assert sorted(rows) == [0, 1, 2]
    assert {row["error"]["code"] for row in rows.values()} == {"batch_expired"}
    assert engine.sends == 2


async def test_a_drained_batch_is_finalized_as_completed(kit: Kit) -> None:
    batch = await kit.batch(await make_org(kit.store), 2)
    p = await parts(kit, ScriptedEngine(batch.model))
    assert await p.dispatch.dispatch_once() == 2
    await settle(p.runner)
    assert await status(kit, batch) == BatchStatus.FINALIZING

    await p.once()
    done = await kit.store.get_batch(None, batch.id)
    assert done is not None
    assert done.status == BatchStatus.COMPLETED
    assert (done.completed, done.failed) == (2, 0)
    assert done.output_file_id is not None
