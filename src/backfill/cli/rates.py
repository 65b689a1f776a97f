"""Tokens per second and time left for ``backfill batch run``'s progress line.

Both come from successive polls of the batch object: the rates are the growth of its counts
between polls, smoothed so one slow poll does not make the figures jump. The time left is the
server's ``estimated_completion_at`` when it gives one (its planner sees every batch sharing the
engines); otherwise the lines left at the smoothed rate of lines done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# How quickly the smoothed rates follow a change: a sample this old weighs half.
HALF_LIFE_S = 10.0


def smooth(previous: float | None, sample: float, dt_s: float, half_life_s: float) -> float:
    """An exponentially weighted mean whose weight depends on the time between samples, so
    irregular polls give the same curve as regular ones."""
    if previous is None:
        return sample
    keep = math.exp(-math.log(2) * dt_s / half_life_s)
    return keep * previous + (1.0 - keep) * sample


@dataclass(frozen=True, slots=True)
class Sample:
    """What one poll says: when (monotonic seconds), lines ended, tokens counted."""

    at_s: float
    lines: int
    tokens: int


def sample_of(batch: dict[str, Any], at_s: float) -> Sample:
    """Lines ended (completed or failed) and tokens: output tokens, or for a batch that
    generates none (embeddings) its total tokens."""
    counts = batch.get("request_counts") or {}
    usage = batch.get("usage") or {}
    output = int(usage.get("output_tokens") or 0)
    tokens = output if output else int(usage.get("total_tokens") or 0)
    return Sample(at_s, int(counts.get("completed", 0)) + int(counts.get("failed", 0)), tokens)


class Throughput:
    """Smoothed lines/s and tokens/s over the samples seen so far (None before two)."""

    def __init__(self, half_life_s: float = HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self.lines_per_s: float | None = None
        self.tokens_per_s: float | None = None
        self._last: Sample | None = None

    def observe(self, sample: Sample) -> None:
        last, self._last = self._last, sample
        if last is None:
            return
        dt = sample.at_s - last.at_s
        if dt <= 0:
            return
        if sample.lines < last.lines or sample.tokens < last.tokens:
            # Counts only grow within one batch; a drop means they restarted: so do the rates.
            self.lines_per_s = self.tokens_per_s = None
            return
        lines = (sample.lines - last.lines) / dt
        tokens = (sample.tokens - last.tokens) / dt
        self.lines_per_s = smooth(self.lines_per_s, lines, dt, self.half_life_s)
        self.tokens_per_s = smooth(self.tokens_per_s, tokens, dt, self.half_life_s)


def seconds_left(
    *,
    remaining_lines: int,
    lines_per_s: float | None,
    estimated_completion_at: float | None,
    now: float,
) -> float | None:
    """Seconds until the batch's lines are done, or None while there is nothing to go on.
    ``now`` is wall time (Unix seconds), the clock ``estimated_completion_at`` is on; an
    estimate already past (the batch runs late) gives way to the measured rate."""
    if remaining_lines <= 0:
        return 0.0
    if estimated_completion_at is not None and estimated_completion_at > now:
        return estimated_completion_at - now
    if lines_per_s:
        return remaining_lines / lines_per_s
    return None


def format_rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "- tok/s"
    if tokens_per_s >= 10_000:
        return f"{tokens_per_s / 1000:.0f}k tok/s"
    if tokens_per_s >= 1000:
        return f"{tokens_per_s / 1000:.1f}k tok/s"
    if tokens_per_s >= 10:
        return f"{tokens_per_s:.0f} tok/s"
    return f"{tokens_per_s:.1f} tok/s"


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA -"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours >= 24:
        return f"ETA {hours // 24}d{hours % 24:02d}h"
    if hours:
        return f"ETA {hours}h{minutes:02d}m"
    if minutes:
        return f"ETA {minutes}m{secs:02d}s"
    return f"ETA {secs}s"
