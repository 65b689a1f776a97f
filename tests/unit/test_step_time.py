"""People's latency budget on a step-bound engine: the step-time curve learnt from samples,
and the batch sequences it leaves room for."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from backfill.domain.scheduling.concurrency import (
    ConcurrencyLimit,
    Mode,
    Pressure,
    SharedTargets,
    Signal,
)
from backfill.domain.scheduling.step_time import StepCurve, StepTimeModel

# vLLM's CPU build with SmolLM2-135M: 15 ms alone, 37 ms with 16 sequences.
BASE, PER_SEQ = 0.015, 0.022 / 16


def test_learns_the_line_from_noisy_samples() -> None:
    model = StepTimeModel()
    rng = random.Random(7)
    for _ in range(500):
        n = rng.uniform(0, 16)
        model.observe(n, (BASE + PER_SEQ * n) * rng.uniform(0.9, 1.1), tokens=20)
    line = model.curve
    assert line is not None
    assert line.step_s(16) == pytest.approx(BASE + 16 * PER_SEQ, rel=0.05)  # no bend to speak of
    assert line.base_s == pytest.approx(BASE, rel=0.15)
    assert line.per_seq_s == pytest.approx(PER_SEQ, rel=0.15)


def test_no_line_before_the_samples_spread_and_tiny_samples_are_ignored() -> None:
    model = StepTimeModel()
    for _ in range(100):
        model.observe(8, 0.026, tokens=50)
    assert model.curve is None  # one level says nothing of the slope
    assert model.room(4, 1.1) is None
    model.observe(0, 1.0, tokens=1)  # a scrape that saw one token
    assert model.curve is None


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
    # Batch levels climb and fall between scrapes while 3 people run: the histogram's
    # growth between two scrapes is the step time at their mean running count.
    for i in range(200):
        running = 3 + abs(9 - i % 18)
        count += 25
        total += 25 * (BASE + PER_SEQ * running)
        now += 0.1
        limit.on_pressure(metrics(running, 0, total, count), own=running - 3, now=now)
    assert limit.signal == Signal.BUDGET
    expected = 0.1 * (BASE + 3 * PER_SEQ) / PER_SEQ
    assert limit.limit == math.floor(expected)
    assert limit.step_room == pytest.approx(expected, rel=0.01)


def test_the_step_count_reads_the_running_sequences_when_they_jump_between_looks() -> None:
    # Batch levels jump from 12 back to 3 between two looks (a give-back): the mean of the
    # two looks' running gauges says 7.5 for a stretch that ran 3, which reads as a bend.
    def learn(with_steps: bool) -> ConcurrencyLimit:
        limit = ConcurrencyLimit(16, Mode.SHARED, SharedTargets(slots=16, headroom=1))
        total, count, steps, now = 0.0, 0.0, 0.0, 0.0
        for i in range(200):
            running = 3 + i % 10
            steps += 5
            count += 5 * running
            total += 5 * running * (BASE + PER_SEQ * running)
            now += 0.1
            load = Pressure(running, 0, itl_sum_s=total, itl_count=count)
            if with_steps:
                load = replace(load, steps=steps)
            limit.on_pressure(load, own=running - 3, now=now)
        return limit

    counted, guessed = learn(with_steps=True), learn(with_steps=False)
    expected = 0.1 * (BASE + 3 * PER_SEQ) / PER_SEQ
    curve = counted.steps.curve
    assert curve is not None
    assert curve.per_seq2_s == pytest.approx(0, abs=1e-9)
    assert counted.step_room == pytest.approx(expected, rel=0.01)
    assert guessed.step_room is not None
    assert guessed.step_room > 1.5 * expected


def test_looks_that_see_few_tokens_are_joined_until_they_make_a_sample() -> None:
    # One sequence at a time, ten looks a second, 45 ms a step: two tokens a look, too few
    # for a sample alone. Joined, the stretches still teach the step at one sequence.
    limit = ConcurrencyLimit(16, Mode.SHARED, SharedTargets(slots=16, headroom=1))
    total, count, steps, now = 0.0, 0.0, 0.0, 0.0
    for i in range(400):
        running = 1 if i < 200 else 6
        per_look = 2 if running == 1 else 12
        steps += per_look / running
        count += per_look
        total += per_look * (0.040 + 0.005 * running)
        now += 0.1
        load = Pressure(running, 0, itl_sum_s=total, itl_count=count, steps=steps)
        limit.on_pressure(load, own=0, now=now)
    curve = limit.steps.curve
    assert curve is not None
    # Within 2%: the one stretch that spans the jump from one to six sequences is read as
    # six, and the samples at one have aged by then.
    assert curve.step_s(1) == pytest.approx(0.045, rel=0.02)
    assert curve.step_s(6) == pytest.approx(0.070, rel=0.02)


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


# vLLM's CPU build on two cores, one CI run: 35, 38 and 70 ms a step at 1, 4 and 8 sequences
# (near flat while the sequences fit the cores, then steep).
MEASURED = {1: 0.035, 4: 0.038, 8: 0.070}


def test_a_step_that_bends_is_followed_where_a_line_would_be_short() -> None:
    model = StepTimeModel()
    rng = random.Random(3)
    for level, step in MEASURED.items():
        for _ in range(60):
            model.observe(level, step * rng.uniform(0.97, 1.03), tokens=25)
    curve = model.curve
    assert curve is not None
    assert curve.per_seq2_s > 0
    for level, step in MEASURED.items():
        assert curve.step_s(level) == pytest.approx(step, rel=0.08)
    # What the line alone through the same samples says at one sequence.
    xs, ys = list(MEASURED), list(MEASURED.values())
    mx, my = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    assert (my + slope * (1 - mx)) / MEASURED[1] < 0.9


def test_room_is_where_the_curve_reaches_the_budget() -> None:
    model = StepTimeModel()
    for _ in range(30):
        for n in range(13):
            model.observe(n, 0.020 + 0.0005 * n + 0.0002 * n * n, tokens=25)
    curve = model.curve
    assert curve is not None
    assert curve.per_seq2_s == pytest.approx(0.0002, rel=1e-3)
    room = model.room(people=2, budget=1.5)
    assert room is not None
    assert curve.step_s(2 + room) == pytest.approx(1.5 * curve.step_s(2), rel=1e-6)
    # Further up the bend each sequence costs more: less room beside more people.
    few, many = model.room(people=2, budget=1.1), model.room(people=8, budget=1.1)
    assert few is not None
    assert many is not None
    assert many < few


def test_a_bend_needs_three_levels_spread_apart() -> None:
    model = StepTimeModel()
    for _ in range(50):
        model.observe(2, 0.030, tokens=16)
        model.observe(6, 0.050, tokens=16)
    curve = model.curve
    assert curve is not None
    assert curve.per_seq2_s == 0  # two levels: a line
    assert curve.step_s(4) == pytest.approx(0.040)


def test_a_curve_that_would_fall_is_noise() -> None:
    model = StepTimeModel()
    for _ in range(50):
        for n, step in ((1, 0.020), (4, 0.040), (8, 0.045)):  # bends downwards
            model.observe(n, step, tokens=16)
    curve = model.curve
    assert curve is not None
    assert curve.per_seq2_s == 0
    assert curve.per_seq_s > 0
    # A bend upwards whose lowest point lies past zero: flat below it, never falling.
    low = StepTimeModel()
    for _ in range(50):
        for n, step in ((1, 0.035), (4, 0.038), (8, 0.070)):
            low.observe(n, step, tokens=16)
    bent = low.curve
    assert bent is not None
    assert all(bent.step_s(n / 4) <= bent.step_s((n + 1) / 4) + 1e-12 for n in range(40))


def test_an_engine_that_changed_is_followed() -> None:
    model = StepTimeModel()
    for _ in range(100):
        for n in (2, 6, 10):
            model.observe(n, 0.050 + 0.002 * n, tokens=16)  # a neighbour on its cores
    for _ in range(300):
        for n in (2, 6, 10):
            model.observe(n, 0.020 + 0.002 * n, tokens=16)  # the neighbour left
    curve = model.curve
    assert curve is not None
    assert curve.step_s(2) == pytest.approx(0.024, rel=0.02)


def test_a_tiny_bend_reaches_the_budget_where_the_line_does() -> None:
    line = StepCurve(0.027, 0.0015)
    for bend in (1e-19, 1e-21, 1e-30):
        bent = StepCurve(0.027, 0.0015, bend)
        assert bent.reaches(1.5 * bent.step_s(1)) == pytest.approx(
            line.reaches(1.5 * line.step_s(1)), rel=1e-6
        )


def test_a_bend_that_dips_to_nothing_is_read_as_the_line() -> None:
    model = StepTimeModel()
    for _ in range(50):
        for n, step in ((10, 0.030), (20, 0.030), (30, 0.500)):
            model.observe(n, step, tokens=16)
    curve = model.curve
    assert curve is not None
    assert curve.per_seq2_s == 0
    assert curve.base_s > 0


def test_a_count_run_a_while_ago_is_remembered_while_the_engine_sits_at_another() -> None:
    # 1, then 4, then 8 sequences, ten seconds of looks each at two a second (a real vLLM
    # run's steps on two cores, which bend downwards: the line through them is what can be
    # had). Forgetting over time alone kept a line through 4 and 8 that put one sequence's
    # step 75% too high; each count keeps what it knew until it is seen again.
    model = StepTimeModel()
    for n, step in ((1, 0.050), (4, 0.121), (8, 0.166)):
        for _ in range(20):
            model.observe(n, step, tokens=round(n * 0.5 / step))
    curve = model.curve
    assert curve is not None
    # The best line through these three misses one sequence by a fifth even with nothing
    # forgotten (1.21x); forgotten, it missed by 75%.
    for n, step in ((1, 0.050), (4, 0.121), (8, 0.166)):
        assert curve.step_s(n) / step == pytest.approx(1.0, abs=0.25)


def test_a_count_not_seen_again_fades() -> None:
    model = StepTimeModel()
    for _ in range(100):
        for n in (2, 6, 10):
            model.observe(n, 0.050 + 0.002 * n, tokens=16)  # a neighbour on its cores
    for _ in range(1000):
        for n in (3, 7, 11):
            model.observe(n, 0.020 + 0.002 * n, tokens=16)  # gone, and other counts run
    curve = model.curve
    assert curve is not None
    assert curve.step_s(2) == pytest.approx(0.024, rel=0.02)
