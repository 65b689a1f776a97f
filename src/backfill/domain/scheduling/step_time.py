"""An engine's step time against its running sequences, learnt online (docs/scheduling.md).

On a real engine every running sequence makes every decode step longer: a step of vLLM's CPU
build with SmolLM2-135M took 27 ms with one sequence and about 51 ms with 16. So each batch
sequence slows every person's tokens, and a latency budget for people (their time per token
and time to first token, at most ``budget`` times what it is without batch work) caps how
many batch sequences may run beside them.

The step need not grow in a line. On two cores, vLLM's step stayed near 36 ms from one to
four sequences and doubled at eight, once its sequences no longer fitted the cores (a GPU
bends the same way, where decode turns from memory-bound to compute-bound); a line through
those three levels was a third short at one sequence. So the model is a curve that may bend
upwards, ``step(n) = base + per_seq * n + per_seq2 * n²``, fitted by least squares over the
samples, each weighted by the tokens it covers.

Samples are remembered per running count. A new sample at a count replaces what that count
knew (over its last twenty samples or so), and every sample ages all counts a little, so an
engine that changed (another model, a neighbour on its cores) is followed within a minute or
so. Forgetting over time alone would forget the curve's shape: an engine runs near one count
for a long while (the governor holds it there), and after half a minute at four and eight
sequences the samples at one were nearly gone, leaving a line through four and eight that
overstated the step at one by three quarters (seen on a real vLLM run at 1, then 4, then 8
sequences).

The curve is a line (``per_seq2`` 0) until the samples spread over enough running counts to
show a bend, and whenever the bend they show is downwards: more sequences never make a step
shorter, so a curve that would fall is noise. A sample is the mean time between two tokens
over a stretch (vLLM's ``inter_token_latency_seconds`` histogram, its sum and count between
two scrapes) with the mean number of running sequences over the same stretch.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A new sample at a running count multiplies what that count knew by this: a count follows
# roughly its last 1 / (1 - FORGET) samples.
FORGET = 0.95
# Every sample multiplies what every count knew by this: a count not seen again fades over
# roughly 1 / (1 - AGE) samples (at two looks a second, concurrency.LOOK_INTERVAL_S: about
# a minute).
AGE = 0.99
# A slope is trusted once the samples spread over this many sequences (in standard
# deviations of their running counts): a fit over one level says nothing about the next.
MIN_SPREAD = 1.0
# A bend is trusted once the squares of the running counts spread this far (in sequences²,
# a standard deviation) beyond what a line through the counts explains: three levels, not
# two, and far enough apart. Levels 1, 4 and 8 spread 5.7; 3, 4 and 5 only 0.5.
MIN_BEND_SPREAD = 2.0
# Samples covering fewer tokens than this are noise (a scrape that saw two tokens).
MIN_TOKENS = 4


@dataclass(frozen=True, slots=True)
class StepCurve:
    base_s: float
    per_seq_s: float
    per_seq2_s: float = 0.0

    @property
    def _lowest(self) -> float:
        """Where the curve is lowest: below it the fit would fall, which steps never do."""
        if self.per_seq2_s <= 0 or self.per_seq_s >= 0:
            return 0.0
        return -self.per_seq_s / (2 * self.per_seq2_s)

    def step_s(self, running: float) -> float:
        n = max(running, self._lowest)
        return max(1e-6, self.base_s + self.per_seq_s * n + self.per_seq2_s * n * n)

    def reaches(self, step_s: float) -> float | None:
        """The running count at which a step takes ``step_s``; None if it never does."""
        a, b, c = self.base_s - step_s, self.per_seq_s, self.per_seq2_s
        if c > 0:
            root = math.sqrt(max(0.0, b * b - 4 * c * a))
            # The larger root, in the form that does not cancel: with b > 0 and a tiny bend,
            # (-b + root) / 2c would be the difference of two near-equal numbers.
            return -2 * a / (b + root) if b > 0 else (-b + root) / (2 * c)
        if b > 0:
            return -a / b
        return None


class StepTimeModel:
    def __init__(self, forget: float = FORGET, age: float = AGE) -> None:
        self._forget = forget
        self._age = age
        # Per running count (the nearest whole sequence): weighted sums of weight, then x,
        # x², x³, x⁴, y, xy, x²y (x: running sequences, y: step seconds).
        self._counts: dict[int, list[float]] = {}

    def observe(self, running: float, step_s: float, tokens: float) -> None:
        """``tokens`` inter-token gaps averaged ``step_s`` while ``running`` sequences ran."""
        if tokens < MIN_TOKENS or step_s <= 0 or running < 0:
            return
        for sums in self._counts.values():
            for i in range(len(sums)):
                sums[i] *= self._age
        sums = self._counts.setdefault(round(running), [0.0] * 8)
        w = math.sqrt(tokens)  # many tokens are a surer mean, but one scrape must not rule
        x, y = running, step_s
        terms = (1.0, x, x * x, x**3, x**4, y, x * y, x * x * y)
        f = self._forget
        sums[:] = [s * f + w * t for s, t in zip(sums, terms, strict=True)]

    @property
    def curve(self) -> StepCurve | None:
        """The fitted curve, or None until the samples spread over enough running counts."""
        total = [sum(column) for column in zip(*self._counts.values(), strict=True)]
        if not total or total[0] <= 0:
            return None
        x, x2, x3, x4, y, xy, x2y = (s / total[0] for s in total[1:])
        var_x = x2 - x * x
        if var_x < MIN_SPREAD * MIN_SPREAD:
            return None
        # Least squares on 1, x and x², by first taking from x² and y what a line in x explains.
        cov_xy = xy - x * y
        cov_x_x2 = x3 - x * x2
        var_x2 = x4 - x2 * x2
        cov_x2_y = x2y - x2 * y
        bend_var = var_x2 - cov_x_x2 * cov_x_x2 / var_x
        per_seq2 = 0.0
        if bend_var >= MIN_BEND_SPREAD * MIN_BEND_SPREAD:
            per_seq2 = max(0.0, (cov_x2_y - cov_x_x2 * cov_xy / var_x) / bend_var)
        if per_seq2 > 0:
            slope = (cov_xy - per_seq2 * cov_x_x2) / var_x
            bent = StepCurve(y - slope * x - per_seq2 * x2, slope, per_seq2)
            # A bend so sharp that the curve dips to nothing at its lowest (``step_s(0)``,
            # flattened there) is no step an engine takes: the line says more.
            if bent.step_s(0) > 1e-6:
                return bent
        # Sequences never make steps shorter: a negative slope is noise, read as flat.
        slope = max(0.0, cov_xy / var_x)
        return StepCurve(max(1e-6, y - slope * x), slope)

    def room(self, people: float, budget: float) -> float | None:
        """How many batch sequences may run beside ``people`` running sequences so that a
        step is at most ``budget`` times as long as theirs alone; None while unknown, or
        unbounded (an engine whose steps do not grow with sequences)."""
        curve = self.curve
        if curve is None:
            return None
        reached = curve.reaches(budget * curve.step_s(people))
        if reached is None:
            return None
        return max(0.0, reached - people)
