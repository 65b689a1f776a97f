"""People's latency budget on a step-bound engine: the step-time line learnt from samples,
and the batch sequences it leaves room for."""

from __future__ import annotations

import math
import random

import pytest

from backfill.domain.scheduling.concurrency import (
    ConcurrencyLimit,
    Mode,
    Pressure,
    SharedTargets,
    Signal,
)
from backfill.domain.scheduling.step_time import StepTimeModel

# vLLM's CPU build with SmolLM2-135M: 15 ms alone, 37 ms with 16 sequences.
BASE, PER_SEQ = 0.015, 0.022 / 16


def test_learns_the_line_from_noisy_samples() -> None:
    model = StepTimeModel()
    rng = random.Random(7)
    for _ in range(500):
        n = rng.uniform(0, 16)
        model.observe(n, (BASE + PER_SEQ * n) * rng.uniform(0.9, 1.1), tokens=20)
    line = model.line
    assert line is not None
    assert line.base_s == pytest.approx(BASE, rel=0.15)
    assert line.per_seq_s == pytest.approx(PER_SEQ, rel=0.15)


def test_no_line_before_the_samples_spread_and_tiny_samples_are_ignored() -> None:
    model = StepTimeModel()
    for _ in range(100):
        model.observe(8, 0.026, tokens=50)
    assert model.line is None  # one level says nothing of the slope
    assert model.room(4, 1.1) is None
    model.observe(0, 1.0, tokens=1)  # a scrape that saw one token
    assert model.line is None


def test_room_keeps_peoples_step_within_the_budget() -> None:
    model = StepTimeModel()
    for n in range(17):
        model.observe(n, BASE + PER_SEQ * n, tokens=30)
    room = model.room(people=3, budget=1.10)
    assert room is not None
    # (1.10 - 1) x step(3) / per_seq
    assert room == pytest.approx(0.1 * (BASE + 3 * PER_SEQ) / PER_SEQ, rel=1e-6)
    people_alone = BASE + 3 * PER_SEQ
    assert BASE + (3 + room) * PER_SEQ == pytest.approx(1.10 * people_alone)


def test_a_flat_engine_sets_no_cap() -> None:
    model = StepTimeModel()
    for n in range(17):
        model.observe(n, 0.010, tokens=30)
    room = model.room(3, 1.1)
    assert room is None or room > 1000


def metrics(running: float, waiting: float, itl_sum: float, itl_count: float) -> Pressure:
    return Pressure(running, waiting, itl_sum_s=itl_sum, itl_count=itl_count)


def test_the_budget_caps_a_shared_engine_learnt_from_its_histogram() -> None:
    limit = ConcurrencyLimit(16, Mode.SHARED, SharedTargets(slots=16, headroom=1))
    total, count, now = 0.0, 0.0, 0.0
    # Batch levels swing between scrapes while 3 people run: the histogram's growth between
    # two scrapes is the step time at their mean running count.
    for i in range(200):
        running = 3 + (i % 10)
        count += 25
        total += 25 * (BASE + PER_SEQ * running)
        now += 0.1
        limit.on_pressure(metrics(running, 0, total, count), own=running - 3, now=now)
    assert limit.signal == Signal.BUDGET
    expected = 0.1 * (BASE + 3 * PER_SEQ) / PER_SEQ
    assert limit.limit == math.floor(expected)
    assert limit.step_room == pytest.approx(expected, rel=0.01)


def test_nobody_on_the_engine_for_a_while_takes_everything() -> None:
    limit = ConcurrencyLimit(16, Mode.SHARED, SharedTargets(slots=16, idle_after_s=5))
    limit.on_pressure(Pressure(running=2, waiting=0), own=0, now=0.0)
    limit.on_pressure(Pressure(running=0, waiting=0), own=0, now=1.0)
    assert limit.limit < 16  # people left a moment ago: headroom kept for their return
    limit.on_pressure(Pressure(running=10, waiting=0), own=10, now=5.5)
    assert limit.limit == 16
    limit.on_pressure(Pressure(running=11, waiting=0), own=10, now=5.6)
    assert limit.limit < 16  # someone came


def test_people_waiting_for_a_slot_get_the_excess_given_back_once() -> None:
    # The excess over the limit, headroom included: the two who wait get slots, and one
    # more is kept free for whoever comes before the next look.
    targets = SharedTargets(slots=16, headroom=1, headroom_sigmas=0, idle_after_s=1)
    limit = ConcurrencyLimit(16, Mode.SHARED, targets)
    limit.on_pressure(Pressure(running=16, waiting=0), own=16, now=0.0)
    limit.on_pressure(Pressure(running=16, waiting=0), own=16, now=2.0)
    assert limit.limit == 16
    full = Pressure(running=16, waiting=2)
    limit.on_pressure(full, own=16, now=2.1)
    assert limit.limit == 13
    assert limit.to_give_back(full, own=16, now=2.1) == 3
    assert limit.to_give_back(full, own=16, now=2.2) == 0  # the engine has not seen them go
    # Later: the three went, and the people they waited for run.
    served = Pressure(running=15, waiting=0)
    limit.on_pressure(served, own=13, now=2.7)
    assert limit.to_give_back(served, own=13, now=2.7) == 0


def test_no_give_back_while_slots_are_free_or_when_turned_off() -> None:
    limit = ConcurrencyLimit(16, Mode.SHARED, SharedTargets(slots=16))
    kv_bound = Pressure(running=12, waiting=3)  # waiting for KV blocks, not a slot
    limit.on_pressure(kv_bound, own=10, now=1.0)
    assert limit.to_give_back(kv_bound, own=10, now=1.0) == 0
    off = ConcurrencyLimit(16, Mode.SHARED, SharedTargets(slots=16, give_back=False))
    full = Pressure(running=16, waiting=3)
    off.on_pressure(full, own=14, now=1.0)
    assert off.to_give_back(full, own=14, now=1.0) == 0
