"""The planner's maths without a database: measured throughput, projected finishes at fluid
weighted fair share (checked against a step-by-step simulation), urgency and estimates."""

from __future__ import annotations

import dataclasses
import random

import pytest

from backfill.domain.engine_health import EngineReport, EngineState
from backfill.domain.scheduling.planning import (
    MIN_SAMPLE_LINES,
    MIN_SAMPLE_S,
    NOT_URGENT,
    RATE_SMOOTHING,
    LaneLoad,
    ModelRate,
    Plan,
    PlanInputs,
    RunningBatch,
    estimate_changed,
    measure,
    plan,
    project,
    urgent_lanes,
)

NOW = 1_000_000.0


def running(
    id_: str,
    org: str,
    remaining: int,
    *,
    weight: int = 1,
    window: int = 86_400,
    deadline: int | None = None,
    model: str = "m",
    estimate: int | None = None,
) -> RunningBatch:
    expires = deadline if deadline is not None else int(NOW) + window
    return RunningBatch(
        id=id_,
        model=model,
        org_id=org,
        weight=weight,
        remaining=remaining,
        created_at=expires - window,
        expires_at=expires,
        estimate=estimate,
    )


def simulate(batches: list[RunningBatch]) -> dict[str, float]:
    """Lines served one at a time: each to the lane with the least (served / weight) that has
    work, within a lane to its earliest-deadline batch. What fluid fair share approximates."""
    left = {b.id: b.remaining for b in batches}
    lanes: dict[str, list[RunningBatch]] = {}
    for b in sorted(batches, key=lambda b: (b.expires_at, b.id)):
        lanes.setdefault(b.org_id, []).append(b)
    served = dict.fromkeys(lanes, 0)
    weight = {org: lane[0].weight for org, lane in lanes.items()}
    done: dict[str, float] = {}
    count = 0
    while len(done) < len(batches):
        org = min(
            (o for o, lane in lanes.items() if any(left[b.id] for b in lane)),
            key=lambda o: ((served[o] + 1) / weight[o], o),
        )
        batch = next(b for b in lanes[org] if left[b.id])
        left[batch.id] -= 1
        served[org] += 1
        count += 1
        if not left[batch.id]:
            done[batch.id] = count
    return done


def test_one_batch_alone_finishes_after_its_lines() -> None:
    assert project([running("a", "x", 500)], 50.0, NOW) == {"a": NOW + 10}


def test_two_equal_lanes_share_until_the_smaller_runs_dry() -> None:
    finishes = project([running("big", "x", 1000), running("small", "y", 100)], 10.0, NOW)
    # small: 100 of its own + 100 of big's = 200 lines; big: all 1100.
    assert finishes == {"small": NOW + 20, "big": NOW + 110}


def test_a_heavier_lane_finishes_sooner_in_the_ratio_of_weights() -> None:
    finishes = project(
        [running("light", "x", 300, weight=1), running("heavy", "y", 300, weight=3)], 1.0, NOW
    )
    # heavy's 300 lines come with 100 of light's; light then finishes alone.
    assert finishes == {"heavy": NOW + 400, "light": NOW + 600}


def test_earlier_deadlines_of_one_lane_count_ahead_of_later_ones() -> None:
    later = running("later", "x", 100, deadline=int(NOW) + 900)
    sooner = running("sooner", "x", 100, deadline=int(NOW) + 600)
    finishes = project([later, sooner, running("other", "y", 1000)], 1.0, NOW)
    assert finishes["sooner"] == NOW + 200  # its 100 and 100 of the other lane
    assert finishes["later"] == NOW + 400


@pytest.mark.parametrize("seed", range(5))
def test_the_projection_matches_serving_line_by_line(seed: int) -> None:
    rng = random.Random(seed)
    batches = [
        running(
            f"b{i}",
            f"org{rng.randint(0, 4)}",
            rng.randint(1, 400),
            deadline=int(NOW) + rng.randint(100, 10_000),
        )
        for i in range(12)
    ]
    weights = {f"org{k}": rng.randint(1, 5) for k in range(5)}
    batches = [
        RunningBatch(b.id, b.model, b.org_id, weights[b.org_id], b.remaining, 0, b.expires_at, None)
        for b in batches
    ]
    projected = project(batches, 1.0, NOW)
    stepped = simulate(batches)
    for batch in batches:
        # Whole lines against a fluid share: off by at most a line per lane.
        assert abs((projected[batch.id] - NOW) - stepped[batch.id]) <= 5, batch


