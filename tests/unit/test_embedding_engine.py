"""Engines started on demand (the local embedding engine by default): parked until the queue
holds work for their models, stopped again after a long idle spell, and never in the way of
the engines that run all along."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import pytest

from backfill.adapters.blobs.crypto import Keyring
from backfill.adapters.blobs.encrypted import EncryptedBlobStore
from backfill.adapters.blobs.raw import MemoryRawStore
from backfill.adapters.clock import ManualClock
from backfill.adapters.engines.fake import FakeEngine
from backfill.adapters.engines.managed import ManagedProcess, llama_cpp_command
from backfill.container import _engines
from backfill.domain.catalog import Billing
from backfill.domain.records import Claim, ClaimedItem, WorkBatch
from backfill.runner.engine_pool import EnginePool
from backfill.runner.inputs import ClaimInput, Queued
from backfill.runner.on_demand import IDLE_STOP_S, OnDemand
from backfill.settings import (
    LOCAL_EMBEDDING_ENGINE,
    LOCAL_EMBEDDING_MODEL,
    LOCAL_ENGINE,
    Settings,
)

EMBED = "embed-model"
CHAT = "chat-model"
BLOBS = EncryptedBlobStore(MemoryRawStore(), Keyring(os.urandom(32)))


class Switch:
    """Stands in for a managed engine process."""

    def __init__(self) -> None:
        self.running = False
        self.starts = 0
        self.stops = 0

    async def start(self) -> None:
        self.running = True
        self.starts += 1

    async def stop(self) -> None:
        self.running = False
        self.stops += 1


class Queue:
    """Stands in for the work queue: which models have work, and how often it was asked."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.asked: list[list[str]] = []

    async def ready_models(self, models: Sequence[str], now: float) -> set[str]:
        self.asked.append(list(models))
        return self.ready & set(models)


class Engine(FakeEngine):
    """Up whenever its process runs; counts how often it was asked."""

    def __init__(self, name: str, model: str, switch: Switch | None = None) -> None:
        super().__init__(name, (model,))
        self.switch = switch
        self.asked = 0

    async def healthy(self) -> bool:
        self.asked += 1
        return self.switch is None or self.switch.running


class Setup:
    def __init__(self) -> None:
        self.switch = Switch()
        self.queue = Queue()
        self.clock = ManualClock(1000.0)
        self.chat = Engine("chat", CHAT)
        self.embed = Engine("embed", EMBED, self.switch)
        self.started: list[Queued] = []
        self.pool = EnginePool(
            [self.chat, self.embed],
            lambda _slot, queued: self.started.append(queued),
            switches={"embed": self.switch},
            clock=self.clock,
        )
        self.on_demand = OnDemand(self.pool, self.queue, clock=self.clock)
        self.chat_slot, self.slot = self.pool.slots

    async def run_one(self) -> None:
        """A request of the embedding engine starts and ends."""
        self.slot.offer(work(1))
        self.slot.done()


def work(count: int) -> list[Queued]:
    batch = WorkBatch("batch_e", "org_a", EMBED, "/v1/embeddings", "file-x", Billing.CATALOG, 0)
    items = [ClaimedItem("batch_e", i, i * 10, 10, f"req-{i}") for i in range(count)]
    read = ClaimInput(BLOBS, Claim(batch, 0, items))
    return [Queued(batch, item, read) for item in items]


async def test_a_parked_engine_stays_down_without_being_asked_until_work_waits() -> None:
    s = Setup()
    assert s.on_demand.slots == [s.slot]
    assert s.slot.parked
    assert not s.chat_slot.parked
    await s.on_demand.step()
    assert s.switch.starts == 0
    assert s.queue.asked == [[EMBED]]
    assert not await s.slot.check()
    assert s.embed.asked == 0, "a parked engine has no process to ask"
    assert s.slot.wanted == 0, "nothing is claimed for it"


async def test_work_for_another_model_does_not_start_it() -> None:
    s = Setup()
    s.queue.ready = {CHAT}
    await s.on_demand.step()
    assert s.switch.starts == 0


async def test_it_starts_when_work_waits_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    s = Setup()
    s.queue.ready = {EMBED}
    with caplog.at_level(logging.INFO, logger="backfill.runner"):
        await s.on_demand.step()
    assert s.switch.starts == 1
    assert not s.slot.parked
    started = [r.getMessage() for r in caplog.records if "starts on demand" in r.getMessage()]
    assert started == [f"engine embed starts on demand: work waits for {EMBED}"]
    assert await s.slot.check()
    assert s.slot.wanted > 0, "once up, the dispatcher claims for it"
    # Running: the queue is not asked again while the engine is not long idle.
    asked = len(s.queue.asked)
    for _ in range(10):
        s.clock.advance(1.0)
        await s.on_demand.step()
    assert len(s.queue.asked) == asked
    assert s.switch.starts == 1


