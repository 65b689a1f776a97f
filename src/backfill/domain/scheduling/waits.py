"""Why a lane's batches wait, as the planner finds it at each pass from what the claim decided:
the credit gate holds the lane, or other orgs' lines fill the engines while none of its own
are out (``domain/waiting.py`` shows it on the batch).

Pure: the planner reads the lanes (their credit gate, weights and the wait stored last time),
its running batches and which of them have lines leased, and stores what changed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from backfill.domain.money import gpu_time_charge
from backfill.domain.waiting import LaneWait, WaitCode

if TYPE_CHECKING:
    from backfill.domain.scheduling.planning import LaneLoad, RunningBatch

Key = tuple[str, str]
"""A lane: (model, org)."""


def lane_waits(
    lanes: Sequence[LaneLoad],
    running: Sequence[RunningBatch],
    leased: Collection[str],
    rates: Mapping[str, float | None],
    now: float,
) -> dict[Key, LaneWait | None]:
    """Every lane's wait now (None: its batches do not wait on their lane).

    - CREDIT: the lane has ready work that the claim's credit gate holds back (a GPU-time
      lane of an org without credit).
    - FAIR_SHARE: the lane has ready work the claim may take, none of its lines are out
      (claimed or running: ``leased`` names the running batches that have some), and other
      orgs' lines of the model are: the engines are busy with them.

    A reason found again keeps the ``since`` stored with it, unless a line of the lane was
    claimed in between (it moved meanwhile). ``rates``: each model's measured
    requests per second (None: not measured), to say what a held GPU-time lane's lines cost.
    """
    batches: dict[Key, list[RunningBatch]] = defaultdict(list)
    served: dict[str, set[str]] = defaultdict(set)
    for batch in running:
        if batch.remaining > 0:
            batches[(batch.model, batch.org_id)].append(batch)
        if batch.id in leased:
            served[batch.model].add(batch.org_id)
    weights = {(lane.model, lane.org_id): lane.weight for lane in lanes}
    # Orgs whose lane the claim may take now, by model (a lane held for credit is not one).
    ready: dict[str, set[str]] = defaultdict(set)
    for lane in lanes:
        if lane.ready and (lane.model, lane.org_id) in batches:
            ready[lane.model].add(lane.org_id)
    waits: dict[Key, LaneWait | None] = {}
    for lane in lanes:
        key = (lane.model, lane.org_id)
        found: LaneWait | None = None
        mine = batches.get(key)
        others = served[lane.model] - {lane.org_id}
        if mine and lane.gated:
            found = _credit(lane, mine, rates.get(lane.model))
        elif mine and lane.ready and lane.org_id not in served[lane.model] and others:
            # Every org with work on the model: those with lines out and those ready.
            working = served[lane.model] | ready[lane.model]
            total = sum(weights.get((lane.model, org), 1) for org in working)
            found = LaneWait(
                WaitCode.FAIR_SHARE,
                0,
                others=len(others),
                weight=lane.weight,
                total_weight=total,
            )
        if found is not None:
            # The same reason, and no line of the lane claimed since: it held all along.
            stored = lane.wait
            kept = stored is not None and (stored.code, stored.served) == (found.code, lane.served)
            since = stored.since if kept and stored else int(now)
            found = replace(found, since=since, served=lane.served)
        waits[key] = found
    return waits


def _credit(lane: LaneLoad, batches: list[RunningBatch], rps: float | None) -> LaneWait:
    lines = sum(batch.remaining for batch in batches)
    needed = None
    if rps and lane.gpu_count and lane.gpu_price:
        # The deployment is busy for its lines at its measured pace; GPU time is its cost.
        needed = gpu_time_charge(lane.gpu_count, lane.gpu_price, math.ceil(lines / rps * 1000))
    return LaneWait(WaitCode.CREDIT, 0, balance=lane.balance, lines=lines, needed=needed)
