"""An engine's step time against its running sequences, learnt online (docs/scheduling.md).

On a real engine every running sequence makes every decode step longer: a step of vLLM's CPU
build with SmolLM2-135M took 27 ms with one sequence and about 51 ms with 16. So each batch
sequence slows every person's tokens, and a latency budget for people (their time per token
and time to first token, at most ``budget`` times what it is without batch work) caps how
many batch sequences may run beside them.

The model is a line, ``step(n) = base + per_seq * n``, fitted by least squares over recent
samples, each weighted by the tokens it covers and forgotten geometrically so an engine that
changed (another model, a neighbour on its cores) is followed. A sample is the mean time
between two tokens over a stretch (vLLM's ``inter_token_latency_seconds`` histogram, its sum
and count between two scrapes) with the mean number of running sequences over the same
stretch.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Each new sample multiplies the weight of what came before by this: the fit follows roughly
# the last 1 / (1 - FORGET) samples (at ten scrapes a second, the last ten seconds or so).
FORGET = 0.99
# A slope is trusted once the samples spread over this many sequences (in standard
# deviations of their running counts): a fit over one level says nothing about the next.
MIN_SPREAD = 1.0
# Samples covering fewer tokens than this are noise (a scrape that saw two tokens).
MIN_TOKENS = 4


@dataclass(frozen=True, slots=True)
class StepLine:
    base_s: float
    per_seq_s: float

    def step_s(self, running: float) -> float:
        return self.base_s + self.per_seq_s * running


class StepTimeModel:
    def __init__(self, forget: float = FORGET) -> None:
        self._forget = forget
        # Weighted sums: weight, x, y, x², xy (x: running sequences, y: step seconds).
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, running: float, step_s: float, tokens: float) -> None:
        """``tokens`` inter-token gaps averaged ``step_s`` while ``running`` sequences ran."""
        if tokens < MIN_TOKENS or step_s <= 0 or running < 0:
            return
        f = self._forget
        w = math.sqrt(tokens)  # many tokens are a surer mean, but one scrape must not rule
        self._w = self._w * f + w
        self._x = self._x * f + w * running
        self._y = self._y * f + w * step_s
        self._xx = self._xx * f + w * running * running
        self._xy = self._xy * f + w * running * step_s

    @property
    def line(self) -> StepLine | None:
        """The fitted line, or None until the samples spread over enough running counts."""
        if self._w <= 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < MIN_SPREAD * MIN_SPREAD:
            return None
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        # Sequences never make steps shorter: a negative slope is noise, read as flat.
        slope = max(0.0, slope)
        base = max(1e-6, mean_y - slope * mean_x)
        return StepLine(base, slope)

    def room(self, people: float, budget: float) -> float | None:
        """How many batch sequences may run beside ``people`` running sequences so that a
        step is at most ``budget`` times as long as theirs alone; None while unknown, or
        unbounded (an engine whose steps do not grow with sequences)."""
        line = self.line
        if line is None or line.per_seq_s <= 0:
            return None
        return (budget - 1.0) * line.step_s(people) / line.per_seq_s
