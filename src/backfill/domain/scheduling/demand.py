"""What each model's queue asks of its fleet, for an autoscaler: the work accepted and not done
yet, the rate one replica serves, and how many replicas finish every accepted batch before its
deadline less the planner's margin (docs/deployment.md, "Autoscaling on Backfill's demand").

Pure: the store reads ``DemandInputs`` (stored state only: batch counters, the planner's
measured rates, the workers' engine reports), so every process that reads them at one moment
computes the same figures; ``demand`` turns them into one ``ModelDemand`` per model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from backfill.domain.engine_health import EngineReport, replicas_up

# The most replicas the figure asks for. A batch whose deadline (less its margin) has come
# would need an unbounded rate; it asks for as many as this, and an autoscaler's own maximum
# (KEDA's maxReplicaCount) decides how many it gets.
MAX_REPLICAS_NEEDED = 10_000
# A deadline less its margin that is this near, or past, counts as this far away: the
# figure stays finite (and capped) instead of dividing by zero or going negative.
MIN_SLACK_S = 1.0
# Rounding slack, so a need of exactly 2 replicas computed as 2.0000000001 stays 2.
_ROUNDING = 1e-9


@dataclass(frozen=True, slots=True)
class QueuedBatch:
    """A batch whose lines are still to be served (validating or in progress)."""

    model: str
    remaining: int
    """Lines not yet finished (queued or running)."""
    tokens_bound: int
    """Tokens its remaining lines may take at most: its input file's prompt bound (counted at
    upload, at most the context length a line) plus its lines' output limits, scaled to the
    share of lines not finished."""
    created_at: int
    expires_at: int


@dataclass(frozen=True, slots=True)
class DemandInputs:
    queued: Sequence[QueuedBatch]
    per_replica: Mapping[str, float | None]
    """The planner's measured rate of one replica, requests per second, by model (every model
    it has measured or started measuring; None: not measured yet)."""
    engines: Sequence[EngineReport]
    """The workers' stored engine reports: how many replicas of each model are up."""


@dataclass(frozen=True, slots=True)
class ModelDemand:
    model: str
    queued_requests: int
    queued_tokens_bound: int
    replicas: int
    """Replicas up now (engines some live worker's health check finds answering)."""
    per_replica_rps: float | None
    replicas_needed: int
    deadline_margin_fraction: float
    """The margin the figure keeps before each deadline, as a part of its batch's window."""


def target(batch: QueuedBatch, margin_fraction: float) -> float:
    """When the batch should be done: its deadline less the planner's margin."""
    return batch.expires_at - margin_fraction * max(0, batch.expires_at - batch.created_at)


def required_rps(batches: Iterable[QueuedBatch], now: float, margin_fraction: float) -> float:
    """The least total rate (requests per second) that finishes every batch by its target,
    serving the earliest target first: for every target t, the lines due by t over the time
    left until t. Targets nearer than ``MIN_SLACK_S`` (or past) count as that far away."""
    due = sorted((target(b, margin_fraction), b.remaining) for b in batches if b.remaining > 0)
    need, lines = 0.0, 0
    for when, remaining in due:
        lines += remaining
        need = max(need, lines / max(when - now, MIN_SLACK_S))
    return need


def replicas_needed(
    batches: Sequence[QueuedBatch],
    per_replica: float | None,
    replicas: int,
    now: float,
    margin_fraction: float,
) -> int:
    """The fewest replicas that finish every batch by its deadline less the margin, at
    ``per_replica`` requests per second each (at most ``MAX_REPLICAS_NEEDED``).

    0 with nothing queued. At least 1 while anything is: an autoscaler at zero replicas starts
    one. Until one replica's rate is measured, the replicas up now (at least 1): the fleet is
    kept while its first measurement is made, and neither grown nor shrunk on a guess.
    """
    if not any(b.remaining > 0 for b in batches):
        return 0
    if not per_replica or per_replica <= 0:
        return min(max(1, replicas), MAX_REPLICAS_NEEDED)
    need = required_rps(batches, now, margin_fraction) / per_replica
    if need >= MAX_REPLICAS_NEEDED:
        return MAX_REPLICAS_NEEDED
    return max(1, math.ceil(need - _ROUNDING))


def demand(
    inputs: DemandInputs, now: float, margin_fraction: float, also: Iterable[str] = ()
) -> list[ModelDemand]:
    """One figure per model with queued work, a measured rate or a replica up (and each of
    ``also``), by model name. A model stays listed once its work is done, at 0 needed, as long
    as the planner keeps its rate: an autoscaler reads the 0 and scales it down."""
    queued: dict[str, list[QueuedBatch]] = defaultdict(list)
    for batch in inputs.queued:
        queued[batch.model].append(batch)
    up = replicas_up(inputs.engines, now)
    models = sorted(set(queued) | set(inputs.per_replica) | set(up) | set(also))
    found = []
    for model in models:
        batches = queued.get(model, [])
        per_replica = inputs.per_replica.get(model)
        replicas = up.get(model, 0)
        found.append(
            ModelDemand(
                model=model,
                queued_requests=sum(b.remaining for b in batches),
                queued_tokens_bound=sum(b.tokens_bound for b in batches),
                replicas=replicas,
                per_replica_rps=per_replica,
                replicas_needed=replicas_needed(
                    batches, per_replica, replicas, now, margin_fraction
                ),
                deadline_margin_fraction=margin_fraction,
            )
        )
    return found
