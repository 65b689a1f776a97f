"""How many batch requests Backfill may have in flight on one engine now (SPEC §9.5).

A ``dedicated`` engine is Backfill's alone: it is filled up to ``max_concurrency``. A ``shared``
engine also serves interactive traffic, and batch work takes only what that traffic leaves:

- from the engine's own load (vLLM or SGLang metrics) when it publishes it: the engine's
  sequence slots minus the interactive requests running or waiting there minus a headroom
  kept free for their next arrivals, and no more batch sequences than keep people's step
  time within their latency budget (``step_time``); people who wait for a slot anyway get
  Backfill's latest requests given back (``to_give_back``); nobody on the engine for a
  while: everything; without a known slot count, AIMD on its queue;
- otherwise from Backfill's own latency: AIMD on how far it rises over its recent floor;
- always: less on 429/503, nothing new until ``Retry-After`` has passed.

Pure state machines, driven by the runner: no clock of their own, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from backfill.domain.scheduling.step_time import MIN_TOKENS, StepTimeModel


class Mode(StrEnum):
    DEDICATED = "dedicated"
    SHARED = "shared"


class Signal(StrEnum):
    """What a shared engine's limit follows now."""

    FIXED = "fixed"
    METRICS = "metrics"
    BUDGET = "budget"
    """Metrics, and people's latency budget is what binds: the engine's step time would
    grow past it with more batch sequences."""
    LATENCY = "latency"


@dataclass(frozen=True, slots=True)
class Pressure:
    """An engine's load as its metrics report it, all requests counted (Backfill's too)."""

    running: float
    waiting: float
    kv_usage: float | None = None
    """Fraction of the KV cache in use, 0..1, when reported."""
    slots: float | None = None
    """Sequence slots the engine reports (SGLang's max running requests), when it does."""
    itl_sum_s: float | None = None
    itl_count: float | None = None
    """The engine's inter-token latency histogram so far (vLLM's
    ``inter_token_latency_seconds`` sum and count), when it publishes one."""
    steps: float | None = None
    """The engine's steps that produced tokens so far (the count of vLLM's
    ``iteration_tokens_total``), when it publishes them."""


@dataclass(frozen=True, slots=True)
class SharedTargets:
    """What a shared engine keeps for interactive traffic (settings; docs/scheduling.md)."""

    slots: int | None = None
    """The engine's sequence slots (vLLM ``--max-num-seqs``); unknown: AIMD on its queue."""
    headroom: float = 2.0
    """Slots always kept free for interactive arrivals, on top of ``headroom_sigmas``."""
    headroom_sigmas: float = 2.5
    """More free slots, in standard deviations of the interactive count (its square root,
    as for Poisson arrivals): busier engines swing more between two looks."""
    kv_target: float = 0.9
    """Above this KV-cache use Backfill starts nothing new."""
    latency_tolerance: float = 1.5
    """Latency over its floor (per output token) above which the latency signal backs off."""
    engine_priority: bool = False
    """The engine queues people ahead of Backfill's waiting requests (vLLM's priority
    scheduling, with a batch ``priority`` set). It never preempts a running request for
    them, so the headroom stays."""
    latency_budget: float = 1.10
    """How much slower people may be than without batch work (their time per token and to
    first token): caps batch sequences by the engine's learnt step time."""
    give_back: bool = True
    """People waiting for a slot get Backfill's most recently started requests given back
    (aborted, their lines back in the queue, uncharged, no attempt counted)."""
    idle_after_s: float = 5.0
    """An engine with no people on it for this long is Backfill's: it takes everything."""


LOOK_INTERVAL_S = 0.5
"""How often a shared engine's metrics are read by default (``worker.pressure_interval_s``).
Each read costs the engine: vLLM's API server spent 7 ms of CPU rendering its page, in the
event loop that streams people's tokens, so ten reads a second took 7% of it
(docs/scheduling.md). The step model's memory (``step_time.AGE``) is counted at this pace."""

# The latency signal: samples per round at least, and the floor's memory.
_ROUND_MIN_SAMPLES = 4
_FLOOR_BUCKET_S = 10.0
_FLOOR_BUCKETS = 6
# Under this inflation the engine is clearly idle for Backfill: grow fast to recover.
_CLEAR = 1.2
_DECREASE = 0.75
_OVERLOAD_DECREASE = 0.5
# A level whose latency inflated is not tried again for this long, twice as long each time
# it inflates again: probing it every other round would keep a one-sequence engine's
# queue (llama.cpp) full half of the time.
_CEILING_MIN_S = 5.0
_CEILING_MAX_S = 60.0
# People's count is smoothed over about this long: a few of their requests' durations.
_PEOPLE_MEAN_S = 2.0
# After giving requests back, the engine's gauges lag by a scrape or two: wait this long
# before giving back more.
_GIVE_BACK_GAP_S = 0.5


