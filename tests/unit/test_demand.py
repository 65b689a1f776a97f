"""The demand signal for autoscalers, against figures worked out by hand: the replicas that
finish every accepted batch before its deadline less the margin, serving the earliest first;
the replicas up; the queue's requests and token bound."""

from __future__ import annotations

import pytest

from backfill.domain.engine_health import EngineReport, EngineState, replicas_up
from backfill.domain.scheduling.demand import (
    MAX_REPLICAS_NEEDED,
    MIN_SLACK_S,
    DemandInputs,
    ModelDemand,
    QueuedBatch,
    demand,
    replicas_needed,
    required_rps,
)

NOW = 1_000_000.0


def queued(
    remaining: int, *, window: int, left: int | None = None, model: str = "m", tokens: int = 0
) -> QueuedBatch:
    """A batch of ``window`` seconds with ``left`` of them to go (all of them by default)."""
    expires = int(NOW) + (window if left is None else left)
    return QueuedBatch(model, remaining, tokens, expires - window, expires)


def engine(
    name: str,
    models: tuple[str, ...] = ("m",),
    *,
    state: EngineState = EngineState.UP,
    worker: str = "w1",
    url: str | None = None,
    until: float = NOW + 30,
) -> EngineReport:
    return EngineReport(
        worker=worker,
        engine=name,
        url=url if url is not None else f"http://{name}:8000/v1",
        models=models,
        state=state,
        last_error=None,
        since=NOW - 60,
        checked_at=NOW - 1,
        in_flight=0,
        max_concurrency=16,
        concurrency_limit=16,
        mode="dedicated",
        signal="fixed",
        pressure=0.0,
        until=until,
    )


def test_nothing_queued_needs_no_replica() -> None:
    assert replicas_needed([], 2.0, 3, NOW, 0.1) == 0
    assert replicas_needed([], None, 0, NOW, 0.1) == 0
    # Batches whose lines are all done (finalizing soon) ask for nothing either.
    assert replicas_needed([queued(0, window=3600)], 2.0, 3, NOW, 0.1) == 0


def test_one_batch_needs_its_lines_over_its_window_less_the_margin() -> None:
    # 900 lines, 1,000 s to go, margin 0.1 of the window: due in 900 s, so 1 request/s.
    batch = [queued(900, window=1000)]
    assert required_rps(batch, NOW, 0.1) == pytest.approx(1.0)
    assert replicas_needed(batch, 0.25, 0, NOW, 0.1) == 4
    assert replicas_needed(batch, 0.5, 0, NOW, 0.1) == 2  # exactly 2, not rounded up to 3
    assert replicas_needed(batch, 0.3, 0, NOW, 0.1) == 4  # 3.33 rounds up
    assert replicas_needed(batch, 5.0, 0, NOW, 0.1) == 1  # a fifth of one replica: one
    # Without the margin, 900 lines in 1,000 s: 0.9 request/s, 3.6 replicas.
    assert replicas_needed(batch, 0.25, 0, NOW, 0.0) == 4
    assert replicas_needed(batch, 0.3, 0, NOW, 0.0) == 3
    # Halfway through its window, the same lines are due in 400 s: 2.25 requests/s.
    halfway = [queued(900, window=1000, left=500)]
    assert required_rps(halfway, NOW, 0.1) == pytest.approx(900 / 400)
    assert replicas_needed(halfway, 0.25, 0, NOW, 0.1) == 9


def test_every_deadline_is_met_serving_the_earliest_first() -> None:
    """For each deadline, the lines due by it over the time left: the largest decides."""
    a = queued(100, window=200)  # due at +180 (margin 20 s)
    b = queued(1000, window=2000)  # due at +1800 (margin 200 s)
    c = queued(200, window=2000, left=1000)  # due at +800 (margin 200 s)
    # By +180: 100 / 180 = 0.556; by +800: 300 / 800 = 0.375; by +1800: 1300 / 1800 = 0.722.
    assert required_rps([b, c, a], NOW, 0.1) == pytest.approx(1300 / 1800)
    assert replicas_needed([b, c, a], 0.1, 0, NOW, 0.1) == 8  # 7.22
    # Without a margin: 100 / 200, 300 / 1000, 1300 / 2000 = 0.65: 6.5 replicas.
    assert replicas_needed([b, c, a], 0.1, 0, NOW, 0.0) == 7
    # An early deadline can decide alone: 600 lines due at +90 (6.67/s) beside 100 lines due
    # at +900 (700 / 900 = 0.78/s).
    rush = queued(600, window=100)
    calm = queued(100, window=1000)
    assert required_rps([calm, rush], NOW, 0.1) == pytest.approx(600 / 90)
    assert replicas_needed([calm, rush], 1.0, 0, NOW, 0.1) == 7


