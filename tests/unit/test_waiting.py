"""Why a batch waits, without I/O: what an engine's requests and governor say of it (its hold),
which hold a model's engines show, what the planner finds of a lane (credit, fair share), and
which reason the batch shows when several hold."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from backfill.adapters.clock import ManualClock
from backfill.adapters.engines.fake import FakeEngine
from backfill.domain.catalog import Billing
from backfill.domain.engine_health import (
    HOLD_GRACE_S,
    EngineHold,
    EngineReport,
    EngineState,
    HeldEngines,
    Hold,
    HoldTracker,
    ModelHealth,
    model_health,
)
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.money import gpu_time_charge, usd_to_pico
from backfill.domain.records import BatchRecord
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode, Pressure, SharedTargets
from backfill.domain.scheduling.planning import (
    NOT_URGENT,
    LaneLoad,
    ModelRate,
    PlanInputs,
    RunningBatch,
    plan,
)
from backfill.domain.scheduling.waits import lane_waits
from backfill.domain.waiting import (
    PRECEDENCE,
    AheadInLane,
    LaneWait,
    WaitCode,
    WaitingOn,
    waiting_on,
)
from backfill.runner.inputs import Queued
from backfill.runner.slots import EngineSlot

T0 = 1_000_000.0
UP, DOWN, STARTING = EngineState.UP, EngineState.DOWN, EngineState.STARTING


# ---- an engine's hold, as its requests and its governor find it ---------------------------------


def test_a_rate_limit_begins_at_the_first_429_keeps_its_since_and_ends_at_a_success() -> None:
    holds = HoldTracker()
    assert holds.current(T0) is None
    assert holds.overloaded(429, T0, T0 + 2) is True
    assert holds.overloaded(429, T0 + 1, T0 + 5) is False, "the same limit goes on"
    assert holds.current(T0 + 1) == EngineHold(Hold.RATE_LIMITED, T0, T0 + 5, 429)
    assert holds.succeeded() is True
    assert holds.current(T0 + 1) is None
    assert holds.succeeded() is False


def test_a_rate_limit_nobody_retries_any_more_is_forgotten_after_a_grace() -> None:
    holds = HoldTracker()
    holds.overloaded(503, T0, T0 + 1)
    assert holds.current(T0 + 1 + HOLD_GRACE_S) is not None
    assert holds.current(T0 + 1 + HOLD_GRACE_S + 0.1) is None


def test_peoples_hold_lasts_while_the_limit_is_zero_and_a_rate_limit_goes_first() -> None:
    holds = HoldTracker()
    assert holds.people(True, T0) is True
    assert holds.people(True, T0 + 3) is False, "still held: since stays"
    assert holds.current(T0 + 3) == EngineHold(Hold.INTERACTIVE_LOAD, T0)
    holds.overloaded(429, T0 + 4, T0 + 6)
    assert holds.current(T0 + 4) == EngineHold(Hold.RATE_LIMITED, T0 + 4, T0 + 6, 429)
    holds.reset()  # the engine went down: its rate limit says nothing once it is back
    assert holds.current(T0 + 4) == EngineHold(Hold.INTERACTIVE_LOAD, T0)
    assert holds.people(False, T0 + 5) is True
    assert holds.current(T0 + 5) is None


def _started(_slot: EngineSlot, _queued: Queued) -> None:
    raise AssertionError("nothing runs here")


async def test_a_slot_reports_429s_until_a_success_and_tells_its_writer_at_each_change() -> None:
    clock = ManualClock(T0)
    changes: list[int] = []
    slot = EngineSlot(
        FakeEngine(), _started, lambda: None, clock=clock, changed=lambda: changes.append(1)
    )
    assert await slot.check()
    changes.clear()
    slot.overloaded(None, 429, 1.5)  # a dedicated engine: its governor takes no notice
    assert slot.hold() == EngineHold(Hold.RATE_LIMITED, T0, T0 + 1.5, 429)
    clock.advance(1)
    slot.overloaded(2.0, 429, 2.0)
    assert slot.hold() == EngineHold(Hold.RATE_LIMITED, T0, T0 + 3, 429)
    assert len(changes) == 2, "each 429 is a change: the report says the next try"
    slot.succeeded(0.1, 4)
    assert slot.hold() is None
    assert len(changes) == 3
    slot.succeeded(0.1, 4)
    assert len(changes) == 3, "a success with no limit to end changes nothing"


async def test_a_shared_slot_whose_people_leave_no_room_is_held_by_them() -> None:
    clock = ManualClock(T0)
    changes: list[int] = []
    governor = ConcurrencyLimit(8, Mode.SHARED, SharedTargets(slots=8))
    slot = EngineSlot(
        FakeEngine(),
        _started,
        lambda: None,
        governor,
        clock=clock,
        changed=lambda: changes.append(1),
    )
    assert await slot.check()
    changes.clear()
    slot.pressure(Pressure(running=8, waiting=2))  # people fill every slot
    assert governor.limit == 0
    assert slot.hold() == EngineHold(Hold.INTERACTIVE_LOAD, T0)
    clock.advance(5)
    slot.pressure(Pressure(running=1, waiting=0))
    assert governor.limit > 0
    assert slot.hold() is None
    assert changes == [1, 1]


# ---- a model's engines --------------------------------------------------------------------------


def report(
    engine: str,
    state: EngineState = UP,
    hold: EngineHold | None = None,
    *,
    worker: str = "w1",
    pressure: float = 0.0,
) -> EngineReport:
    return EngineReport(
        worker=worker,
        engine=engine,
        url=None,
        models=("m",),
        state=state,
        last_error=None,
        since=T0,
        checked_at=T0,
        in_flight=0,
        max_concurrency=8,
        concurrency_limit=0,
        mode="shared",
        signal="metrics",
        pressure=pressure,
        until=T0 + 60,
        hold=hold,
    )


LIMITED = EngineHold(Hold.RATE_LIMITED, T0 + 10, T0 + 60, 429)
PEOPLE = EngineHold(Hold.INTERACTIVE_LOAD, T0 + 5)


def test_one_engine_that_takes_batch_work_is_enough() -> None:
    assert model_health([report("a", hold=LIMITED), report("b")])["m"] == ModelHealth(True, None)


def test_held_engines_show_the_rate_limit_first_and_count_each_engines_people_once() -> None:
    health = model_health(
        [
            report("a", hold=PEOPLE, pressure=6),
            report("a", hold=PEOPLE, worker="w2", pressure=7),
            report("b", hold=PEOPLE, pressure=3),
            report("c", DOWN),
        ]
    )
    assert health["m"].held == HeldEngines(Hold.INTERACTIVE_LOAD, ("a", "b"), T0 + 5, people=10)
    limited = model_health([report("a", hold=PEOPLE), report("b", hold=LIMITED)])["m"].held
    assert limited == HeldEngines(Hold.RATE_LIMITED, ("b",), T0 + 10, T0 + 60, 429)


# ---- what the batch shows -----------------------------------------------------------------------


def batch(**changes: Any) -> BatchRecord:
    made = BatchRecord(
        id="batch_1",
        org_id="org_1",
        endpoint="/v1/chat/completions",
        model="m",
        model_config_id="cfg",
        input_file_id="file-1",
        completion_window="24h",
        status=BatchStatus.IN_PROGRESS,
        created_at=int(T0),
        expires_at=int(T0) + 86_400,
        total=10,
        billing=Billing.CATALOG,
    )
    return replace(made, **changes)


CREDIT = LaneWait(
    WaitCode.CREDIT, int(T0) + 30, balance=-usd_to_pico("0.25"), lines=7, needed=usd_to_pico("3")
)
FAIR = LaneWait(WaitCode.FAIR_SHARE, int(T0) + 40, others=2, weight=1, total_weight=4)
KEY = ("m", "org_1")
FREE = model_health([report("a")])


def shown(health: dict[str, ModelHealth], lanes: dict[tuple[str, str], LaneWait]) -> WaitingOn:
    found = waiting_on(batch(estimated_completion_at=int(T0) + 3600), health, lanes, T0 + 50)
    assert found is not None
    return found


def test_rate_limited_names_the_engine_the_status_and_the_next_try() -> None:
    waiting = shown(model_health([report("a", hold=LIMITED)]), {})
    assert (waiting.code, waiting.since, waiting.resumes_at) == (
        "rate_limited",
        int(T0) + 10,
        int(T0) + 60,
    )
    assert "Engine 'a' serving model 'm' answered Backfill with 429 Too Many Requests" in (
        waiting.message
    )
    assert "the next at about 1970-01-12 13:47:40 UTC" in waiting.message
    # Read once the retry is past (a report stored a moment ago): no time is promised.
    late = waiting_on(batch(), model_health([report("a", hold=LIMITED)]), {}, T0 + 61)
    assert late is not None
    assert late.resumes_at is None
    assert "the next at about" not in late.message


def test_interactive_load_names_the_engines_and_says_batch_work_takes_what_people_leave() -> None:
    waiting = shown(model_health([report("a", hold=PEOPLE, pressure=12)]), {})
    assert (waiting.code, waiting.since, waiting.resumes_at) == (
        "interactive_load",
        int(T0) + 5,
        None,
    )
    assert "Engine 'a' serving model 'm' is shared with interactive traffic" in waiting.message
    assert "12 requests of people" in waiting.message
    assert "batch work takes only what people leave" in waiting.message
    assert "projected to finish at 1970-01-12 14:46:40 UTC" in waiting.message


def test_credit_says_what_is_available_what_is_needed_and_that_credit_resumes_it() -> None:
    waiting = shown(FREE, {KEY: CREDIT})
    assert (waiting.code, waiting.since, waiting.resumes_at) == ("credit", int(T0) + 30, None)
    assert "its balance is $-0.25" in waiting.message
    assert "any amount over $0.25 brings it above zero" in waiting.message
    assert "resumes within seconds" in waiting.message
    assert "its 7 requests left need about $3 more" in waiting.message


def test_fair_share_says_how_many_orgs_are_served_and_this_orgs_share() -> None:
    waiting = shown(FREE, {KEY: FAIR})
    assert (waiting.code, waiting.since) == ("fair_share", int(T0) + 40)
    assert "busy with requests of 2 other organizations" in waiting.message
    assert "this one's is 1 of 4 (25%)" in waiting.message


def test_engine_starting_expects_the_engine_after_its_learnt_start() -> None:
    health = {"m": ModelHealth(True, None, starting_since=T0 + 45, start_s=20.0)}
    assert shown(health, {}).resumes_at == int(T0) + 65
    # Overdue: no time is promised.
    assert waiting_on(batch(), health, {}, T0 + 70) == replace(shown(health, {}), resumes_at=None)


def test_since_is_never_before_the_batch_was_created() -> None:
    late = batch(created_at=int(T0) + 35)
    found = waiting_on(
        late,
        {"m": ModelHealth(True, None, held=HeldEngines(Hold.RATE_LIMITED, ("a",), T0))},
        {},
        T0 + 50,
    )
    assert found is not None
    assert found.since == int(T0) + 35


@pytest.mark.parametrize(
    ("health", "lanes", "expected"),
    [
        # Credit: only the owner can lift it, and it holds whatever the engines do.
        (model_health([report("a", DOWN)]), {KEY: CREDIT}, "credit"),
        # The engines stop every line of the model; fair share stops only this org's.
        (model_health([report("a", hold=PEOPLE)]), {KEY: FAIR}, "interactive_load"),
        (model_health([report("a", DOWN)]), {KEY: FAIR}, "no_healthy_engine"),
        (FREE, {KEY: FAIR}, "fair_share"),
        (FREE, {}, None),
        # The planner's findings need a live worker for the model: its rows outlive it.
        ({}, {KEY: CREDIT}, "no_healthy_engine"),
    ],
)
def test_the_first_reason_in_precedence_is_shown(
    health: dict[str, ModelHealth],
    lanes: dict[tuple[str, str], LaneWait],
    expected: str | None,
) -> None:
    found = waiting_on(batch(), health, lanes, T0 + 50)
    assert (found.code if found else None) == expected


def test_a_paused_batch_says_so_before_anything_else_and_how_to_resume() -> None:
    paused = batch(paused_at=int(T0) + 20)
    found = waiting_on(paused, model_health([report("a", DOWN)]), {KEY: CREDIT}, T0 + 50)
    assert found is not None
    assert (found.code, found.since, found.resumes_at) == ("paused", int(T0) + 20, None)
    assert f"POST /v1/batches/{paused.id}/resume" in found.message
    assert "window keeps running" in found.message


def test_priority_comes_last_and_says_what_goes_first_and_until_when() -> None:
    ahead = AheadInLane(batches=2, top_priority=7, since=int(T0) + 25, done_by=int(T0) + 900)
    waiting = batch(in_progress_at=int(T0) + 10)
    # Fair share holds too: it is shown first.
    fair = waiting_on(waiting, FREE, {KEY: FAIR}, T0 + 50, ahead)
    assert fair is not None
    assert fair.code == "fair_share"
    found = waiting_on(waiting, FREE, {}, T0 + 50, ahead)
    assert found is not None
    assert (found.code, found.since, found.resumes_at) == ("priority", int(T0) + 25, int(T0) + 900)
    assert "2 other batches of this organization on model 'm' go first" in found.message
    assert "the highest priority among them is 7, against this batch's 0" in found.message
    assert "projected to finish at" in found.message


def test_precedence_is_the_documented_order() -> None:
    assert [c.value for c in PRECEDENCE] == [
        "paused",
        "credit",
        "rate_limited",
        "interactive_load",
        "engine_starting",
        "no_healthy_engine",
        "fair_share",
        "priority",
    ]


def test_a_batch_with_nothing_left_to_run_waits_on_nothing() -> None:
    done = batch(completed=10)
    assert waiting_on(done, {}, {KEY: CREDIT}, T0) is None
    assert waiting_on(batch(status=BatchStatus.CANCELLING), {}, {}, T0) is None


# ---- what the planner finds of a lane -----------------------------------------------------------


def lane(org: str, **changes: Any) -> LaneLoad:
    made = LaneLoad(
        model="m",
        org_id=org,
        served=0,
        served_mark=0,
        ready=True,
        urgent_by=NOT_URGENT,
        share=0.0,
    )
    return replace(made, **changes)


def running(id_: str, org: str, remaining: int = 10, weight: int = 1) -> RunningBatch:
    return RunningBatch(id_, "m", org, weight, remaining, int(T0), int(T0) + 86_400, None)


def test_a_lane_with_no_lines_out_while_other_orgs_have_some_waits_on_fair_share() -> None:
    lanes = [lane("a", weight=3), lane("b"), lane("c", ready=False)]
    batches = [running("ba", "a"), running("bb", "b"), running("bc", "c")]
    waits = lane_waits(lanes, batches, {"ba", "bc"}, {}, T0)
    # Orgs with work: a and c with lines out, b ready: 3 + 1 + 1.
    assert waits[("m", "b")] == LaneWait(
        WaitCode.FAIR_SHARE, int(T0), others=2, weight=1, total_weight=5
    )
    assert waits[("m", "a")] is None, "its lines are out: it moves"
    assert waits[("m", "c")] is None


def test_no_fair_share_wait_alone_or_while_nobody_has_lines_out() -> None:
    assert lane_waits([lane("a")], [running("ba", "a")], set(), {}, T0) == {("m", "a"): None}
    both = lane_waits([lane("a"), lane("b")], [running("ba", "a"), running("bb", "b")], (), {}, T0)
    assert set(both.values()) == {None}, "nothing runs at all: the engines say why"


def test_a_lane_held_for_credit_says_its_balance_and_what_its_lines_need() -> None:
    held = lane("a", ready=False, gated=True, balance=-5, gpu_count=2, gpu_price=1000)
    waits = lane_waits([held], [running("ba", "a", 30)], (), {"m": 10.0}, T0)
    needed = gpu_time_charge(2, 1000, 3000)  # 30 lines at 10 a second: 3 s of 2 GPUs
    assert waits[("m", "a")] == LaneWait(
        WaitCode.CREDIT, int(T0), balance=-5, lines=30, needed=needed
    )
    unmeasured = lane_waits([held], [running("ba", "a", 30)], (), {"m": None}, T0)
    assert unmeasured[("m", "a")] == LaneWait(WaitCode.CREDIT, int(T0), balance=-5, lines=30)


def test_a_wait_found_again_keeps_its_since_unless_the_lane_moved_meanwhile() -> None:
    stored = LaneWait(
        WaitCode.FAIR_SHARE, int(T0) - 99, others=1, weight=1, total_weight=2, served=7
    )
    lanes = [lane("a"), lane("b", wait=stored, served=7)]
    batches = [running("ba", "a"), running("bb", "b")]
    assert lane_waits(lanes, batches, {"ba"}, {}, T0)[("m", "b")] == stored
    # A line of it was claimed between the passes: a new wait, from now.
    moved = [lanes[0], lane("b", wait=stored, served=9)]
    assert lane_waits(moved, batches, {"ba"}, {}, T0)[("m", "b")] == replace(
        stored, since=int(T0), served=9
    )
    # What the API shows: a wait whose lane was claimed from since is over.
    assert stored.holds(7)
    assert not stored.holds(8)


def test_the_plan_stores_a_wait_that_changed_and_nothing_when_it_holds() -> None:
    lanes = [lane("a", served=10, served_mark=10, share=1.0), lane("b")]
    inputs = PlanInputs(
        lanes=lanes,
        rates=[ModelRate("m", 5.0, T0 - 5, 10, True)],
        running=[running("ba", "a"), running("bb", "b")],
        leased=frozenset({"ba"}),
    )
    made = plan(inputs, T0, 0.1)
    [stored] = [p for p in made.lanes if p.org_id == "b"]
    assert stored.wait is not None
    assert stored.wait.code == WaitCode.FAIR_SHARE
    # Nothing else of the lane moves with it.
    assert (stored.served_mark, stored.share, stored.urgent_by, stored.forgiven) == (
        0,
        0.0,
        NOT_URGENT,
        0.0,
    )
    again = replace(inputs, lanes=[lanes[0], replace(lanes[1], wait=stored.wait)])
    assert plan(again, T0 + 5, 0.1).lanes == []
    # Its lines went out: the wait is cleared.
    cleared = replace(again, leased=frozenset({"ba", "bb"}))
    [clear] = [p for p in plan(cleared, T0 + 10, 0.1).lanes if p.org_id == "b"]
    assert clear.wait is None
