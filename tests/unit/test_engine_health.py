"""Engine health without I/O: which health checks are worth a log line (a warning with the
reason, repeated while down, an info line on recovery), when a stored report must be rewritten,
and when a batch tells its owner it waits for an engine."""

from __future__ import annotations

import pytest

from backfill.domain.catalog import Billing
from backfill.domain.engine_health import (
    DEFAULT_START_S,
    MAX_REASON_CHARS,
    START_GRACE_S,
    EngineReport,
    EngineState,
    HealthTracker,
    ModelHealth,
    Note,
    NoteKind,
    model_health,
    start_delays,
)
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord
from backfill.domain.waiting import WaitCode, WaitingOn
from backfill.domain.waiting import waiting_on as waiting_on_lanes

ENGINE_STARTING, NO_HEALTHY_ENGINE = WaitCode.ENGINE_STARTING, WaitCode.NO_HEALTHY_ENGINE

UP, DOWN, STANDBY = EngineState.UP, EngineState.DOWN, EngineState.STANDBY
STARTING = EngineState.STARTING
REFUSED = "cannot connect to 127.0.0.1:9 (connection refused)"
T0 = 1_000_000.0


def tracker(remind_s: float = 300.0) -> HealthTracker:
    return HealthTracker(T0, remind_s=remind_s)


def notes(t: HealthTracker, checks: list[tuple[float, EngineState]]) -> list[Note | None]:
    return [t.observe(state, REFUSED, T0 + at).note for at, state in checks]


# ---- what is logged ---------------------------------------------------------------------------


def test_an_engine_that_answers_at_start_is_logged_up_once() -> None:
    assert notes(tracker(), [(0, UP), (5, UP), (10, UP)]) == [Note(NoteKind.UP), None, None]


def test_an_engine_that_never_answers_is_warned_about_after_the_start_grace() -> None:
    t = tracker()
    seen = notes(t, [(0, DOWN), (0.5, DOWN), (START_GRACE_S, DOWN), (START_GRACE_S + 0.5, DOWN)])
    assert seen == [None, None, Note(NoteKind.DOWN, START_GRACE_S), None]
    assert t.reason == REFUSED


def test_an_engine_that_answers_within_the_grace_is_never_warned_about() -> None:
    """A managed engine loading its model for a few seconds is not a fault."""
    assert notes(tracker(), [(0, DOWN), (3, DOWN), (4, UP)]) == [None, None, Note(NoteKind.UP)]


def test_an_engine_that_was_up_is_warned_about_at_the_first_failed_check() -> None:
    seen = notes(tracker(), [(0, UP), (60, DOWN)])
    assert seen == [Note(NoteKind.UP), Note(NoteKind.DOWN, 0.0)]


def test_the_warning_is_repeated_at_the_reminder_interval_while_it_stays_down() -> None:
    checks = [(0.0, UP), (100.0, DOWN)] + [(100.0 + 0.5 * i, DOWN) for i in range(1, 1100)]
    seen = [(at, n) for (at, _), n in zip(checks, notes(tracker(300), checks), strict=True) if n]
    assert seen == [
        (0.0, Note(NoteKind.UP)),
        (100.0, Note(NoteKind.DOWN, 0.0)),
        (400.0, Note(NoteKind.STILL_DOWN, 300.0)),
    ]


def test_recovery_after_a_warning_says_how_long_it_was_down() -> None:
    seen = notes(tracker(), [(0, UP), (10, DOWN), (11, DOWN), (52, UP), (53, UP)])
    assert seen == [
        Note(NoteKind.UP),
        Note(NoteKind.DOWN, 0.0),
        None,
        Note(NoteKind.RECOVERED, 42.0),
        None,
    ]


def test_standby_is_never_a_warning_and_a_start_from_it_gets_the_grace_again() -> None:
    """An engine started on demand is parked on purpose, then loads before it answers."""
    seen = notes(
        tracker(),
        [(0, STANDBY), (400, STANDBY), (500, DOWN), (505, DOWN), (500 + START_GRACE_S, DOWN)],
    )
    assert seen == [None, None, None, None, Note(NoteKind.DOWN, START_GRACE_S)]


def test_standby_after_a_warning_forgets_it() -> None:
    seen = notes(tracker(), [(0, UP), (10, DOWN), (20, STANDBY), (30, UP)])
    assert seen == [Note(NoteKind.UP), Note(NoteKind.DOWN, 0.0), None, Note(NoteKind.UP)]


