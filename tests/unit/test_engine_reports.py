"""The engine health writer: one loop stores every report, woken by a change the health watch
marks without waiting for the database; a change is written at once but not sooner than the
gap after the last write, the latest state always; and stopping never cuts a write short."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from backfill.adapters.clock import ManualClock, SystemClock
from backfill.adapters.engines.fake import FakeEngine
from backfill.domain.engine_health import EngineReport, EngineState
from backfill.domain.waiting import LaneWait
from backfill.runner.engine_pool import EnginePool
from backfill.runner.engine_reports import EngineReports, write_delay
from backfill.runner.inputs import Queued
from backfill.runner.loops import Loops
from backfill.runner.slots import EngineSlot
from tests.support import eventually


class SwitchableEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__("vllm-a")
        self.up = True

    async def healthy(self) -> bool:
        return self.up


class Reports:
    """Stands in for the database: keeps the rows; a write may be held at ``gate``."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], EngineReport] = {}
        self.writes = 0
        self.cancelled = 0
        self.writing = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def report_engines(self, reports: Sequence[EngineReport], now: float) -> None:
        self.writing.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.rows.update({(r.worker, r.engine): r for r in reports})
        self.writes += 1
        self.writing.clear()

    async def engine_reports(self, now: float) -> list[EngineReport]:
        return list(self.rows.values())

    async def forget_engines(self, worker: str, engine: str | None = None) -> None:
        self.rows = {k: r for k, r in self.rows.items() if r.worker != worker}

    async def running_batches_by_model(self) -> dict[str, int]:
        return {}

    async def lane_waits(self) -> dict[tuple[str, str], LaneWait]:
        return {}


def no_start(_slot: EngineSlot, _queued: Queued) -> None:
    raise AssertionError("no request runs in these tests")


class Writer:
    """A pool with one engine, its health watch, and the writer loop as the worker runs them."""

    def __init__(self, *, heartbeat_s: float = 3600.0, min_gap_s: float = 0.0) -> None:
        self.engine = SwitchableEngine()
        self.store = Reports()
        self.clock = ManualClock(1_000_000.0)
        self.pool = EnginePool([self.engine], no_start, clock=SystemClock())
        self.reports = EngineReports(
            self.store,
            self.pool,
            "w1",
            self.clock,
            ttl_s=60.0,
            heartbeat_s=heartbeat_s,
            min_gap_s=min_gap_s,
        )
        self.pool.on_health_change = self.reports.changed
        self.loops = Loops()

    def start(self, *, watch: bool = True) -> None:
        if watch:
            self.pool.start()
        self.loops.repeat("engine-reports", lambda: self.reports.step(self.loops.stopping))

    async def stored(self, state: EngineState) -> EngineReport:
        async def row() -> EngineReport | None:
            return self.store.rows.get(("w1", "vllm-a"))

        found = await eventually(row, lambda r: r is not None and r.state == state)
        assert found is not None
        return found

    async def stop(self) -> None:
        self.loops.stopping.set()
        await asyncio.gather(*self.loops.tasks)
        await self.pool.stop()


async def test_a_health_change_wakes_the_writer_long_before_its_heartbeat() -> None:
    writer = Writer(heartbeat_s=3600.0)
    writer.start()
    try:
        up = await writer.stored(EngineState.UP)
        assert (up.url, up.models, up.last_error) == (None, ("fake-model",), None)
        writer.engine.up = False
        writer.pool.recheck()
        down = await writer.stored(EngineState.DOWN)
        assert down.last_error == "its health check failed"
    finally:
        await writer.stop()


async def test_a_blocked_write_holds_up_neither_the_checks_nor_is_cut_short_by_stop() -> None:
    writer = Writer()
    writer.store.gate = gate = asyncio.Event()
    writer.start()
    [slot] = writer.pool.slots
    await asyncio.wait_for(writer.store.writing.wait(), 30)

    # The database hangs; the watch goes on checking and finds the engine down.
    writer.engine.up = False
    writer.pool.recheck()

    async def state() -> EngineState | None:
        return slot.health.state

    await eventually(state, lambda s: s == EngineState.DOWN)

    # Stopping waits for the statement under way: the watch stops, the writer does not.
    writer.loops.stopping.set()
    await writer.pool.stop()
    done, _ = await asyncio.wait(writer.loops.tasks, timeout=0.2)
    assert not done, "the writer ends only once its write is over"
    gate.set()
    await asyncio.gather(*writer.loops.tasks)
    assert (writer.store.writes, writer.store.cancelled) == (1, 0)


