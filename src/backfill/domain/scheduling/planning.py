"""The planner's maths: each model's measured throughput, each running batch's projected
finish at its fair share, and which lanes must be served first to meet a deadline.

Pure: the store reads ``PlanInputs``, ``plan`` turns them into a ``Plan``, and the store
writes that back. Several processes may plan (one at a time holds the planner's lease); a
plan depends only on what it read and the time it was made.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from backfill.domain.engine_health import EngineReport, replicas_up, start_delays
from backfill.domain.priority import claim_rank
from backfill.domain.scheduling.waits import lane_waits
from backfill.domain.waiting import LaneWait

# A lane that is not urgent is served "by" this deadline: later than any real one, so one
# ordering key (urgent_by, then virtual time) puts urgent lanes first, earliest deadline first.
NOT_URGENT = 2**62
# The weight of the newest measurement in the throughput's moving average: a change of pace
# shows within a few measurements, and one odd one does not swing it.
RATE_SMOOTHING = 0.3
# A measurement spans at least this many lines or this long: claims come in bunches, so a
# shorter window would measure how they bunch, not how fast the model serves.
MIN_SAMPLE_LINES = 200
MIN_SAMPLE_S = 60.0
# A stored estimate is rewritten when the new one differs by more than this share of the time
# still to go (and by at least a second): estimates stay current without a write per pass.
ESTIMATE_TOLERANCE = 0.01


@dataclass(frozen=True, slots=True)
class LaneLoad:
    """One (model, org) lane as the planner reads it."""

    model: str
    org_id: str
    served: int
    """Lines claimed from the lane, ever."""
    served_mark: int
    """``served`` when the last plan was made."""
    ready: bool
    """The lane has a chunk a claim could take now (and its org may run it)."""
    urgent_by: int
    share: float
    vtime: float = 0.0
    weight: int = 1
    """Its org's weight."""
    gated: bool = False
    """It has ready chunks that the credit gate holds back (GPU time, no credit)."""
    balance: int = 0
    """Its org's balance (picodollars)."""
    gpu_count: int = 0
    gpu_price: int = 0
    """A private deployment's GPUs and price per GPU-second (microdollars); 0 otherwise."""
    wait: LaneWait | None = None
    """Why its batches wait, as the last plan stored it."""


@dataclass(frozen=True, slots=True)
class ModelRate:
    """A model's measured throughput, and where its current measurement window started."""

    model: str
    rps: float | None
    """Requests per second while it had work; None until one busy window was measured."""
    observed_at: float
    served: int
    """Lines claimed from the model's lanes, ever, at ``observed_at``."""
    busy: bool
    """It had work ready at ``observed_at``."""
    replicas: int = 0
    """Its replicas up at ``observed_at`` (0: none, or not known)."""
    per_replica: float | None = None
    """Requests per second one replica serves while the model has work: each window's rate
    divided by the replicas up at both of its ends, counted only when those agree; None
    until such a window was measured."""


@dataclass(frozen=True, slots=True)
class RunningBatch:
    """An in-progress batch: what its projection needs."""

    id: str
    model: str
    org_id: str
    weight: int
    """Its org's weight: the weight of its lane."""
    remaining: int
    """Lines not yet finished (queued or running)."""
    created_at: int
    expires_at: int
    estimate: int | None
    """The estimated completion time stored now."""
    priority: int = 0
    urgent: bool = False
    """The last plan rescued it: its lines go before higher priorities of its lane."""
    paused: bool = False
    """Claims take none of its lines: it is projected to finish never (until resumed)."""

    def turn(self, *, rescue: bool = True) -> tuple[int, int, str]:
        """Where it stands among its lane's batches, as claims take them (the chunks' rank,
        then earliest deadline); ``rescue=False``: as if no batch were rescued."""
        return (claim_rank(self.priority, self.urgent and rescue), self.expires_at, self.id)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    lanes: Sequence[LaneLoad]
    rates: Sequence[ModelRate]
    running: Sequence[RunningBatch]
    engines: Sequence[EngineReport] = ()
    """The workers' stored engine reports: how many replicas of each model are up."""
    leased: frozenset[str] = frozenset()
    """Running batches with lines leased now (claimed or running), of the models that more
    than one org has running batches for (others cannot wait on fair share)."""