def test_a_flapping_engine_is_warned_about_once_per_reminder_interval() -> None:
    """Down and up at every 0.5 s check: one warning and one recovery line, then nothing
    until a reminder interval after the warning, when the next outage is warned about with
    the count of those that went unlogged."""
    checks = [(0.0, UP)] + [(0.5 * i, DOWN if i % 2 else UP) for i in range(1, 1300)]
    seen = [(at, n) for (at, _), n in zip(checks, notes(tracker(300), checks), strict=True) if n]
    assert seen == [
        (0.0, Note(NoteKind.UP)),
        (0.5, Note(NoteKind.DOWN, 0.0)),
        (1.0, Note(NoteKind.RECOVERED, 0.5)),
        # 299 outages (1.5 s … 299.5 s) went by unlogged; 300.5 s is the first one past 300 s.
        (300.5, Note(NoteKind.DOWN, 0.0, unlogged_outages=299)),
        (301.0, Note(NoteKind.RECOVERED, 0.5)),
        (600.5, Note(NoteKind.DOWN, 0.0, unlogged_outages=299)),
        (601.0, Note(NoteKind.RECOVERED, 0.5)),
    ]


def test_a_flapping_engines_outage_that_lasts_is_warned_about_at_the_interval() -> None:
    t = tracker(300)
    seen = notes(t, [(0, UP), (10, DOWN), (11, UP), (20, DOWN), (309, DOWN), (310, DOWN)])
    assert seen == [
        Note(NoteKind.UP),
        Note(NoteKind.DOWN, 0.0),
        Note(NoteKind.RECOVERED, 1.0),
        None,
        None,
        Note(NoteKind.DOWN, 290.0),
    ]
    assert notes(t, [(311, DOWN), (320, UP)]) == [None, Note(NoteKind.RECOVERED, 300.0)]


def test_an_outage_with_another_reason_is_warned_about_at_once() -> None:
    t = tracker(300)
    t.observe(UP, None, T0)
    assert t.observe(DOWN, REFUSED, T0 + 1).note == Note(NoteKind.DOWN, 0.0)
    t.observe(UP, None, T0 + 2)
    assert t.observe(DOWN, REFUSED, T0 + 3).note is None, "the same reason: held back"
    timeout = "GET /v1/models did not answer within 5 s"
    assert t.observe(DOWN, timeout, T0 + 4).note == Note(NoteKind.DOWN, 1.0)
    t.observe(UP, None, T0 + 5)
    assert t.observe(DOWN, REFUSED, T0 + 6).note is None
    assert t.observe(UP, None, T0 + 7).note is None
    assert t.observe(DOWN, timeout, T0 + 8).note is None, "both reasons were warned about"


def test_every_change_of_a_flapping_engine_is_news_for_the_stored_report() -> None:
    """What is written is bounded by the report writer, not by the tracker."""
    t = tracker(300)
    changes = [t.observe(s, REFUSED, T0 + i).changed for i, s in enumerate([UP, DOWN] * 5)]
    assert all(changes)


# ---- what is stored ---------------------------------------------------------------------------


def test_a_report_is_rewritten_when_the_state_or_its_reason_moves_only() -> None:
    t = tracker()
    assert t.observe(DOWN, REFUSED, T0).changed, "the first check is news"
    assert not t.observe(DOWN, REFUSED, T0 + 1).changed
    assert t.observe(DOWN, "GET /v1/models answered HTTP 404", T0 + 2).changed
    assert t.since == T0, "the outage began at the first failed check"
    assert t.observe(UP, None, T0 + 3).changed
    assert (t.since, t.reason, t.checked_at) == (T0 + 3, None, T0 + 3)
    assert not t.observe(UP, None, T0 + 4).changed


def test_reasons_are_one_bounded_line() -> None:
    t = tracker()
    t.observe(DOWN, "line one\n  line two " + "x" * 1000, T0)
    assert t.reason is not None
    assert "\n" not in t.reason
    assert t.reason.startswith("line one line two x")
    assert len(t.reason) == MAX_REASON_CHARS
    t.observe(DOWN, None, T0 + 1)
    assert t.reason == "its health check failed"


# ---- what a batch owner sees --------------------------------------------------------------------


def report(
    engine: str,
    state: EngineState,
    models: tuple[str, ...] = ("m",),
    since: float = T0,
    start_s: float | None = None,
) -> EngineReport:
    return EngineReport(
        worker="w1",
        engine=engine,
        url=None,
        models=models,
        state=state,
        last_error=REFUSED if state == DOWN else None,
        since=since,
        checked_at=since,
        in_flight=0,
        max_concurrency=4,
        concurrency_limit=4,
        mode="dedicated",
        signal="fixed",
        pressure=0.0,
        until=T0 + 3600,
        start_s=start_s,
    )


