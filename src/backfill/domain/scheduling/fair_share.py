"""Weighted fair share of dispatch: org weights and how one claim is split among its lanes.

A lane is one (model, org) pair. Each lane keeps a virtual time: the lines claimed from it
divided by its org's weight. The claim serves the lanes with the least virtual time, so over
any stretch in which two lanes both have work, they get lines in the ratio of their weights.
Shares are counted in requests (lines claimed), not tokens: a line's tokens are known only
once the engine has answered it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_WEIGHT = 1
MIN_WEIGHT = 1
# Three orders of magnitude between the lightest and the heaviest org: enough for tiers, and
# a lane's virtual time still moves by at least 1/1000 per line.
MAX_WEIGHT = 1000


class WeightRefused(ValueError):
    """A weight that is not a whole number within the allowed range; the message says why, in
    the words a client is shown (the service turns it into a 400 naming ``param``)."""

    param = "weight"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def check_weight(weight: object) -> int:
    """``weight`` if it is a whole number within the allowed range, else ``WeightRefused``."""
    if isinstance(weight, bool) or not isinstance(weight, int):
        raise WeightRefused(f"'weight' must be a whole number from {MIN_WEIGHT} to {MAX_WEIGHT}.")
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise WeightRefused(f"'weight' must be from {MIN_WEIGHT} to {MAX_WEIGHT} (it is {weight}).")
    return weight


def vtime_step(lines: int, weight: int) -> float:
    """How far a lane's virtual time moves when ``lines`` of it are claimed."""
    return lines / weight


@dataclass(frozen=True, slots=True)
class LaneTurn:
    """A lane as one claim sees it: where it stands, and what its picked chunk can give."""

    vtime: float
    """Lines claimed from the lane so far, divided by its weight (levelled when it reopens)."""
    weight: int
    urgent: bool
    """The planner found a batch of this lane about to miss its deadline."""
    room: int
    """The most lines the lane's picked chunk can give to this claim."""


def split_claim(limit: int, lanes: Sequence[LaneTurn]) -> list[int]:
    """How many of ``limit`` lines each lane gets, in the order given.

    Urgent lanes come first, in the order given (the claim orders them by deadline), each
    taking as much as its chunk holds. The rest goes line by line to the lane whose virtual
    time would then be least (weighted fair queueing), so the split follows the weights and a
    lane that fell behind in an earlier claim catches up here, rounding included.
    """
    shares = [0] * len(lanes)
    left = max(0, limit)
    for i, lane in enumerate(lanes):
        if lane.urgent and left:
            shares[i] = min(left, max(0, lane.room))
            left -= shares[i]
    # (virtual time after one more line, position): ties go to the lane picked first.
    turns = [
        (lane.vtime + vtime_step(1, lane.weight), i, lane)
        for i, lane in enumerate(lanes)
        if not lane.urgent and lane.room > 0
    ]
    heapq.heapify(turns)
    while left and turns:
        _, i, lane = heapq.heappop(turns)
        shares[i] += 1
        left -= 1
        if shares[i] < lane.room:
            heapq.heappush(turns, (lane.vtime + vtime_step(shares[i] + 1, lane.weight), i, lane))
    return shares
