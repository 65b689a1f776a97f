"""Engine slots own their accounting: the in-flight count and the backlog change only through
``offer``, ``done``, ``drop`` and ``check``, and never leave their bounds."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.adapters.blobs.crypto import Keyring
from backfill.adapters.blobs.encrypted import EncryptedBlobStore
from backfill.adapters.blobs.raw import MemoryRawStore
from backfill.adapters.clock import ManualClock, SystemClock
from backfill.adapters.engines.fake import FakeEngine
from backfill.domain.catalog import Billing
from backfill.domain.engine_health import START_GRACE_S, EngineState
from backfill.domain.records import Claim, ClaimedItem, WorkBatch
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode, Pressure, SharedTargets
from backfill.runner.engine_pool import EnginePool
from backfill.runner.inputs import ClaimInput, Queued
from backfill.runner.slots import EngineSlot

BLOBS = EncryptedBlobStore(MemoryRawStore(), Keyring(os.urandom(32)))


class SwitchableEngine(FakeEngine):
    def __init__(self, max_concurrency: int = 4) -> None:
        super().__init__()
        self.max_concurrency = max_concurrency
        self.up = True

    async def healthy(self) -> bool:
        return self.up


class Recorder:
    """Stands in for the request runner: notes what each slot starts, and the wake-ups."""

    def __init__(self) -> None:
        self.started: list[Queued] = []
        self.wakes = 0

    def start(self, _slot: EngineSlot, queued: Queued) -> None:
        self.started.append(queued)

    def wake(self) -> None:
        self.wakes += 1


def work(batch_id: str, count: int, org_id: str = "org_a") -> list[Queued]:
    batch = WorkBatch(batch_id, org_id, "m", "/v1/chat/completions", "file-x", Billing.CATALOG, 0)
    items = [ClaimedItem(batch_id, i, i * 10, 10, f"req-{i}") for i in range(count)]
    read = ClaimInput(BLOBS, Claim(batch, 0, items))
    return [Queued(batch, item, read) for item in items]


async def healthy_slot(max_concurrency: int = 4) -> tuple[EngineSlot, Recorder]:
    recorder = Recorder()
    slot = EngineSlot(
        SwitchableEngine(max_concurrency), recorder.start, recorder.wake, clock=SystemClock()
    )
    assert await slot.check()
    recorder.wakes = 0
    return slot, recorder


async def test_offer_starts_as_many_as_are_free_and_keeps_the_rest() -> None:
    slot, recorder = await healthy_slot(4)
    queued = work("batch_a", 6)
    slot.offer(queued)
    assert recorder.started == queued[:4]
    assert slot.in_flight == 4
    assert slot.free == 0
    assert slot.backlog == tuple(queued[4:])


async def test_done_hands_the_slot_to_the_next_queued_request_at_once() -> None:
    slot, recorder = await healthy_slot(2)
    queued = work("batch_a", 3)
    slot.offer(queued)
    slot.done()
    assert recorder.started == queued
    assert slot.in_flight == 2
    assert slot.backlog == ()
    assert recorder.wakes == 1, "the dispatcher hears that capacity freed up"
    slot.done()
    slot.done()
    assert slot.in_flight == 0


async def test_done_without_a_started_request_is_refused() -> None:
    slot, _ = await healthy_slot()
    with pytest.raises(RuntimeError):
        slot.done()
    assert slot.in_flight == 0


async def test_wanted_counts_free_slots_plus_prefetch_less_the_backlog() -> None:
    slot, _ = await healthy_slot(8)
    assert slot.prefetch == 2
    assert slot.claim_threshold == 2
    assert slot.wanted == 10
    slot.offer(work("batch_a", 9))
    assert (slot.in_flight, len(slot.backlog)) == (8, 1)
    assert slot.wanted == 1


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 15, 16, 64])
async def test_a_small_engine_claims_two_at_a_time_and_never_waits_for_a_claim(
    limit: int,
) -> None:
    """Each claim takes at least two items, yet whenever a slot frees up with no backlog left
    the slot already wants a claim: a request never waits on a claim the dispatcher held
    back."""
    slot, started = await healthy_slot(limit)
    assert 2 <= slot.claim_threshold <= slot.prefetch
    slot.offer(work("batch_a", slot.wanted))
    for _ in range(3 * limit):
        slot.done()
        if not slot.backlog and slot.in_flight < limit:
            assert slot.wanted >= slot.claim_threshold
        if slot.wanted >= slot.claim_threshold:
            slot.offer(work("batch_a", slot.wanted))
        assert slot.in_flight == limit
    assert len(started.started) == 4 * limit


async def test_an_engine_that_is_down_starts_nothing_until_it_comes_back() -> None:
    engine = SwitchableEngine(2)
    engine.up = False
    recorder = Recorder()
    slot = EngineSlot(engine, recorder.start, recorder.wake, clock=SystemClock())
    assert not await slot.check()
    assert slot.wanted == 0
    queued = work("batch_a", 3)
    slot.offer(queued)
    assert recorder.started == []
    engine.up = True
    assert await slot.check()
    assert recorder.started == queued[:2]
    assert recorder.wakes == 1


async def test_drop_takes_out_only_the_selected_batches_in_order() -> None:
    slot, recorder = await healthy_slot(1)
    a, b = work("batch_a", 3), work("batch_b", 2)
    slot.offer([a[0], b[0], a[1], b[1], a[2]])
    dropped = slot.drop(lambda batch: batch.id == "batch_b")
    assert dropped == b
    assert slot.backlog == (a[1], a[2])
    slot.done()
    slot.done()
    assert recorder.started == a[:3]
    assert slot.drop(lambda _batch: True) == []


def test_pool_wake_is_seen_by_one_wait_until_cleared() -> None:
    async def scenario() -> None:
        pool = EnginePool([], Recorder().start, clock=SystemClock())
        assert not await pool.wait_woken(0.01)
        pool.wake()
        assert await pool.wait_woken(10)
        pool.clear_wake()
        assert not await pool.wait_woken(0.01)

    asyncio.run(scenario())


def of_batch(batch_id: str) -> Callable[[WorkBatch], bool]:
    return lambda batch: batch.id == batch_id


@given(st.lists(st.tuples(st.sampled_from(["offer", "done", "drop"]), st.integers(1, 5))))
def test_in_flight_stays_within_its_bounds(steps: list[tuple[str, int]]) -> None:
    slot, recorder = asyncio.run(healthy_slot(3))
    ended = dropped = offered = 0
    for n, (op, count) in enumerate(steps):
        if op == "offer":
            slot.offer(work(f"batch_{n % 2}", count))
            offered += count
        elif op == "done" and slot.in_flight:
            slot.done()
            ended += 1
        elif op == "drop":
            dropped += len(slot.drop(of_batch(f"batch_{n % 2}")))
        assert 0 <= slot.in_flight <= 3
        assert slot.in_flight == len(recorder.started) - ended
        assert offered == len(recorder.started) + len(slot.backlog) + dropped
        # Nothing waits while a slot is free.
        assert not (slot.free and slot.backlog)


async def test_a_shared_slot_starts_what_its_limit_allows_as_the_engines_load_moves() -> None:
    engine = SwitchableEngine(max_concurrency=8)
    recorder = Recorder()
    limit = ConcurrencyLimit(8, Mode.SHARED, SharedTargets(slots=16, headroom=0, headroom_sigmas=0))
    clock = ManualClock()
    slot = EngineSlot(engine, recorder.start, recorder.wake, limit, clock=clock)
    assert await slot.check()
    # Before any look at the engine, a shared slot starts low.
    slot.offer(work("batch_a", 10))
    assert slot.in_flight == 4
    # 14 interactive requests on a 16-slot engine (4 of its 18 running are Backfill's).
    slot.pressure(Pressure(running=18, waiting=0))
    assert slot.limit == 2
    assert slot.wanted == 0
    for _ in range(4):
        slot.done()
    assert slot.in_flight == 2
    # Live traffic left (and people's mean count, over two seconds, with it): the limit is
    # back at the maximum and the backlog starts at once.
    wakes = recorder.wakes
    clock.advance(3.0)
    slot.pressure(Pressure(running=2, waiting=0))
    assert slot.limit == 8
    assert slot.in_flight == 6 == len(recorder.started) - 4
    assert recorder.wakes > wakes


async def test_an_overloaded_shared_slot_pauses_until_retry_after() -> None:
    engine = SwitchableEngine(max_concurrency=8)
    recorder = Recorder()
    slot = EngineSlot(
        engine, recorder.start, recorder.wake, ConcurrencyLimit(8, Mode.SHARED), clock=SystemClock()
    )
    assert await slot.check()
    slot.overloaded(0.05)
    slot.offer(work("batch_a", 3))
    assert slot.in_flight == 0
    assert slot.wanted == 0
    await asyncio.sleep(0.1)
    assert slot.in_flight == 2  # half of the starting limit of four


async def test_a_pause_moved_later_by_another_overload_still_ends_in_a_start() -> None:
    """A second 429 while the first pause's timer waits moves the pause later; the first timer
    then waits on instead of leaving the backlog stuck until something else wakes the slot."""
    engine = SwitchableEngine(max_concurrency=8)
    recorder = Recorder()
    slot = EngineSlot(
        engine, recorder.start, recorder.wake, ConcurrencyLimit(8, Mode.SHARED), clock=SystemClock()
    )
    assert await slot.check()
    slot.overloaded(0.05)
    slot.overloaded(0.3)
    slot.offer(work("batch_a", 3))
    await asyncio.sleep(0.15)
    assert slot.in_flight == 0  # the first timer fired inside the longer pause
    await asyncio.sleep(0.4)
    assert slot.in_flight == 1  # a quarter of the starting limit of four


async def test_a_dedicated_slot_ignores_pressure_and_overload() -> None:
    engine = SwitchableEngine(max_concurrency=4)
    recorder = Recorder()
    slot = EngineSlot(engine, recorder.start, recorder.wake, clock=SystemClock())
    assert await slot.check()
    slot.pressure(Pressure(running=100, waiting=100))
    slot.overloaded(60.0)
    slot.offer(work("batch_a", 6))
    assert slot.in_flight == 4
    assert slot.limit == 4


class DiagnosedEngine(SwitchableEngine):
    """An engine that says where it is and why its health check failed."""

    url = "http://10.0.0.7:8000/v1"

    def __init__(self) -> None:
        super().__init__()
        self.name = "vllm-a"
        self._models = ("m-1", "m-2")

    @property
    def health_error(self) -> str | None:
        return None if self.up else "cannot connect to 10.0.0.7:8000 (connection refused)"


async def test_an_engine_down_from_the_start_is_logged_with_name_url_and_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, clock = DiagnosedEngine(), ManualClock(1000.0)
    engine.up = False
    recorder = Recorder()
    changes: list[bool] = []
    slot = EngineSlot(
        engine,
        recorder.start,
        recorder.wake,
        clock=clock,
        remind_s=300.0,
        changed=lambda: changes.append(True),
    )
    caplog.set_level(logging.INFO, logger="backfill.runner")
    assert not await slot.check()
    assert changes == [True], "the first check is stored at once"
    assert caplog.records == [], "a starting engine gets a few seconds"
    clock.advance(START_GRACE_S)
    await slot.check()
    [warning] = caplog.records
    assert warning.levelno == logging.WARNING
    assert warning.getMessage() == (
        "engine vllm-a (http://10.0.0.7:8000/v1) is down: cannot connect to 10.0.0.7:8000 "
        "(connection refused); requests for m-1, m-2 wait in the queue until it answers"
    )
    clock.advance(299)
    await slot.check()
    assert len(caplog.records) == 1
    clock.advance(1)
    await slot.check()
    assert "is still down after 310 s" in caplog.records[-1].getMessage()
    engine.up = True
    clock.advance(5)
    assert await slot.check()
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.records[-1].getMessage() == (
        "engine vllm-a (http://10.0.0.7:8000/v1) is up again after 315 s down"
    )
    assert changes == [True, True]
    assert (slot.health.state, slot.health.reason) == (EngineState.UP, None)


async def test_an_engine_without_diagnostics_is_reported_with_a_generic_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = SwitchableEngine()
    engine.up = False
    slot = EngineSlot(engine, Recorder().start, lambda: None, clock=ManualClock(0.0))
    await slot.check()
    assert slot.url is None
    assert slot.health.reason == "its health check failed"


async def test_the_pool_reports_a_round_of_checks_that_changed_something() -> None:
    engines = [SwitchableEngine(), SwitchableEngine()]
    engines[1].up = False
    pool = EnginePool(engines, Recorder().start, clock=SystemClock())
    reported = asyncio.Event()
    pool.on_health_change = reported.set
    pool.start()
    try:
        await asyncio.wait_for(reported.wait(), 5)
        assert [s.health.state for s in pool.slots] == [EngineState.UP, EngineState.DOWN]
        reported.clear()
        engines[1].up = True
        pool.recheck()
        await asyncio.wait_for(reported.wait(), 5)
        assert all(s.healthy for s in pool.slots)
    finally:
        await pool.stop()


async def test_a_flapping_engine_is_not_a_warning_at_every_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Up and down at every check for a reminder interval: one warning and one recovery line;
    the next warning counts the outages that went unlogged."""
    engine, clock = DiagnosedEngine(), ManualClock(1000.0)
    slot = EngineSlot(engine, Recorder().start, lambda: None, clock=clock, remind_s=300.0)
    caplog.set_level(logging.INFO, logger="backfill.runner")
    for _ in range(602):
        await slot.check()
        engine.up = not engine.up
        clock.advance(0.5)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == [
        logging.INFO,  # up
        logging.WARNING,  # down
        logging.INFO,  # up again
        logging.WARNING,  # down, 300 s after the first warning
    ]
    assert lines[-1][1].endswith(
        "wait in the queue until it answers (it also went down and came back 299 times since "
        "the previous warning)"
    )


class CountedEngine(SwitchableEngine):
    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def healthy(self) -> bool:
        self.asked += 1
        return self.up


async def test_an_engine_that_just_answered_a_request_is_up_without_being_asked() -> None:
    engine = CountedEngine()
    slot = EngineSlot(engine, Recorder().start, lambda: None, clock=SystemClock())
    await slot.check_unless_answered()
    assert engine.asked == 1
    assert slot.healthy
    slot.succeeded(0.1, 1)
    engine.up = False  # its answer stands for the watch's interval, whatever /health says
    await slot.check_unless_answered()
    assert engine.asked == 1
    assert slot.healthy
    assert slot.health.checked_at is not None
    await slot.check()  # a failed request still asks at once
    assert engine.asked == 2
    assert not slot.healthy
