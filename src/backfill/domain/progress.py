"""A batch's progress over time, read back from when its results were stored.

Every stored result carries its number in the batch (``done_seq``: 1, 2, … in the order they
were stored) and when its request ended by the worker's clock (``done_at``; the results a
write stores together share the latest of their times, so times never go back along the
numbers). So "``n`` results were done by time ``t``" is the time of result ``n``, and a
curve of any length costs a lookup of a few numbers on the results index, however many lines
the batch has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_POINTS = 120
"""Points a curve has at most: enough for a chart a few hundred pixels wide."""


@dataclass(frozen=True, slots=True)
class ProgressPoint:
    at: float
    """Unix seconds."""
    done: int
    """Results stored (completed and failed) by ``at``."""


@dataclass(frozen=True, slots=True)
class BatchProgress:
    total: int
    """The batch's lines."""
    points: tuple[ProgressPoint, ...]
    """By ``done``, increasing; empty when the batch has no result yet, or when its results
    were stored before their times were kept."""


def sampled_seqs(last: int, max_points: int = MAX_POINTS) -> list[int]:
    """The result numbers a curve of at most ``max_points`` reads when ``last`` results are
    stored: all of them up to ``max_points``, evenly spaced beyond that, always with the first
    and the last."""
    if max_points < 2:
        raise ValueError("a curve needs at least its two ends")
    if last <= max_points:
        return list(range(1, last + 1))
    # The step is over 1 here, so the floors are distinct; k = 0 gives 1, the last k gives last.
    return [1 + k * (last - 1) // (max_points - 1) for k in range(max_points)]


def curve(seqs: Sequence[int], times: Mapping[int, float | None]) -> tuple[ProgressPoint, ...]:
    """The points of ``seqs`` (increasing) from the times their results were stored; none at
    all if one of them has no time (stored before times were kept, or not there): a partial
    curve could be read as the batch's whole history.

    Each write takes its time from the clock of the worker that stored it; workers' clocks
    differ a little, so a time is never drawn earlier than one before it."""
    points: list[ProgressPoint] = []
    latest = float("-inf")
    for seq in seqs:
        at = times.get(seq)
        if at is None:
            return ()
        latest = max(latest, at)
        points.append(ProgressPoint(latest, seq))
    return tuple(points)