@dataclass(frozen=True, slots=True)
class LanePlan:
    model: str
    org_id: str
    served_mark: int
    share: float
    """The lane's part of its model's lines claimed since the last plan (0..1)."""
    urgent_by: int
    forgiven: float = 0.0
    """Virtual time taken off the lane: what it ran ahead while urgent."""
    wait: LaneWait | None = None
    """Why the lane's batches wait now (stored with the rest of the lane's plan)."""


@dataclass(frozen=True, slots=True)
class Plan:
    rates: list[ModelRate]
    """Only models whose rate or measurement window changed."""
    lanes: list[LanePlan]
    """Only lanes whose share, urgency or wait changed (with every lane of the model, their
    marks), or whose mark moved while their model is idle."""
    estimates: dict[str, int | None]
    """Only batches whose estimate changed (None: unknown)."""
    urgent: frozenset[str] = frozenset()
    """Batches to rescue that were not: they go before higher priorities of their lane."""
    calm: frozenset[str] = frozenset()
    """Rescued batches that no longer need it: back to their priority's place."""

    @property
    def empty(self) -> bool:
        """Nothing to store."""
        return not (self.rates or self.lanes or self.estimates or self.urgent or self.calm)


def measure(
    previous: ModelRate | None,
    model: str,
    served: int,
    busy: bool,
    now: float,
    replicas: int = 0,
) -> ModelRate:
    """The model's rate, now that ``served`` lines were ever claimed from it and ``replicas``
    of it are up.

    A window counts only while the model had work ready at every look: an idle model keeps
    its last busy rate, so a quiet night does not make the morning's first batch look
    impossible. A window is measured once it holds enough lines or time; until then it grows.
    An idle model's record stays as it is while it stays idle: its window starts again at its
    next busy look, so rewriting it at every idle look would store nothing of use.

    The rate one replica serves is measured from the same windows, divided by the replicas up
    at the window's start and end when those are the same. A window across a change of fleet
    says nothing certain of one replica: the rate per replica then stays as it was.
    """
    if previous is not None and not previous.busy and not busy:
        return previous
    if previous is None or not (previous.busy and busy):
        rps, per_replica = (previous.rps, previous.per_replica) if previous else (None, None)
        return ModelRate(model, rps, now, served, busy, replicas, per_replica)
    lines, elapsed = served - previous.served, now - previous.observed_at
    if elapsed <= 0 or (lines < MIN_SAMPLE_LINES and elapsed < MIN_SAMPLE_S):
        return previous
    sample = lines / elapsed
    per_replica = previous.per_replica
    if replicas > 0 and replicas == previous.replicas:
        per_replica = _smoothed(previous.per_replica, sample / replicas)
    return ModelRate(
        model, _smoothed(previous.rps, sample), now, served, busy, replicas, per_replica
    )


def _smoothed(previous: float | None, sample: float) -> float | None:
    """The moving average after ``sample``; a first sample of 0 measures nothing."""
    if previous is None:
        return sample if sample > 0 else None
    return previous + RATE_SMOOTHING * (sample - previous)


class _Lanes:
    """Every lane of one model with its remaining lines, for fluid fair-share sums."""

    def __init__(self, remaining: dict[str, int], weights: dict[str, int]) -> None:
        # Lanes by the virtual time at which each would run dry (remaining / weight).
        order = sorted(remaining, key=lambda org: remaining[org] / weights[org])
        self._dry = [remaining[org] / weights[org] for org in order]
        self._done = [0]  # remaining lines of the lanes that run dry first, cumulated
        for org in order:
            self._done.append(self._done[-1] + remaining[org])
        self._weight_after = [0] * (len(order) + 1)  # weights of the lanes still running
        for k in range(len(order) - 1, -1, -1):
            self._weight_after[k] = self._weight_after[k + 1] + weights[order[k]]

    def work_until(self, vtime: float) -> float:
        """Lines the model serves, all lanes at their fair share, until lanes that still have
        work reach virtual time ``vtime``: Σ_j min(R_j, vtime · w_j)."""
        k = bisect.bisect_right(self._dry, vtime)
        return self._done[k] + vtime * self._weight_after[k]