def test_a_lane_about_to_miss_its_deadline_is_urgent_with_that_deadline() -> None:
    # 10 lines/s. "soon" needs 60 s alone, 120 s at half the model; its window is 100 s.
    soon = running("soon", "y", 600, window=100)
    bulk = running("bulk", "x", 5000, window=3600)
    finishes = project([soon, bulk], 10.0, NOW)
    assert finishes["soon"] == NOW + 120
    assert urgent_lanes([soon, bulk], finishes, 10.0, NOW, 0.1) == (
        {"y": soon.expires_at},
        {soon.id},
    )
    # With room to spare at its fair share it is not urgent; inside the margin it is.
    relaxed = running("soon", "y", 400, window=100)
    assert (
        urgent_lanes([relaxed, bulk], project([relaxed, bulk], 10.0, NOW), 10.0, NOW, 0.1)[0] == {}
    )
    tight = running("soon", "y", 460, window=100)
    finishes = project([tight, bulk], 10.0, NOW)
    assert finishes["soon"] == NOW + 92  # before the deadline, but after deadline - 10%
    assert urgent_lanes([tight, bulk], finishes, 10.0, NOW, 0.1)[0] == {"y": tight.expires_at}


def test_a_batch_that_cannot_finish_even_alone_is_not_made_urgent() -> None:
    hopeless = running("hopeless", "y", 2000, window=100)  # 200 s of work in 100 s
    bulk = running("bulk", "x", 5000, window=3600)
    finishes = project([hopeless, bulk], 10.0, NOW)
    assert urgent_lanes([hopeless, bulk], finishes, 10.0, NOW, 0.1) == ({}, set())


def test_the_rate_counts_only_windows_busy_at_every_look() -> None:
    first = measure(None, "m", 1000, True, NOW)
    assert (first.rps, first.served, first.observed_at) == (None, 1000, NOW)
    measured = measure(first, "m", 1500, True, NOW + 10)
    assert measured.rps == 50
    smoothed = measure(measured, "m", 2500, True, NOW + 20)
    assert smoothed.rps == pytest.approx(50 + RATE_SMOOTHING * (100 - 50))
    # Idle at a look: the window starts again there, and the rate stays as it was.
    idle = measure(smoothed, "m", 2503, False, NOW + 30)
    assert (idle.rps, idle.observed_at, idle.busy) == (smoothed.rps, NOW + 30, False)
    # Idle at the next look too: nothing changed, so nothing is stored.
    assert measure(idle, "m", 2503, False, NOW + 40) is idle
    back = measure(idle, "m", 2503, True, NOW + 3600)
    assert back.rps == smoothed.rps is not None
    # Work ready but nothing served for a whole minute: a real slowdown, measured.
    stalled = measure(back, "m", 2503, True, NOW + 3600 + MIN_SAMPLE_S)
    assert stalled.rps == pytest.approx(smoothed.rps * (1 - RATE_SMOOTHING))


def test_a_window_is_measured_only_once_it_holds_enough() -> None:
    """Claims come in bunches: a look a moment after a claim would measure the bunch."""
    start = measure(None, "m", 0, True, NOW)
    early = measure(start, "m", 40, True, NOW + 0.1)
    assert early == start  # the window grows
    assert measure(early, "m", MIN_SAMPLE_LINES, True, NOW + 4).rps == MIN_SAMPLE_LINES / 4
    slow = measure(start, "m", 3, True, NOW + MIN_SAMPLE_S)
    assert slow.rps == 3 / MIN_SAMPLE_S


