"""Replicas found by name: the pool follows what each lookup says (joins added and checked
before they get work, leavers retired, then removed once what ran there ended), and a
failed lookup changes nothing."""

from __future__ import annotations

import logging

import pytest

from backfill.adapters.clock import SystemClock
from backfill.adapters.engines.fake import FakeEngine
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode
from backfill.ports import DiscoveryFailed
from backfill.runner.discovery import DiscoveredEngine, Replica, ReplicaSet, replica_name
from backfill.runner.engine_pool import EnginePool
from tests.unit.test_runner_engines import Recorder, work

Found = frozenset[tuple[str, int]]


class Finder:
    """Answers each lookup with the next of ``answers`` (a set of addresses, or a failure)."""

    name = "sim.models.svc"

    def __init__(self, *answers: Found | DiscoveryFailed) -> None:
        self.answers = list(answers)

    async def find(self) -> Found:
        answer = self.answers.pop(0)
        if isinstance(answer, DiscoveryFailed):
            raise answer
        return answer


class ClosingEngine(FakeEngine):
    closed = False

    async def close(self) -> None:
        self.closed = True


def build(address: str, port: int) -> Replica:
    engine = ClosingEngine(replica_name("sim", address, port), ("m",))
    return Replica(engine, ConcurrencyLimit(4, Mode.DEDICATED))


def replicas(*answers: Found | DiscoveryFailed) -> tuple[EnginePool, ReplicaSet, Recorder]:
    recorder = Recorder()
    pool = EnginePool([], recorder.start, clock=SystemClock())
    entry = DiscoveredEngine("sim", ("m",), Finder(*answers), 1.0, build)
    return pool, ReplicaSet(pool, entry), recorder


def names(pool: EnginePool, *, retired: bool = False) -> list[str]:
    return [s.engine.name for s in pool.slots if s.retired == retired]


A, B, C = ("10.0.0.1", 8000), ("10.0.0.2", 8000), ("10.0.0.3", 8000)


def test_a_replica_is_named_by_its_entry_and_address() -> None:
    assert replica_name("qwen", "10.1.2.3", 8000) == "qwen@10.1.2.3:8000"
    assert replica_name("qwen", "fd00::5", 8000) == "qwen@[fd00::5]:8000"


async def test_replicas_that_join_are_added_and_get_work_only_once_found_up() -> None:
    pool, found, _ = replicas(frozenset({A, B}))
    await found.look_up()
    assert names(pool) == ["sim@10.0.0.1:8000", "sim@10.0.0.2:8000"]
    slot = pool.slots[0]
    assert slot.wanted == 0, "a replica nobody has checked yet takes no work"
    assert await slot.check()
    assert slot.wanted > 0


async def test_a_replica_that_leaves_is_retired_and_the_others_stay_as_they_were() -> None:
    pool, found, _ = replicas(frozenset({A, B}), frozenset({B, C}))
    await found.look_up()
    b = pool.slots[1]
    await found.look_up()
    assert names(pool) == ["sim@10.0.0.2:8000", "sim@10.0.0.3:8000"]
    assert names(pool, retired=True) == ["sim@10.0.0.1:8000"]
    assert pool.slots[1] is b, "a replica that stays keeps its slot, its limit and its load"


async def test_a_retired_replica_starts_nothing_and_is_removed_once_its_requests_ended() -> None:
    pool, found, recorder = replicas(frozenset({A}), frozenset())
    await found.look_up()
    slot = pool.slots[0]
    await slot.check()
    slot.offer(work("batch_a", 6))
    assert slot.in_flight == 4
    await found.look_up()
    assert slot.retired
    assert slot.wanted == 0
    assert slot.free == 0
    # The dispatcher gives the backlog back; what runs goes on.
    assert len(slot.drop(lambda _batch: True)) == 2
    await pool.reap()
    assert pool.slots == [slot], "requests still run there"
    for _ in range(4):
        slot.done()
    assert len(recorder.started) == 4, "nothing new started on a retired replica"
    await pool.reap()
    assert pool.slots == []
    assert isinstance(slot.engine, ClosingEngine)
    assert slot.engine.closed


async def test_a_failed_lookup_changes_nothing_and_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failure = DiscoveryFailed("looking up A sim.models.svc failed: timed out")
    pool, found, _ = replicas(frozenset({A, B}), failure, failure, frozenset({A, B}))
    await found.look_up()
    with caplog.at_level(logging.INFO, logger="backfill.runner"):
        await found.look_up()
        await found.look_up()
        assert names(pool) == ["sim@10.0.0.1:8000", "sim@10.0.0.2:8000"]
        assert names(pool, retired=True) == []
        await found.look_up()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "timed out" in warnings[0].getMessage()
    assert "2 known replicas stay" in warnings[0].getMessage()
    assert "answers again" in caplog.text


async def test_a_name_with_no_address_left_is_a_fleet_scaled_to_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool, found, _ = replicas(frozenset({A}), frozenset(), frozenset(), frozenset({C}))
    await found.look_up()
    with caplog.at_level(logging.WARNING, logger="backfill.runner"):
        await found.look_up()
        await found.look_up()
    assert names(pool) == []
    assert "no replica serves m" in caplog.text
    assert caplog.text.count("has no address") == 1, "said when it happens, not every lookup"
    await found.look_up()
    assert names(pool) == ["sim@10.0.0.3:8000"]


async def test_a_replica_back_before_its_requests_ended_goes_on_in_the_same_slot() -> None:
    pool, found, _ = replicas(frozenset({A}), frozenset(), frozenset({A}))
    await found.look_up()
    slot = pool.slots[0]
    await slot.check()
    slot.offer(work("batch_a", 2))
    await found.look_up()
    assert slot.retired
    await found.look_up()
    assert pool.slots == [slot]
    assert not slot.retired
    assert slot.wanted > 0, "it takes work again"


async def test_a_changed_entry_never_revives_the_old_settings_slots() -> None:
    """The entry changed (a rotated api_key, another limit): the old set leaves, a new set
    with the new settings looks the name up. A replica still draining under the old settings
    stays retired; the new set serves it from a new slot."""
    pool, old, _ = replicas(frozenset({A}))
    await old.look_up()
    draining = pool.slots[0]
    await draining.check()
    draining.offer(work("batch_a", 2))
    old.leave_all()
    entry = DiscoveredEngine("sim", ("m",), Finder(frozenset({A})), 1.0, build)
    await ReplicaSet(pool, entry).look_up()
    assert draining.retired
    [fresh] = [s for s in pool.slots if not s.retired]
    assert fresh is not draining
    assert fresh.engine.name == draining.engine.name