async def test_the_latest_state_is_written_once_a_hung_write_returns() -> None:
    writer = Writer()
    writer.store.gate = gate = asyncio.Event()
    writer.start()
    try:
        await asyncio.wait_for(writer.store.writing.wait(), 30)
        writer.engine.up = False
        writer.pool.recheck()
        [slot] = writer.pool.slots

        async def state() -> EngineState | None:
            return slot.health.state

        await eventually(state, lambda s: s == EngineState.DOWN)
        gate.set()
        await writer.stored(EngineState.DOWN)
    finally:
        await writer.stop()


async def test_a_flapping_engine_is_written_once_per_gap() -> None:
    """The health watch is driven by hand here: each check flips the engine."""
    writer = Writer(min_gap_s=3600.0)
    writer.start(watch=False)
    [slot] = writer.pool.slots
    try:
        await slot.check()
        writer.reports.changed()
        await writer.stored(EngineState.UP)
        for _ in range(20):
            writer.engine.up = not writer.engine.up
            await slot.check()
            writer.reports.changed()
            await asyncio.sleep(0)
        assert writer.store.writes == 1, "the rest waits for the gap"
    finally:
        await writer.stop()
    assert writer.store.writes == 1, "stopping writes nothing more (the rows are withdrawn)"


async def test_a_flapping_engines_latest_state_is_written_after_the_gap() -> None:
    writer = Writer(min_gap_s=0.05)
    writer.start(watch=False)
    [slot] = writer.pool.slots
    try:
        for _ in range(5):
            writer.engine.up = not writer.engine.up
            await slot.check()
            writer.reports.changed()
        assert slot.health.state == EngineState.DOWN
        await writer.stored(EngineState.DOWN)
    finally:
        await writer.stop()


async def test_the_heartbeat_rewrites_the_rows_without_a_change() -> None:
    """Even with a longer gap: the rows must be rewritten before their ``until``."""
    writer = Writer(heartbeat_s=0.01, min_gap_s=3600.0)
    writer.start(watch=False)
    [slot] = writer.pool.slots
    await slot.check()
    try:

        async def writes() -> int:
            # A heartbeat's time passes at each look: the manual clock drives the writer.
            writer.clock.advance(0.01)  # a heartbeat at each look
            return writer.store.writes

        await eventually(writes, lambda n: n >= 3)
    finally:
        await writer.stop()


async def test_a_failed_write_is_logged_once_and_the_writer_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Down(Reports):
        async def report_engines(self, reports: Sequence[EngineReport], now: float) -> None:
            self.writes += 1
            raise OSError("database is locked")

    writer = Writer(heartbeat_s=0.01)
    writer.store = Down()
    writer.reports = EngineReports(
        writer.store, writer.pool, "w1", writer.clock, ttl_s=60.0, heartbeat_s=0.01
    )
    writer.start(watch=False)
    try:

        async def writes() -> int:
            writer.clock.advance(0.01)  # a heartbeat at each look
            return writer.store.writes

        await eventually(writes, lambda n: n >= 3)
    finally:
        await writer.stop()
    warnings = [r for r in caplog.records if "could not store engine health" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    ("now", "dirty", "last_write", "expected"),
    [
        (100.0, True, None, 0.0),  # the first change: at once
        (100.0, True, 99.0, 1.0),  # a change within the gap: at its end
        (100.0, True, 90.0, 0.0),  # a change after the gap: at once
        (100.0, False, 99.0, 20.0),  # no change: at the heartbeat
        (100.0, False, None, 20.0),
        (125.0, False, 99.0, 0.0),  # the heartbeat passed
        (100.0, False, 99.5, 20.0),
    ],
)
def test_when_the_next_write_is_due(
    now: float, dirty: bool, last_write: float | None, expected: float
) -> None:
    delay = write_delay(now, dirty=dirty, last_write=last_write, heartbeat_at=120.0, min_gap_s=2.0)
    assert delay == expected