def test_the_rate_per_replica_counts_only_windows_with_the_same_replicas_up() -> None:
    start = measure(None, "m", 0, True, NOW, replicas=2)
    assert (start.replicas, start.per_replica) == (2, None)
    # 1,000 lines in 10 s over 2 replicas: 50 a replica.
    first = measure(start, "m", 1000, True, NOW + 10, replicas=2)
    assert (first.rps, first.per_replica, first.replicas) == (100, 50, 2)
    # A third replica joined during the next window: its rate is measured, one replica's is
    # kept as it was, and the next window starts with three.
    grown = measure(first, "m", 2500, True, NOW + 20, replicas=3)
    assert grown.rps == pytest.approx(100 + RATE_SMOOTHING * (150 - 100))
    assert (grown.per_replica, grown.replicas) == (50, 3)
    steady = measure(grown, "m", 4300, True, NOW + 30, replicas=3)
    assert steady.per_replica == pytest.approx(50 + RATE_SMOOTHING * (60 - 50))
    # Idle, then busy again with none up (scaled to zero): both rates are kept.
    idle = measure(steady, "m", 4300, False, NOW + 40, replicas=0)
    back = measure(idle, "m", 4300, True, NOW + 3600, replicas=0)
    assert (back.rps, back.per_replica) == (steady.rps, steady.per_replica)
    # Without replicas known (none reported), nothing is measured per replica.
    unknown = measure(measure(None, "m", 0, True, NOW), "m", 1000, True, NOW + 10)
    assert (unknown.rps, unknown.per_replica) == (100, None)


def engine(
    name: str,
    until: float = NOW + 30,
    state: EngineState = EngineState.UP,
    start_s: float | None = None,
) -> EngineReport:
    return EngineReport(
        worker="w",
        engine=name,
        url=f"http://{name}/v1",
        models=("m",),
        state=state,
        last_error=None,
        since=NOW - 60,
        checked_at=NOW - 1,
        in_flight=0,
        max_concurrency=8,
        concurrency_limit=8,
        mode="dedicated",
        signal="fixed",
        pressure=0.0,
        until=until,
        start_s=start_s,
    )


def test_a_plan_counts_the_replicas_up_from_the_engine_reports() -> None:
    up = engine

    inputs = PlanInputs(
        lanes=[lane_load("x", 1400, 1000)],
        rates=[ModelRate("m", 10.0, NOW - 40, 1000, True, replicas=2)],
        running=[],
        engines=[up("a"), up("b"), up("gone", until=NOW - 1)],
    )
    [rate] = plan(inputs, NOW, 0.1).rates
    assert (rate.rps, rate.per_replica, rate.replicas) == (10.0, 5.0, 2)


def test_estimates_are_rewritten_only_when_they_move() -> None:
    assert estimate_changed(None, 100, NOW)
    assert estimate_changed(100, None, NOW)
    assert not estimate_changed(None, None, NOW)
    far = int(NOW) + 100_000
    assert not estimate_changed(far, far + 500, NOW)  # 1% of 100,000 s is 1,000 s
    assert estimate_changed(far, far + 1500, NOW)
    assert estimate_changed(int(NOW) + 10, int(NOW) + 12, NOW)


def lane_load(org: str, served: int, mark: int, *, ready: bool = True) -> LaneLoad:
    return LaneLoad("m", org, served, mark, ready, NOT_URGENT, 0.0)


def test_a_plan_measures_shares_marks_urgent_lanes_and_estimates() -> None:
    inputs = PlanInputs(
        lanes=[lane_load("x", 1300, 1000), lane_load("y", 100, 0)],
        rates=[ModelRate("m", 10.0, NOW - 40, 1000, True)],
        running=[running("bulk", "x", 5000, window=3600), running("soon", "y", 600, window=100)],
    )
    made = plan(inputs, NOW, 0.1)
    [rate] = made.rates
    assert rate.rps == pytest.approx(10.0)  # 400 lines in 40 s
    assert rate.served == 1400
    shares = {lane.org_id: lane for lane in made.lanes}
    assert shares["x"].share == pytest.approx(0.75)
    assert shares["y"].share == pytest.approx(0.25)
    assert shares["x"].served_mark == 1300
    assert shares["y"].urgent_by == int(NOW) + 100
    assert shares["x"].urgent_by == NOT_URGENT
    assert made.estimates == {"soon": int(NOW) + 120, "bulk": int(NOW) + 560}


def test_a_lanes_batches_are_projected_by_priority_then_deadline() -> None:
    first = running("first", "x", 100, deadline=int(NOW) + 900)
    raised = dataclasses.replace(running("raised", "x", 100, deadline=int(NOW) + 950), priority=5)
    finishes = project([first, raised], 1.0, NOW)
    assert finishes == {"raised": NOW + 100, "first": NOW + 200}
    # Rescued goes before every priority; without rescues, priority order again.
    rescued = dataclasses.replace(first, urgent=True)
    assert project([rescued, raised], 1.0, NOW)["first"] == NOW + 100
    assert project([rescued, raised], 1.0, NOW, rescue=False)["first"] == NOW + 200


