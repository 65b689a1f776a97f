"""A shared engine's metrics read again soon after a failed read, then less and less often:
one slow read on a busy machine (a timeout) must not leave the worker blind for seconds while
people wait for slots it would give back; an engine whose metrics stay unreadable is one log
line, not one a read."""

from __future__ import annotations

import logging

import pytest

from backfill.adapters.clock import ManualClock
from backfill.adapters.engines.fake import FakeEngine
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode, Pressure, Signal
from backfill.runner.engine_pool import _PROBE_RETRY_S, EnginePool, Sharing, look_again_in
from tests.support import eventually


class Load:
    """A pressure probe whose first ``failing`` reads fail (None), then a busy engine."""

    absent = False

    def __init__(self, failing: int) -> None:
        self.failing = failing
        self.reads = 0

    async def read(self) -> Pressure | None:
        self.reads += 1
        return None if self.reads <= self.failing else Pressure(running=8.0, waiting=1.0)

    async def close(self) -> None:
        pass


def test_a_failed_read_is_tried_again_at_once_then_less_often_down_to_the_retry() -> None:
    assert look_again_in(0.1, 0) == 0.1
    assert [look_again_in(0.1, n) for n in (1, 2, 3)] == pytest.approx([0.2, 0.4, 0.8])
    assert look_again_in(0.1, 10) == _PROBE_RETRY_S


async def _reads_until_metrics(failing: int, caplog: pytest.LogCaptureFixture) -> list[str]:
    limit = ConcurrencyLimit(8, Mode.SHARED)
    load = Load(failing)
    sharing = Sharing(limits={"vllm-a": limit}, probes={"vllm-a": load}, probe_interval_s=0.001)
    pool = EnginePool([FakeEngine("vllm-a")], lambda *_: None, sharing, clock=ManualClock())
    caplog.set_level(logging.INFO, "backfill.runner")
    pool.start()
    try:
        # Well before the slowest retry: the old fixed 5 s wait after any failure fails this.
        await eventually(
            lambda: _value(limit.signal),
            lambda s: s == Signal.METRICS,
            timeout_s=_PROBE_RETRY_S / 2,
            what="the metrics were followed again",
        )
    finally:
        await pool.stop()
    return [r.getMessage() for r in caplog.records if "its metrics" in r.getMessage()]


async def test_one_failed_read_is_no_news_and_the_next_read_comes_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert await _reads_until_metrics(1, caplog) == []


async def test_metrics_unreadable_for_a_while_are_one_line_and_one_when_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert await _reads_until_metrics(4, caplog) == [
        "engine vllm-a: its metrics could not be read 3 times in a row; its latency is "
        "followed until they can",
        "engine vllm-a: its metrics can be read again",
    ]


async def _value(value: object) -> object:
    return value
