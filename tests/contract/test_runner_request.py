"""Running one request, alone: the request runner with ``FakeEngine`` over a real store.

Also the kit the other runner-part tests build on: a store, sealed input in memory, leases,
a result writer, and the request runner wired to one engine slot.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from backfill.adapters.blobs.crypto import Keyring
from backfill.adapters.blobs.encrypted import EncryptedBlobStore
from backfill.adapters.blobs.raw import MemoryRawStore
from backfill.adapters.clock import ManualClock, SystemClock
from backfill.adapters.db.store import SqlStore
from backfill.adapters.engines.fake import FakeEngine
from backfill.domain.catalog import CatalogModel
from backfill.domain.files import content_key
from backfill.domain.records import BatchRecord, ItemResult, Org
from backfill.metrics import Metrics
from backfill.ports import Engine, EngineReply, EngineTimeout, EngineUnreachable
from backfill.runner.attempts import Attempts, RetryPolicy
from backfill.runner.dispatch import Dispatcher
from backfill.runner.engine_pool import EnginePool, Sharing
from backfill.runner.failures import WorkerFailures
from backfill.runner.gpu_meter import GpuMeter
from backfill.runner.group_commit import ResultWriter
from backfill.runner.inputs import ClaimInput, Queued
from backfill.runner.leases import Leases
from backfill.runner.request import RequestRunner
from backfill.runner.slots import EngineSlot, Start
from backfill.services.result_rows import result_context
from tests.contract.test_store import LEASE, NOW, all_results, make_batch, make_org, take

MAX_ATTEMPTS = 3


class NoDeployments:
    """A catalog without private deployments."""

    async def find(self, name: str, org_id: str | None = None) -> CatalogModel | None:
        return None

    async def all(self, org_id: str | None = None) -> list[CatalogModel]:
        return []


class ScriptedEngine(FakeEngine):
    """Answers each send with the next scripted reply or raises the next scripted error
    (then FakeEngine's 200); ``gate``, when set up, holds every send until it opens."""

    def __init__(self, model: str, max_concurrency: int = 8) -> None:
        super().__init__(models=(model,))
        self.max_concurrency = max_concurrency
        self.script: list[EngineReply | Exception] = []
        self.up = True
        self.sends = 0
        self.gate: asyncio.Event | None = None

    async def send(self, path: str, model: str, body: dict[str, Any]) -> EngineReply:
        self.sends += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.script:
            step = self.script.pop(0)
            if isinstance(step, Exception):
                raise step
            return step
        return await super().send(path, model, body)

    async def healthy(self) -> bool:
        return self.up


class RecordingWriter(ResultWriter):
    def __init__(self, store: SqlStore, metrics: Metrics) -> None:
        super().__init__(store, 0.001, metrics)
        self.put_results: list[ItemResult] = []

    async def put(self, result: ItemResult) -> bool:
        self.put_results.append(result)
        return await super().put(result)


@dataclass
class Kit:
    store: SqlStore
    clock: ManualClock
    keyring: Keyring
    blobs: EncryptedBlobStore
    metrics: Metrics
    leases: Leases
    results: RecordingWriter
    failures: WorkerFailures = field(init=False)

    def __post_init__(self) -> None:
        self.failures = WorkerFailures(
            0.001, 0.002, give_up_after=MAX_ATTEMPTS, clock=SystemClock()
        )

    def runner(self, **media: Any) -> RequestRunner:
        """``media``: the runner's media arguments (fetcher, fetch pool, limits)."""
        return RequestRunner(
            attempts=Attempts(
                RetryPolicy(MAX_ATTEMPTS, 0.001, 0.002), self.clock, self.metrics, random.Random(0)
            ),
            results=self.results,
            leases=self.leases,
            failures=self.failures,
            sealer=self.keyring,
            meter=GpuMeter(self.clock),
            catalog=NoDeployments(),
            clock=self.clock,
            retry_max_s=0.002,
            **media,
        )

    async def pool(
        self, engines: Sequence[Engine], start: Start, sharing: Sharing | None = None
    ) -> EnginePool:
        """A pool of healthy slots that hand each request they start to ``start``."""
        pool = EnginePool(engines, start, sharing, clock=SystemClock())
        for slot in pool.slots:
            assert await slot.check()
        return pool

    def dispatcher(
        self, pool: EnginePool, poll_interval_s: float = 0.05, *, locality: bool = True
    ) -> Dispatcher:
        return Dispatcher(
            self.store,
            self.store,
            self.blobs,
            pool,
            self.leases,
            self.clock,
            poll_interval_s=poll_interval_s,
            gather_s=0.001,
            locality=locality,
        )

    async def batch(
        self,
        org: Org,
        lines: int,
        body: Callable[[int], dict[str, Any]] | None = None,
        line_bytes: int = 100,
        **fields: Any,
    ) -> BatchRecord:
        """A running batch whose sealed input holds ``lines`` requests, of ``body(i)`` when
        given, ``line_bytes`` apart (100 unless told)."""
        batch = await make_batch(self.store, org, lines, line_bytes=line_bytes, **fields)
        writer = await self.blobs.writer(content_key(batch.input_file_id))
        for i in range(lines):
            request = {"custom_id": f"req-{i}", "body": body(i) if body else {"max_tokens": 1}}
            if body is None:
                request |= {"method": "POST", "url": "/v1/chat/completions"}
            line = orjson.dumps(request)
            assert len(line) <= line_bytes
            await writer.write(line.ljust(line_bytes))
        await writer.commit()
        return batch

    async def claim(self, batch: BatchRecord, limit: int) -> list[Queued]:
        claims = await self.store.claim(
            [batch.model], limit, self.leases.token, NOW + LEASE, self.clock.now()
        )
        return [
            Queued(claim.batch, item, ClaimInput(self.blobs, claim))
            for claim in claims
            for item in claim.items
        ]

    async def rows(self, batch: BatchRecord) -> dict[int, dict[str, Any]]:
        """The stored result rows of ``batch``, opened, by item index."""
        rows: dict[int, dict[str, Any]] = {}
        for result in await all_results(self.store, batch.id):
            if result.payload is not None:
                opened = self.keyring.open(result.payload, result_context(batch.id, result.idx))
                rows[result.idx] = orjson.loads(opened)
            elif result.error_code is not None:
                rows[result.idx] = {"error": {"code": result.error_code}}
        return rows


@pytest.fixture
async def kit(store: SqlStore) -> AsyncIterator[Kit]:
    keyring = Keyring(os.urandom(32))
    clock = ManualClock(NOW)
    metrics = Metrics()
    results = RecordingWriter(store, metrics)
    results.start()
    made = Kit(
        store,
        clock,
        keyring,
        EncryptedBlobStore(MemoryRawStore(), keyring),
        metrics,
        Leases(store, clock, LEASE),
        results,
    )
    try:
        yield made
    finally:
        await results.stop()


async def settle(runner: RequestRunner) -> None:
    """Until every request the runner started (and any they handed their slot to) ended."""
    while runner.tasks:
        await asyncio.gather(*runner.tasks, return_exceptions=True)


async def run_one(kit: Kit, engine: ScriptedEngine, batch: BatchRecord) -> EngineSlot:
    runner = kit.runner()
    slot = EngineSlot(engine, runner.start, lambda: None, clock=SystemClock())
    assert await slot.check()
    slot.offer(await kit.claim(batch, 1))
    await settle(runner)
    assert slot.in_flight == 0
    return slot


async def test_a_200_is_stored_with_its_usage_at_the_clock_of_its_end(kit: Kit) -> None:
    batch = await kit.batch(await make_org(kit.store), 1)
    engine = ScriptedEngine(batch.model)
    kit.clock.advance(7)
    await run_one(kit, engine, batch)
    [put] = kit.results.put_results
    assert (put.ok, put.input_tokens, put.output_tokens) == (True, 1, 1)
    assert put.custom_id == "req-0"
    assert put.finished_at == NOW + 7
    row = (await kit.rows(batch))[0]
    assert row["response"]["status_code"] == 200
    assert row["response"]["body"]["model"] == batch.model
    assert row["error"] is None
    assert engine.calls[0][1]["max_tokens"] == 1


async def test_a_200_keeps_the_model_name_the_engine_answered_under(kit: Kit) -> None:
    """The row is the engine's answer: a served name (or a snapshot name) it answers under is
    not rewritten to the batch's model, nor to an alias a line used (docs/api.md)."""
    batch = await kit.batch(await make_org(kit.store), 1)
    engine = ScriptedEngine(batch.model)
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "served-name-2025-01-01",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    engine.script = [EngineReply(status=200, body=orjson.dumps(answer))]
    await run_one(kit, engine, batch)
    row = (await kit.rows(batch))[0]
    assert row["response"]["body"] == answer


async def test_a_transient_5xx_is_retried_until_the_200(kit: Kit) -> None:
    batch = await kit.batch(await make_org(kit.store), 1)
    engine = ScriptedEngine(batch.model)
    engine.script = [EngineReply(503, b'{"error": {"message": "busy"}}')]
    await run_one(kit, engine, batch)
    assert engine.sends == 2
    assert (await kit.rows(batch))[0]["response"]["status_code"] == 200


async def test_a_4xx_is_kept_as_the_engine_answered_without_a_retry(kit: Kit) -> None:
    batch = await kit.batch(await make_org(kit.store), 1)
    engine = ScriptedEngine(batch.model)
    engine.script = [EngineReply(400, b'{"error": {"message": "no such field"}}')]
    await run_one(kit, engine, batch)
    assert engine.sends == 1
    [put] = kit.results.put_results
    assert not put.ok
    row = (await kit.rows(batch))[0]
    assert row["response"]["status_code"] == 400
    assert row["response"]["body"] == {"error": {"message": "no such field"}}


async def test_a_timeout_every_attempt_ends_as_request_timeout(kit: Kit) -> None:
    batch = await kit.batch(await make_org(kit.store), 1)
    engine = ScriptedEngine(batch.model)
    engine.script = [EngineTimeout() for _ in range(MAX_ATTEMPTS)]
    await run_one(kit, engine, batch)
    assert engine.sends == MAX_ATTEMPTS
    row = (await kit.rows(batch))[0]
    assert row["response"] is None
    assert row["error"]["code"] == "request_timeout"


async def test_an_engine_gone_away_gives_the_lease_back_without_a_result(kit: Kit) -> None:
    batch = await kit.batch(await make_org(kit.store), 1)
    engine = ScriptedEngine(batch.model)

    engine.script = [EngineUnreachable()]
    runner = kit.runner()
    slot = EngineSlot(engine, runner.start, lambda: None, clock=SystemClock())
    assert await slot.check()
    engine.up = False
    slot.offer(await kit.claim(batch, 1))
    await settle(runner)
    assert (slot.in_flight, slot.healthy) == (0, False)
    assert kit.results.put_results == []
    assert await kit.store.live_leases(batch.id, NOW) == 0
    [again] = await take(kit.store, batch, 1, "token-b", NOW + LEASE, NOW)
    assert again.idx == 0


async def test_an_input_that_cannot_be_read_ends_as_input_unavailable(kit: Kit) -> None:
    batch = await kit.batch(await make_org(kit.store), 1)
    await kit.blobs.delete(content_key(batch.input_file_id))
    engine = ScriptedEngine(batch.model)
    await run_one(kit, engine, batch)
    assert engine.sends == 0
    assert (await kit.rows(batch))[0]["error"]["code"] == "input_unavailable"


async def test_running_requests_are_known_by_batch_until_they_end(kit: Kit) -> None:
    org = await make_org(kit.store)
    batch = await kit.batch(org, 3)
    engine = ScriptedEngine(batch.model, max_concurrency=2)
    engine.gate = asyncio.Event()
    runner = kit.runner()
    slot = EngineSlot(engine, runner.start, lambda: None, clock=SystemClock())
    assert await slot.check()
    slot.offer(await kit.claim(batch, 3))
    assert runner.busy(batch.id)
    assert runner.held() == {batch.id: {0, 1}}
    engine.gate.set()
    await settle(runner)
    assert not runner.busy(batch.id)
    assert runner.held() == {}
    assert sorted(await kit.rows(batch)) == [0, 1, 2]