def project(
    batches: Sequence[RunningBatch], rps: float, now: float, *, rescue: bool = True
) -> dict[str, float]:
    """When each of one model's batches finishes, every lane at its weighted fair share and
    each lane's batches in their turn (``RunningBatch.turn``: rescued ones first, then by
    priority, then earliest deadline first, as claims take them).

    Batch i of lane L, with P_i lines of L at or before it, finishes once the model has served
    Σ_j min(R_j, P_i · w_j / w_L) lines: lane j gets w_j / w_L lines for each of L's, until it
    runs dry.
    """
    by_lane: dict[str, list[RunningBatch]] = defaultdict(list)
    for batch in batches:
        by_lane[batch.org_id].append(batch)
    weights = {org: lane[0].weight for org, lane in by_lane.items()}
    remaining = {org: sum(b.remaining for b in lane) for org, lane in by_lane.items()}
    lanes = _Lanes(remaining, weights)
    finishes: dict[str, float] = {}
    for org, lane in by_lane.items():
        ahead = 0
        for batch in sorted(lane, key=lambda b: b.turn(rescue=rescue)):
            ahead += batch.remaining
            finishes[batch.id] = now + lanes.work_until(ahead / weights[org]) / rps
    return finishes


def margin_s(batch: RunningBatch, fraction: float) -> float:
    """How long before its deadline a batch must be projected to finish to count as safe."""
    return fraction * max(0, batch.expires_at - batch.created_at)


def urgent_lanes(
    batches: Sequence[RunningBatch],
    finishes: dict[str, float],
    rps: float,
    now: float,
    margin_fraction: float,
) -> tuple[dict[str, int], set[str]]:
    """Lanes (by org) to serve before the others, each with the deadline to order them by;
    and the batches to rescue, which go before higher priorities of their own lane.

    A batch is late when it is projected to finish later than its deadline less the margin
    (``finishes``: projected without rescues, so that a rescue that works does not undo
    itself); its lane is urgent. A batch that would miss even with the model to itself is left
    out: giving it priority would only make the others late as well.
    """
    ahead: dict[str, int] = defaultdict(int)
    urgent: dict[str, int] = {}
    rescued: set[str] = set()
    for batch in sorted(batches, key=lambda b: (b.org_id, b.expires_at, b.id)):
        ahead[batch.org_id] += batch.remaining
        late = finishes[batch.id] > batch.expires_at - margin_s(batch, margin_fraction)
        hopeless = now + ahead[batch.org_id] / rps > batch.expires_at
        if late and not hopeless:
            urgent[batch.org_id] = min(urgent.get(batch.org_id, NOT_URGENT), batch.expires_at)
            rescued.add(batch.id)
    return urgent, rescued


def estimate_changed(old: int | None, new: int | None, now: float) -> bool:
    if old is None or new is None:
        return old != new
    return abs(new - old) > max(1.0, ESTIMATE_TOLERANCE * (new - now))