async def test_it_stops_after_a_long_idle_spell_and_starts_again_for_new_work() -> None:
    s = Setup()
    s.queue.ready = {EMBED}
    await s.on_demand.step()
    assert await s.slot.check()
    await s.run_one()
    s.queue.ready = set()
    await s.on_demand.step()
    s.clock.advance(IDLE_STOP_S - 1)
    await s.on_demand.step()
    assert s.switch.stops == 0
    s.clock.advance(1)
    await s.on_demand.step()
    assert s.switch.stops == 1
    assert s.slot.parked
    assert not s.slot.healthy, "it takes no more work at once"
    assert s.slot.wanted == 0
    s.queue.ready = {EMBED}
    await s.on_demand.step()
    assert s.switch.starts == 2


async def test_requests_between_two_looks_count_as_activity() -> None:
    s = Setup()
    s.queue.ready = {EMBED}
    await s.on_demand.step()
    assert await s.slot.check()
    s.queue.ready = set()
    s.clock.advance(IDLE_STOP_S - 1)
    await s.run_one()  # started and ended between two steps
    s.clock.advance(2)
    await s.on_demand.step()
    assert s.switch.stops == 0
    s.clock.advance(IDLE_STOP_S)
    await s.on_demand.step()
    assert s.switch.stops == 1


async def test_a_busy_engine_is_never_stopped() -> None:
    s = Setup()
    s.queue.ready = {EMBED}
    await s.on_demand.step()
    assert await s.slot.check()
    s.queue.ready = set()
    s.slot.offer(work(1))  # in flight for longer than the idle limit
    for _ in range(3):
        s.clock.advance(IDLE_STOP_S)
        await s.on_demand.step()
    assert s.switch.stops == 0


async def test_an_engine_that_cannot_take_waiting_work_yet_keeps_running() -> None:
    s = Setup()
    s.queue.ready = {EMBED}
    await s.on_demand.step()  # started, but never up (still loading, or crashing)
    s.clock.advance(IDLE_STOP_S)
    await s.on_demand.step()
    assert s.switch.stops == 0


async def test_an_answer_from_a_process_that_is_stopping_does_not_bring_it_back() -> None:
    s = Setup()
    s.queue.ready = {EMBED}
    await s.on_demand.step()
    answer = asyncio.Event()

    async def slow_healthy() -> bool:
        await answer.wait()
        return True

    s.embed.healthy = slow_healthy  # type: ignore[method-assign]
    checking = asyncio.create_task(s.slot.check())
    await asyncio.sleep(0)
    await s.switch.stop()  # stopped while its health is asked
    answer.set()
    assert not await checking
    assert not s.slot.healthy


async def test_the_health_watch_ignores_a_parked_engine_and_sees_a_started_one_soon() -> None:
    """A parked engine does not make the watch ask the others ten times as often (as it does
    while an engine is down), and one just started is looked at without waiting for the
    watch's next round."""
    s = Setup()
    s.pool.start()
    try:
        await asyncio.sleep(1.2)
        assert s.chat.asked == 1, "a parked engine is down on purpose"
        assert s.embed.asked == 0
        s.queue.ready = {EMBED}
        await s.on_demand.step()
        await asyncio.sleep(0.1)
        assert s.slot.healthy
    finally:
        await s.pool.stop()


def test_settings_pick_when_the_local_embedding_engine_runs() -> None:
    def names(mode: str) -> tuple[list[str], list[str], list[str]]:
        built = _engines(Settings(local_embeddings=mode))
        return (
            [e.name for e in built.engines],
            [p.name for p in built.processes],
            sorted(built.on_demand),
        )

    both = [LOCAL_ENGINE, LOCAL_EMBEDDING_ENGINE]
    assert names("auto") == (both, [LOCAL_ENGINE], [LOCAL_EMBEDDING_ENGINE])
    assert names("on") == (both, both, [])
    assert names("off") == ([LOCAL_ENGINE], [LOCAL_ENGINE], [])
    built = _engines(Settings(local_embeddings="auto"))
    (embedding,) = (e for e in built.engines if e.name == LOCAL_EMBEDDING_ENGINE)
    assert embedding.models == (LOCAL_EMBEDDING_MODEL,)


def test_the_embedding_command_pools_one_vector_per_input() -> None:
    command = llama_cpp_command(LOCAL_EMBEDDING_MODEL, n_ctx=2048, parallel=1, embedding=True)
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--embedding"] == "true"
    assert flags["--model_alias"] == LOCAL_EMBEDDING_MODEL
    assert flags["--kv_overrides"] == "llama.pooling_type=int:1"
    assert flags["--n_batch"] == flags["--n_ubatch"] == "2048"
    chat = llama_cpp_command(LOCAL_EMBEDDING_MODEL, n_ctx=2048, parallel=1)
    assert "--embedding" not in chat


async def test_a_managed_process_starts_again_after_a_stop() -> None:
    process = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    assert not process.running
    for _ in range(2):
        await process.start()
        await process.start()  # already running: left alone
        assert process.running
        await asyncio.sleep(0.2)
        child = process._process
        assert child is not None
        assert child.returncode is None
        await process.stop()
        assert not process.running
        assert child.returncode is not None