def test_until_a_replica_is_measured_the_fleet_up_is_kept_at_least_one() -> None:
    batch = [queued(900, window=1000)]
    assert replicas_needed(batch, None, 0, NOW, 0.1) == 1  # scale up from zero
    assert replicas_needed(batch, None, 3, NOW, 0.1) == 3  # keep what measures the rate
    assert replicas_needed(batch, 0.0, 2, NOW, 0.1) == 2  # a rate of 0 measures nothing


def test_a_deadline_that_cannot_be_met_asks_for_as_many_as_it_can() -> None:
    # Due (deadline less margin) 91 s ago: it counts as due in MIN_SLACK_S.
    late = queued(50, window=1010, left=10)
    assert required_rps([late], NOW, 0.1) == pytest.approx(50 / MIN_SLACK_S)
    assert replicas_needed([late], 1.0, 1, NOW, 0.1) == 50
    # A deadline already past, and more than any fleet: capped.
    gone = queued(10**7, window=3600, left=-5)
    assert replicas_needed([gone], 1.0, 1, NOW, 0.1) == MAX_REPLICAS_NEEDED
    assert replicas_needed([queued(10**9, window=10**6)], 1e-6, 1, NOW, 0.1) == (
        MAX_REPLICAS_NEEDED
    )


def test_replicas_up_count_each_engine_once_and_only_live_healthy_reports() -> None:
    reports = [
        engine("a", ("m", "n")),
        engine("a", ("m", "n"), worker="w2"),  # the same engine seen by a second worker
        engine("b", ("m",)),
        engine("c", ("m",), state=EngineState.DOWN),
        engine("d", ("m",), state=EngineState.STANDBY),
        engine("e", ("m",), until=NOW - 1),  # its worker stopped reporting
        engine("f", ("m",), url="http://10.0.0.9:8000/v1"),
        engine("f", ("m",), url="http://10.0.0.10:8000/v1"),  # two replicas under one name
    ]
    assert replicas_up(reports, NOW) == {"m": 4, "n": 1}
    assert replicas_up([], NOW) == {}


def test_demand_lists_every_known_model_with_its_queue_and_fleet() -> None:
    inputs = DemandInputs(
        queued=[
            queued(900, window=1000, tokens=90_000),
            queued(100, window=1000, tokens=5_000),
            queued(40, window=3600, model="cold", tokens=4_000),
        ],
        per_replica={"m": 0.5, "idle": 3.0},
        engines=[engine("a"), engine("b"), engine("x", ("spare",))],
    )
    found = {d.model: d for d in demand(inputs, NOW, 0.1, also=["cancelling-only"])}
    # 1,000 lines due in 900 s at 0.5 a replica: 2.22, so 3.
    assert found["m"] == ModelDemand("m", 1000, 95_000, 2, 0.5, 3, 0.1)
    # Queued, no replica up and none measured: one, to start from zero.
    assert found["cold"] == ModelDemand("cold", 40, 4_000, 0, None, 1, 0.1)
    # Work done: measured rates and replicas up stay listed, at 0 needed.
    assert found["idle"] == ModelDemand("idle", 0, 0, 0, 3.0, 0, 0.1)
    assert found["spare"] == ModelDemand("spare", 0, 0, 1, None, 0, 0.1)
    assert found["cancelling-only"] == ModelDemand("cancelling-only", 0, 0, 0, None, 0, 0.1)
    assert list(found) == sorted(found)
    assert demand(DemandInputs([], {}, []), NOW, 0.1) == []