def plan(inputs: PlanInputs, now: float, margin_fraction: float) -> Plan:
    """Measure each model's rate, project its running batches and mark its urgent lanes."""
    lanes_of: dict[str, list[LaneLoad]] = defaultdict(list)
    for lane in inputs.lanes:
        lanes_of[lane.model].append(lane)
    running_of: dict[str, list[RunningBatch]] = defaultdict(list)
    for batch in inputs.running:
        running_of[batch.model].append(batch)
    previous = {rate.model: rate for rate in inputs.rates}
    up = replicas_up(inputs.engines, now)
    # A model whose engines run on demand and are all stopped or starting serves nothing
    # until one answers: its batches are projected from then.
    delays = start_delays(inputs.engines, now)

    rates: list[ModelRate] = []
    lane_plans: list[LanePlan] = []
    estimates: dict[str, int | None] = {}
    to_rescue: set[str] = set()
    to_calm: set[str] = set()
    for model in sorted(lanes_of.keys() | running_of.keys()):
        lanes = lanes_of.get(model, [])
        running = running_of.get(model, [])
        # Waiting for an engine's start, the model serves nothing however much work waits: a
        # window across the start would measure the start, which ``delays`` already counts.
        busy = any(lane.ready for lane in lanes) and model not in delays
        grown = sum(lane.served - lane.served_mark for lane in lanes)
        served = sum(lane.served for lane in lanes)
        rate = measure(previous.get(model), model, served, busy, now, up.get(model, 0))
        if rate != previous.get(model):
            rates.append(rate)
        finishes: dict[str, float] = {}
        urgent: dict[str, int] = {}
        rescued: set[str] = set()
        # A paused batch is served nothing: it neither delays the others nor finishes.
        active = [batch for batch in running if not batch.paused]
        if rate.rps:
            start = now + delays.get(model, 0.0)
            unrescued = project(active, rate.rps, start, rescue=False)
            urgent, rescued = urgent_lanes(active, unrescued, rate.rps, start, margin_fraction)
            # Estimates as claims will take the lines from now on: this plan's rescues.
            planned = [replace(batch, urgent=batch.id in rescued) for batch in active]
            finishes = project(planned, rate.rps, start)
        was_rescued = {batch.id for batch in running if batch.urgent}
        to_rescue |= rescued - was_rescued
        to_calm |= was_rescued - rescued
        for batch in running:
            new = math.ceil(finishes[batch.id]) if batch.id in finishes else None
            if estimate_changed(batch.estimate, new, now):
                estimates[batch.id] = new
        waits = lane_waits(lanes, running, inputs.leased, {model: rate.rps}, now)
        lane_plans += _with_waits(_lane_plans(lanes, grown, busy, urgent), lanes, waits)
    return Plan(rates, lane_plans, estimates, frozenset(to_rescue), frozenset(to_calm))


def _with_waits(
    plans: list[LanePlan], lanes: Sequence[LaneLoad], waits: dict[tuple[str, str], LaneWait | None]
) -> list[LanePlan]:
    """``plans`` with each lane's wait, and a plan that changes nothing else for each lane
    whose wait alone changed (its mark, share and urgency as read)."""
    planned = {plan.org_id for plan in plans}
    out = [replace(plan, wait=waits.get((plan.model, plan.org_id))) for plan in plans]
    for lane in lanes:
        wait = waits.get((lane.model, lane.org_id))
        moved = not (wait.same(lane.wait) if wait is not None else lane.wait is None)
        if lane.org_id not in planned and moved:
            out.append(
                LanePlan(
                    lane.model, lane.org_id, lane.served_mark, lane.share, lane.urgent_by, wait=wait
                )
            )
    return out


def _lane_plans(
    lanes: Sequence[LaneLoad], grown: int, busy: bool, urgent: dict[str, int]
) -> list[LanePlan]:
    plans = []
    moved = False  # whether any lane's plan changes more than its mark
    for lane in lanes:
        if grown > 0:
            share = (lane.served - lane.served_mark) / grown
        else:
            # Nothing claimed since the last plan: a busy model keeps the shares it had.
            share = lane.share if busy else 0.0
        urgent_by = urgent.get(lane.org_id, NOT_URGENT)
        forgiven = 0.0
        if lane.urgent_by < NOT_URGENT <= urgent_by:
            forgiven = _ahead_of_level(lane, lanes)
        changed = (share, urgent_by, forgiven) != (lane.share, lane.urgent_by, 0.0)
        moved = moved or changed
        if changed or lane.served != lane.served_mark:
            plans.append(LanePlan(lane.model, lane.org_id, lane.served, share, urgent_by, forgiven))
    if busy and not moved:
        # Only the marks moved (a busy model's one lane always has all of its share): the
        # next plan measures shares since the marks as they stand. Every lane of the model
        # keeps its mark together, so the shares still add up to the whole.
        return []
    return plans


def _ahead_of_level(lane: LaneLoad, lanes: Sequence[LaneLoad]) -> float:
    """How far a lane that stops being urgent ran ahead of the least-served busy lane of its
    model. Priority is not paid back: the lane rejoins level, as a lane that reopens does, so
    from here it gets its fair share, which is what its projection assumed."""
    others = [
        other.vtime
        for other in lanes
        if other.org_id != lane.org_id and other.ready and other.urgent_by == NOT_URGENT
    ]
    return max(0.0, lane.vtime - min(others)) if others else 0.0
