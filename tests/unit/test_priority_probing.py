"""The engine pool's priority probing: tried once the engine is up, again every
``PRIORITY_RETRY_S`` while it cannot tell (a busy engine), at most ``PRIORITY_TRIES`` times,
never again once known; an engine that ignores priority is one warning that says what to do,
and the engine reports (``backfill admin engine list``) carry what was found."""

from __future__ import annotations

import io
import logging
import operator
from collections.abc import Iterator
from functools import partial
from typing import TypeVar

import pytest
from rich.console import Console

from backfill.adapters.clock import ManualClock
from backfill.adapters.engines.fake import FakeEngine
from backfill.cli.admin import _engines_table
from backfill.domain.engine_health import EngineReport, EngineState, PriorityOutcome
from backfill.domain.scheduling.concurrency import Pressure
from backfill.domain.waiting import LaneWait
from backfill.runner.engine_pool import PRIORITY_RETRY_S, PRIORITY_TRIES, EnginePool, Sharing
from backfill.runner.engine_reports import EngineReports
from tests.support import eventually

T = TypeVar("T")


class Load:
    """A pressure probe: an idle engine, every read counted."""

    absent = False

    def __init__(self) -> None:
        self.reads = 0

    async def read(self) -> Pressure | None:
        self.reads += 1
        return Pressure(0.0, 0.0)

    async def close(self) -> None:
        pass


class Probe:
    """A priority probe answering from a script (None: cannot tell); raises where told."""

    def __init__(self, answers: list[PriorityOutcome | Exception | None]) -> None:
        self._answers: Iterator[PriorityOutcome | Exception | None] = iter(answers)
        self.tries = 0
        self.unknown_reason: str | None = None

    async def check(self) -> PriorityOutcome | None:
        self.tries += 1
        answer = next(self._answers, None)
        if isinstance(answer, Exception):
            raise answer
        self.unknown_reason = "the engine is busy" if answer is None else None
        return answer


def pool_with(probe: Probe, clock: ManualClock) -> tuple[EnginePool, Load]:
    load = Load()
    sharing = Sharing(
        probes={"vllm-a": load}, probe_interval_s=0.001, priority_probes={"vllm-a": probe}
    )
    return EnginePool([FakeEngine("vllm-a")], lambda *_: None, sharing, clock=clock), load


async def test_an_engine_that_ignores_priority_is_one_warning_and_its_report_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    probe = Probe([None, PriorityOutcome.IGNORED])
    pool, load = pool_with(probe, clock)
    moved: list[int] = []
    pool.on_health_change = lambda: moved.append(1)
    caplog.set_level(logging.INFO, "backfill.runner")
    pool.start()
    try:
        await eventually(lambda: _value(probe.tries), lambda n: n == 1)
        # Busy: the load is followed meanwhile, and the next try waits for its time.
        reads = load.reads
        await eventually(lambda: _value(load.reads), lambda n: n > reads + 5)
        assert probe.tries == 1
        clock.advance(PRIORITY_RETRY_S)
        await eventually(
            lambda: _value(pool.priority), lambda p: p == {"vllm-a": PriorityOutcome.IGNORED}
        )
        assert moved  # the report is written soon
        clock.advance(10 * PRIORITY_RETRY_S)
        reads = load.reads
        await eventually(lambda: _value(load.reads), lambda n: n > reads + 5)
        assert probe.tries == 2  # known: never probed again
    finally:
        await pool.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "engine vllm-a ignores the request priority Backfill sends: it served queued requests "
        "in arrival order, so batch requests do not yield to people's; start vLLM with "
        "--scheduling-policy priority, or remove priority from the engine's settings"
    ]
    [report] = EngineReports(_NoStore(), pool, "w1", clock, 30.0, heartbeat_s=5.0).current()
    assert report.priority == "ignored"


async def test_an_engine_that_cannot_be_measured_is_tried_a_few_times_then_left_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    probe = Probe([RuntimeError("boom")])  # a probe that fails counts as a try, nothing more
    pool, load = pool_with(probe, clock)
    caplog.set_level(logging.INFO, "backfill.runner")
    pool.start()
    try:
        for tries in range(1, PRIORITY_TRIES + 1):
            await eventually(lambda: _value(probe.tries), partial(operator.eq, tries))
            clock.advance(PRIORITY_RETRY_S)
        reads = load.reads
        await eventually(lambda: _value(load.reads), lambda n: n > reads + 5)
        assert probe.tries == PRIORITY_TRIES
    finally:
        await pool.stop()
    assert pool.priority == {}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        "could not tell whether engine vllm-a applies" in r.getMessage()
        and "the engine is busy" in r.getMessage()
        for r in caplog.records
    )
    [report] = EngineReports(_NoStore(), pool, "w1", clock, 30.0, heartbeat_s=5.0).current()
    assert report.priority is None


async def test_an_engine_that_applies_priority_is_an_info_line() -> None:
    clock = ManualClock()
    pool, _ = pool_with(Probe([PriorityOutcome.APPLIED]), clock)
    pool.start()
    try:
        await eventually(
            lambda: _value(pool.priority), lambda p: p == {"vllm-a": PriorityOutcome.APPLIED}
        )
    finally:
        await pool.stop()


def test_engine_list_shows_an_engine_that_ignores_priority() -> None:
    def report(engine: str, priority: str | None) -> EngineReport:
        return EngineReport(
            worker="w1", engine=engine, url=None, models=("m",), state=EngineState.UP,
            last_error=None, since=1.0, checked_at=2.0, in_flight=0, max_concurrency=8,
            concurrency_limit=8, mode="shared", signal="metrics", pressure=0.0,
            priority=priority,
        )  # fmt: skip

    table = _engines_table([report("a", "ignored"), report("b", "applied"), report("c", None)])
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    lines = console.export_text().splitlines()
    assert "priority" in next(line for line in lines if "engine" in line)
    assert "IGNORED" in next(line for line in lines if "│ a " in line)
    assert "applied" in next(line for line in lines if "│ b " in line)


class _NoStore:
    async def report_engines(self, reports: object, now: float) -> None:
        pass

    async def engine_reports(self, now: float) -> list[EngineReport]:
        return []

    async def forget_engines(self, worker: str, engine: str | None = None) -> None:
        pass

    async def running_batches_by_model(self) -> dict[str, int]:
        return {}

    async def lane_waits(self) -> dict[tuple[str, str], LaneWait]:
        return {}


async def _value(value: T) -> T:
    return value