class ConcurrencyLimit:
    """One engine's limit on Backfill's requests in flight, never above ``maximum``."""

    def __init__(self, maximum: int, mode: Mode, targets: SharedTargets | None = None) -> None:
        self.maximum = maximum
        self.mode = mode
        self.targets = targets or SharedTargets()
        self.signal = Signal.FIXED if mode == Mode.DEDICATED else Signal.LATENCY
        # Shared engines start low and grow: a batch arriving on a busy engine must not
        # land its whole maximum at once before the first look at the engine's load.
        self.limit = maximum if mode == Mode.DEDICATED else max(1, min(maximum, 4))
        self.pressure = 0.0
        """What the limit follows, for operators: interactive requests seen on the engine
        (metrics), or the latency inflation over its floor (latency)."""
        self.paused_until = 0.0
        self._samples: list[float] = []
        self._floors: deque[tuple[float, float]] = deque()
        self._ceiling = 0
        self._ceiling_until = 0.0
        self._ceiling_wait_s = _CEILING_MIN_S
        self.steps = StepTimeModel()
        self.step_room: float | None = None
        """Batch sequences the latency budget allows now (None: not known, or not bound)."""
        self._last: Pressure | None = None
        # People's mean count over the last few seconds: the headroom is for their swings
        # around it, and a momentary dip must not let batch work fill slots that people will
        # want back before those requests end.
        self._people_mean = 0.0
        self._people_at: float | None = None
        self._people_seen_at: float | None = None
        self._first_look_at: float | None = None
        self._gave_back_at = -math.inf

    @property
    def shared(self) -> bool:
        return self.mode == Mode.SHARED

    def allowed(self, now: float) -> int:
        """Requests that may be in flight now."""
        return 0 if now < self.paused_until else self.limit

    def on_pressure(self, pressure: Pressure, own: int, now: float = 0.0) -> bool:
        """The engine's metrics were read at ``now`` while ``own`` of Backfill's requests were
        in flight on it; True when the limit changed."""
        if not self.shared:
            return False
        self.signal = Signal.METRICS
        before = self.limit
        interactive = max(0.0, pressure.running + pressure.waiting - own)
        self.pressure = interactive
        # The look a stretch starts from moves on only once the stretch made a sample: at one
        # sequence and ten looks a second a look sees two tokens, too few alone, so looks are
        # joined until they hold enough (without it the fit never saw one sequence at all).
        moves_on = self._learn_steps(pressure)
        if self._first_look_at is None:
            self._first_look_at = now
        if interactive > 0:
            self._people_seen_at = now
        slots = self.targets.slots or pressure.slots
        if slots and self._idle(now):
            # Nobody but Backfill for a while: all of it (people who come find a full
            # engine for at most one batch request, and their first wait gives slots back).
            limit = math.floor(slots)
        elif slots:
            mean = self._mean_people(interactive, now)
            limit = math.floor(slots - max(interactive, mean) - self._headroom(mean))
            people_running = max(0.0, pressure.running - own)
            self.step_room = self.steps.room(people_running, self.targets.latency_budget)
            if self.step_room is not None and self.step_room < limit:
                limit = math.floor(self.step_room)
                self.signal = Signal.BUDGET
            if pressure.waiting > 0 and not self.targets.engine_priority:
                # A queue at the engine: none of Backfill's may stand in it ahead of people.
                limit = min(limit, own - math.ceil(pressure.waiting))
        elif pressure.waiting > 0:
            limit = math.floor(self.limit * _DECREASE)
        else:
            limit = self.limit + max(1, self.limit // 8)
        if pressure.kv_usage is not None and pressure.kv_usage > self.targets.kv_target:
            limit = min(limit, own)
        self.limit = max(0, min(self.maximum, limit))
        if moves_on:
            self._last = pressure
        return self.limit != before

    def to_give_back(self, pressure: Pressure, own: int, now: float) -> int:
        """How many of Backfill's latest requests to give back now: people wait for a slot
        that Backfill holds. All of the excess over the limit at once, headroom included:
        giving back only as many as wait would leave the next person who comes within a
        look of the engine waiting too (on an engine that Backfill had filled while nobody
        was on it, every one of the first few). Not again until the engine has had a moment
        to see the last ones go."""
        slots = self.targets.slots or pressure.slots
        if (
            not self.shared
            or not self.targets.give_back
            or not slots
            or pressure.waiting <= 0
            or pressure.running < slots
            or now - self._gave_back_at < _GIVE_BACK_GAP_S
        ):
            return 0
        count = min(own - self.limit, own)
        if count > 0:
            self._gave_back_at = now
        return max(0, count)

    def _mean_people(self, interactive: float, now: float) -> float:
        """People's count smoothed over ``_PEOPLE_MEAN_S`` (an exponential moving mean)."""
        if self._people_at is None:
            self._people_mean = interactive
        else:
            weight = min(1.0, max(0.0, now - self._people_at) / _PEOPLE_MEAN_S)
            self._people_mean += weight * (interactive - self._people_mean)
        self._people_at = now
        return self._people_mean

    def _idle(self, now: float) -> bool:
        """No people on the engine now, nor for ``idle_after_s`` (since the first look, for
        an engine where none were ever seen)."""
        since = self._people_seen_at if self._people_seen_at is not None else self._first_look_at
        return self.pressure == 0 and since is not None and now - since >= self.targets.idle_after_s

    def _learn_steps(self, pressure: Pressure) -> bool:
        """One sample of step time against running sequences, from the inter-token latency
        histogram's growth since the look the stretch started at; False while the stretch
        holds too few tokens to make one (it goes on from the same look)."""
        last = self._last
        if (
            last is None
            or pressure.itl_sum_s is None
            or pressure.itl_count is None
            or last.itl_sum_s is None
            or last.itl_count is None
        ):
            return True
        tokens = pressure.itl_count - last.itl_count
        if 0 <= tokens < MIN_TOKENS:
            return False
        if tokens < 0:
            return True  # the engine restarted: its counters began again
        mean_step = (pressure.itl_sum_s - last.itl_sum_s) / tokens
        # The sequences that ran between the two looks: the tokens over the steps that made
        # them. The running gauge is only seen at the two ends, and their mean misreads a
        # stretch whose count jumped (a give-back, a burst of people) for a bend in the step.
        running = (pressure.running + last.running) / 2
        if pressure.steps is not None and last.steps is not None:
            steps = pressure.steps - last.steps
            if steps > 0:
                running = tokens / steps
        self.steps.observe(running, mean_step, tokens)
        return True

    def on_metrics_lost(self) -> None:
        """The engine's metrics could not be read: follow latency until they come back."""
        if self.shared and self.signal in (Signal.METRICS, Signal.BUDGET):
            self.signal = Signal.LATENCY
            self.limit = max(1, self.limit)

    def on_latency(self, latency_s: float, output_tokens: int, now: float) -> bool:
        """One of Backfill's requests succeeded in ``latency_s``; True when the limit changed.

        Latency is compared per output token (plus one, for the prompt), so long and short
        answers measure the same engine speed; the floor is the least seen in the last
        minute, so an engine that became slower for good is not punished for ever.
        """
        if self.signal != Signal.LATENCY:
            return False
        sample = latency_s / (output_tokens + 1)
        self._remember_floor(sample, now)
        self._samples.append(sample)
        if len(self._samples) < max(_ROUND_MIN_SAMPLES, self.limit):
            return False
        self._samples.sort()
        median = self._samples[len(self._samples) // 2]
        self._samples.clear()
        floor = min(f for _, f in self._floors)
        inflation = median / floor if floor > 0 else 1.0
        self.pressure = inflation
        before = self.limit
        if inflation > self.targets.latency_tolerance:
            self.limit = max(1, math.floor(before * _DECREASE))
            if before > 1:
                # A level that inflated again after its wait waits twice as long next time.
                again = before >= self._ceiling > 0
                wait = min(_CEILING_MAX_S, 2 * self._ceiling_wait_s) if again else _CEILING_MIN_S
                self._ceiling, self._ceiling_until, self._ceiling_wait_s = before, now + wait, wait
            return self.limit != before
        if self._ceiling and before >= self._ceiling:
            self._ceiling = 0  # the level that inflated held this time
        grown = before + max(1, before // 4) if inflation < _CLEAR else before + 1
        if self._ceiling and now < self._ceiling_until:
            grown = max(before, min(grown, self._ceiling - 1))
        self.limit = min(self.maximum, grown)
        return self.limit != before

    def on_overload(self, retry_after_s: float | None, now: float) -> None:
        """The engine answered 429 or 503: fewer requests, none new before ``Retry-After``."""
        if not self.shared:
            return
        self.limit = max(1, math.floor(self.limit * _OVERLOAD_DECREASE))
        self._samples.clear()
        if retry_after_s:
            self.paused_until = max(self.paused_until, now + retry_after_s)

    def _headroom(self, interactive: float) -> float:
        return self.targets.headroom + self.targets.headroom_sigmas * math.sqrt(interactive)

    def _remember_floor(self, sample: float, now: float) -> None:
        bucket = now // _FLOOR_BUCKET_S
        floors = self._floors
        if floors and floors[-1][0] == bucket:
            floors[-1] = (bucket, min(floors[-1][1], sample))
        else:
            floors.append((bucket, sample))
            while len(floors) > _FLOOR_BUCKETS:
                floors.popleft()