def test_a_batch_that_priorities_would_make_late_is_rescued_then_calmed() -> None:
    """10 lines/s, one org. "tight" (600 lines, 100 s window) behind a priority-5 batch of
    1,000 lines would finish at 160 s: late, but it can make it alone, so it is rescued. A plan
    that finds it safe in priority order (the big one nearly done) calms it."""
    lanes = [lane_load("x", 1000, 1000)]
    rates = [ModelRate("m", 10.0, NOW - 40, 1000, True)]
    big = dataclasses.replace(running("big", "x", 1000, window=3600), priority=5)
    tight = running("tight", "x", 600, window=100)
    made = plan(PlanInputs(lanes, rates, running=[big, tight]), NOW, 0.1)
    assert (made.urgent, made.calm) == (frozenset({"tight"}), frozenset())
    assert made.lanes[0].urgent_by == tight.expires_at
    # Rescued, it is projected first: it finishes in time.
    assert made.estimates["tight"] == int(NOW) + 60
    # Stored as rescued, the same plan changes nothing about it.
    again = plan(
        PlanInputs(lanes, rates, running=[big, dataclasses.replace(tight, urgent=True)]), NOW, 0.1
    )
    assert (again.urgent, again.calm) == (frozenset(), frozenset())
    # The big one nearly done: in time in priority order, so no longer rescued.
    calm = plan(
        PlanInputs(
            lanes,
            rates,
            running=[
                dataclasses.replace(big, remaining=10),
                dataclasses.replace(tight, urgent=True),
            ],
        ),
        NOW,
        0.1,
    )
    assert (calm.urgent, calm.calm) == (frozenset(), frozenset({"tight"}))


def test_a_paused_batch_delays_nobody_and_has_no_estimate() -> None:
    lanes = [lane_load("x", 1000, 1000)]
    rates = [ModelRate("m", 10.0, NOW - 40, 1000, True)]
    paused = dataclasses.replace(
        running("paused", "x", 1000, deadline=int(NOW) + 500, estimate=int(NOW) + 100),
        paused=True,
    )
    other = running("other", "x", 100)
    made = plan(PlanInputs(lanes, rates, running=[paused, other]), NOW, 0.1)
    assert made.estimates == {"paused": None, "other": int(NOW) + 10}
    assert made.urgent == frozenset()


def test_a_model_whose_engine_is_on_standby_is_projected_from_its_start() -> None:
    """An engine started on demand serves nothing until it answers: the estimate counts its
    learnt start, and a batch that the start makes late is urgent."""
    inputs = PlanInputs(
        lanes=[lane_load("x", 1000, 1000, ready=False)],
        rates=[ModelRate("m", 10.0, NOW - 40, 1000, False)],
        running=[running("b", "x", 100, window=60)],
        engines=[engine("a", state=EngineState.STANDBY, start_s=45.0)],
    )
    made = plan(inputs, NOW, 0.1)
    assert made.estimates == {"b": int(NOW) + 45 + 10}
    # 100 lines at 10/s need 10 s of the 60 s window, the start 45 s: past the margin (6 s
    # before the deadline), so urgent; without the start it would not be.
    assert made.lanes[0].urgent_by == int(NOW) + 60
    # Once it is up, nothing waits for a start.
    up = plan(dataclasses.replace(inputs, engines=[engine("a", start_s=45.0)]), NOW, 0.1)
    assert (up.estimates, up.lanes) == ({"b": int(NOW) + 10}, [])


def test_no_rate_is_measured_while_the_model_waits_for_a_start() -> None:
    """Work waits but nothing is served until the engine answers: counting that window
    would count the start twice (once in the rate, once as the delay)."""
    waiting = PlanInputs(
        lanes=[lane_load("x", 1000, 1000)],
        rates=[ModelRate("m", 10.0, NOW - 120, 1000, True)],
        running=[running("b", "x", 100)],
        engines=[engine("a", state=EngineState.STARTING, start_s=200.0)],
    )
    [rate] = plan(waiting, NOW, 0.1).rates
    assert (rate.rps, rate.busy) == (10.0, False), "the rate stands; the window ends"