def test_a_model_is_available_while_any_engine_serving_it_is_up_or_on_standby() -> None:
    health = model_health(
        [
            report("a", DOWN, ("m", "n"), since=T0),
            report("b", UP, ("m",)),
            report("c", DOWN, ("n",), since=T0 + 50),
            report("d", STANDBY, ("e",)),
        ]
    )
    assert health == {
        "m": ModelHealth(True, None),
        "n": ModelHealth(False, T0 + 50),
        # Its work waits for a start.
        "e": ModelHealth(True, None, starting_since=T0),
    }


def waiting_on(batch: BatchRecord, health: dict[str, ModelHealth]) -> WaitingOn | None:
    """What the batch shows with no lane held (credit, fair share), at T0."""
    return waiting_on_lanes(batch, health, {}, T0)


def batch(status: BatchStatus = BatchStatus.IN_PROGRESS, done: int = 0) -> BatchRecord:
    return BatchRecord(
        id="batch_1",
        org_id="org_1",
        endpoint="/v1/chat/completions",
        model="m",
        model_config_id="cfg",
        input_file_id="file-1",
        completion_window="24h",
        status=status,
        created_at=int(T0) - 600,
        expires_at=int(T0) + 86_400,
        total=10,
        completed=done,
        billing=Billing.CATALOG,
    )


def test_a_running_batch_whose_engines_are_all_down_says_so_and_since_when() -> None:
    health = model_health([report("a", DOWN, since=T0 + 30), report("b", DOWN, since=T0)])
    waiting = waiting_on(batch(), health)
    assert waiting is not None
    assert (waiting.code, waiting.since) == (NO_HEALTHY_ENGINE, int(T0) + 30)
    assert "'m'" in waiting.message
    assert "resumes by itself" in waiting.message
    assert "backfill admin engine list" in waiting.message


def test_a_batch_whose_model_no_live_worker_serves_waits_since_its_creation() -> None:
    waiting = waiting_on(batch(), model_health([report("a", UP, ("other",))]))
    assert waiting is not None
    assert waiting.since == int(T0) - 600
    assert "No running worker has an engine for model 'm'" in waiting.message


@pytest.mark.parametrize(
    "quiet",
    [
        batch(BatchStatus.COMPLETED, done=10),
        batch(BatchStatus.CANCELLING),
        batch(BatchStatus.FINALIZING, done=10),
        batch(done=10),
    ],
)
def test_a_batch_that_needs_no_engine_waits_on_nothing(quiet: BatchRecord) -> None:
    assert waiting_on(quiet, model_health([report("a", DOWN)])) is None


def test_a_batch_with_a_healthy_engine_waits_on_nothing() -> None:
    assert waiting_on(batch(), model_health([report("a", DOWN), report("b", UP)])) is None


# ---- engines started on demand ------------------------------------------------------------------


def test_starting_is_neither_an_outage_nor_a_first_answer() -> None:
    t = tracker()
    assert notes(t, [(0, STANDBY), (1, STARTING), (2, STARTING)]) == [None, None, None]
    # Its first answer after the start is the "up" line, as for any start.
    assert notes(t, [(3, UP)]) == [Note(NoteKind.UP)]


def test_a_batch_whose_engines_are_all_starting_says_so_with_the_learnt_start() -> None:
    health = model_health([report("a", STARTING, since=T0 + 5, start_s=12.4), report("b", DOWN)])
    waiting = waiting_on(batch(), health)
    assert waiting is not None
    assert (waiting.code, waiting.since) == (ENGINE_STARTING, int(T0) + 5)
    assert "being started; its last start took about 12 s" in waiting.message
    # One engine up is enough: nothing waits for the start.
    assert waiting_on(batch(), model_health([report("a", STARTING), report("b", UP)])) is None


def test_start_delays_count_what_is_left_of_a_start_or_the_whole_learnt_one() -> None:
    reports = [
        # "m": one starting 4 s ago, learnt 10 s; one on standby, learnt 8 s: the sooner wins.
        report("a", STARTING, ("m",), since=T0 - 4, start_s=10.0),
        report("b", STANDBY, ("m",), start_s=8.0),
        # "n": starting for longer than its learnt start: any moment now.
        report("c", STARTING, ("n",), since=T0 - 30, start_s=10.0),
        # "s": on standby, never timed: the default guess.
        report("d", STANDBY, ("s",)),
        # "u": one up beside one on standby: no wait.
        report("e", STANDBY, ("u",)),
        report("f", UP, ("u",)),
    ]
    assert start_delays(reports, T0) == {"m": 6.0, "n": 0.0, "s": DEFAULT_START_S}
    # A report past its until (its worker died) does not count.
    assert start_delays(reports, T0 + 7200) == {}