def test_once_a_model_is_idle_its_plans_are_empty() -> None:
    """A worker with nothing to do plans nothing to store (no write every few seconds)."""
    lanes = [lane_load("x", 1300, 1000, ready=False)]
    rates = [ModelRate("m", 10.0, NOW - 40, 1000, True)]
    plans = []
    for look in range(4):
        made = plan(PlanInputs(lanes, rates, running=[]), NOW + 10 * look, 0.1)
        plans.append(made)
        # Store it as apply_plan does.
        rates = made.rates or rates
        stored = {(p.model, p.org_id): p for p in made.lanes}
        lanes = [
            dataclasses.replace(
                lane,
                served_mark=stored[key].served_mark,
                share=stored[key].share,
                urgent_by=stored[key].urgent_by,
            )
            if (key := (lane.model, lane.org_id)) in stored
            else lane
            for lane in lanes
        ]
    # The model just went idle: that is stored once.
    assert plans[0].rates
    assert plans[0].lanes
    assert plans[2:] == [Plan([], [], {})] * 2
    assert rates[0].rps == 10.0  # the last busy rate is kept


def test_a_busy_lane_whose_share_holds_keeps_its_mark() -> None:
    """Alone on its model a lane always has all of the share: only its mark would move, so
    nothing is stored, and the next plan measures from the mark as it stands. Once another
    lane shares the model, every lane's mark moves with the shares."""
    alone = [dataclasses.replace(lane_load("x", 1300, 1000), share=1.0)]
    rates = [ModelRate("m", 10.0, NOW - 10, 1200, True)]
    assert plan(PlanInputs(alone, rates, running=[]), NOW, 0.1).lanes == []
    shared = [*alone, lane_load("y", 100, 0)]
    made = plan(PlanInputs(shared, rates, running=[]), NOW, 0.1)
    assert {(p.org_id, p.served_mark, p.share) for p in made.lanes} == {
        ("x", 1300, 0.75),
        ("y", 100, 0.25),
    }


def test_without_a_rate_nothing_is_urgent_and_estimates_are_unknown() -> None:
    inputs = PlanInputs(
        lanes=[lane_load("x", 0, 0)],
        rates=[],
        running=[running("a", "x", 10, estimate=int(NOW) + 5)],
    )
    made = plan(inputs, NOW, 0.1)
    assert [rate.rps for rate in made.rates] == [None]
    assert made.estimates == {"a": None}
    assert made.lanes == []  # nothing changed on the lane


def test_a_lane_that_stops_being_urgent_rejoins_level_with_the_others() -> None:
    """It ran ahead in virtual time while served first; that is not paid back, or it would
    get nothing until the others caught up, which its projection did not assume."""
    was_urgent = LaneLoad("m", "y", 600, 600, True, int(NOW) + 100, 0.5, vtime=900.0)
    others = [
        LaneLoad("m", "x", 1000, 1000, True, NOT_URGENT, 0.5, vtime=400.0),
        LaneLoad("m", "z", 1000, 1000, True, NOT_URGENT, 0.0, vtime=450.0),
        LaneLoad("m", "idle", 9, 9, False, NOT_URGENT, 0.0, vtime=10.0),
    ]
    inputs = PlanInputs(
        lanes=[was_urgent, *others],
        rates=[ModelRate("m", 10.0, NOW - 100, 2600, True)],
        running=[running("fine", "y", 10, window=3600), running("bulk", "x", 100)],
    )
    made = plan(inputs, NOW, 0.1)
    [cleared] = [lane for lane in made.lanes if lane.org_id == "y"]
    assert (cleared.urgent_by, cleared.forgiven) == (NOT_URGENT, 500.0)
    assert all(lane.forgiven == 0 for lane in made.lanes if lane.org_id != "y")
    # Still urgent, or behind the others: nothing is taken off.
    tight = [running("soon", "y", 600, window=100), running("bulk", "x", 5000)]
    still = dataclasses.replace(inputs, running=tight)
    assert all(lane.forgiven == 0 for lane in plan(still, NOW, 0.1).lanes)
    behind = dataclasses.replace(
        inputs, lanes=[dataclasses.replace(was_urgent, vtime=100.0), *others]
    )
    [level] = [lane for lane in plan(behind, NOW, 0.1).lanes if lane.org_id == "y"]
    assert (level.urgent_by, level.forgiven) == (NOT_URGENT, 0.0)
