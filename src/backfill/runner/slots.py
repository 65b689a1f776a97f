"""One engine's slot: how many requests it may take now, the claimed requests waiting for a
free place, and its last known health."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

from backfill.domain.engine_health import EngineHold, EngineState, HoldTracker
from backfill.domain.records import WorkBatch
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode, Pressure
from backfill.ports import Clock, Engine, Switch
from backfill.runner.give_back import Sends
from backfill.runner.inputs import Queued
from backfill.runner.slot_health import SlotHealth

# How often each engine's health is looked at while all are up (while one is down: more often).
# A slot that answered a request within it is up without being asked.
WATCH_S = 5.0
# The fewest claimed items an engine's backlog holds, and the fewest a claim takes.
MIN_PREFETCH = 2
# While an engine stays down its warning is repeated this often, and a flapping engine's
# outages with the same reason are not warned about more often (engine_down_log_interval_s).
DOWN_REMINDER_S = 300.0
# An engine started on demand that has not answered after this long is down, not starting:
# vLLM loading a large model from a slow disk takes minutes, a broken command never answers.
START_LIMIT_S = 900.0
# The weight of the newest start in the learnt start time: one slow start (a cold disk cache)
# moves it halfway, and the next normal one brings it back.
START_SMOOTHING = 0.5


Start = Callable[["EngineSlot", Queued], None]
"""Runs a queued request on the slot that just counted it in flight; must not block."""


class EngineSlot:
    """One engine: its in-flight count, its claimed backlog and its last known health.

    Only these methods change them. A request that ends calls ``done``; its slot goes at once
    to the next queued request (through ``start``), so a busy engine never waits for a claim
    round trip, and ``wake`` tells the dispatcher to claim more. Health checks are logged as
    ``HealthTracker`` decides (a warning with the reason when the engine is down, again every
    ``remind_s`` while it stays down, a flapping engine's outages at most that often), and
    ``changed`` is called when what they found moved.
    """

    def __init__(
        self,
        engine: Engine,
        start: Start,
        wake: Callable[[], None],
        limit: ConcurrencyLimit | None = None,
        switch: Switch | None = None,
        *,
        clock: Clock,
        remind_s: float = DOWN_REMINDER_S,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self._clock = clock
        self._health = SlotHealth(engine, clock, remind_s, changed)
        self.health = self._health.tracker
        self._changed = changed
        # What keeps it from taking batch work while up (429s, people), for its report.
        self._holds = HoldTracker()
        self.governor = limit or ConcurrencyLimit(engine.max_concurrency, Mode.DEDICATED)
        # Set for an engine started on demand (``OnDemand``); None: it runs all along.
        self.switch = switch
        # Requests ended, ever: an engine started on demand is idle while this stands still.
        self.finished = 0
        self.metrics_unread = 0
        """Reads of the engine's metrics that failed (a shared engine's load, SPEC §9.5)."""
        self._start = start
        self._wake = wake
        self._in_flight = 0
        # Its requests' engine calls, latest last: people waiting for a slot get those back.
        self.sends = Sends()
        self._backlog: deque[Queued] = deque()
        self._resume: asyncio.TimerHandle | None = None
        # Gone from the fleet (a replica that left): it starts nothing more, and is removed
        # once what runs there ended.
        self.retired = False
        # Started on demand and not answering yet: since when (monotonic).
        self._starting_since: float | None = None
        # How long its starts on demand took to answer, learnt (None: none timed yet).
        self.start_s: float | None = None

    @property
    def limit(self) -> int:
        """Requests this engine may have in flight now (its governor decides)."""
        governor = self.governor
        # Only an engine that was ever paused reads the clock: this runs on every start.
        return (
            governor.allowed(self._clock.monotonic()) if governor.paused_until else governor.limit
        )

    @property
    def prefetch(self) -> int:
        """Claimed items kept waiting for a free slot: a quarter of the limit's worth, and at
        least two. Half the limit took a tenth off the CPU per request, but a batch arriving
        behind another org's backlog then waited past its fair share's 1.2x. Two, not one, on
        a small engine lets each claim take two items (``claim_threshold``): one claim per
        request was most of what a worker spends waiting on a slow engine
        (docs/performance.md)."""
        limit = self.governor.limit
        return max(MIN_PREFETCH, limit // 4) if limit > 0 else 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def healthy(self) -> bool:
        return self._health.healthy

    @property
    def parked(self) -> bool:
        """An engine started on demand that is not running: down, without asking it."""
        return self.switch is not None and not self.switch.running

    @property
    def backlog(self) -> tuple[Queued, ...]:
        return tuple(self._backlog)

    @property
    def free(self) -> int:
        if not self._health.healthy or self.retired:
            return 0
        return max(0, self.limit - self._in_flight)

    @property
    def claim_threshold(self) -> int:
        """Claim once this many items are wanted: fewer, larger claims cost less CPU. Never
        more than ``prefetch``: a slot that frees up with the backlog empty wants more than
        that, so no slot waits for work that a claim could have brought."""
        return max(MIN_PREFETCH, self.prefetch // 2)

    @property
    def wanted(self) -> int:
        """How many more items to claim for this engine now."""
        limit = self.limit
        if not self._health.healthy or limit <= 0 or self.retired:
            return 0
        return max(0, limit + self.prefetch - self._in_flight - len(self._backlog))

    def offer(self, queued: Iterable[Queued]) -> None:
        """Queue claimed requests; as many as there are free slots start now."""
        self._backlog.extend(queued)
        self._fill()

    def offer_first(self, queued: Queued) -> None:
        """Queue a request ahead of the backlog: it was claimed before the backlog was, and
        only waited for its images (or a free slot starts it now)."""
        self._backlog.appendleft(queued)
        self._fill()

    def done(self) -> None:
        """A request started by this slot ended: its place goes to the next queued one."""
        if self._in_flight <= 0:
            raise RuntimeError(f"engine {self.engine.name}: a request ended that never started")
        self._in_flight -= 1
        self.finished += 1
        self._wake()
        self._fill()

    def succeeded(self, latency_s: float, output_tokens: int) -> None:
        """One of Backfill's requests got its answer in ``latency_s`` (the latency signal)."""
        now = self._clock.monotonic()
        self._health.answered(now)
        if self._holds.succeeded():
            self._changed()
        if self.governor.on_latency(latency_s, output_tokens, now):
            self._retune()

    def overloaded(
        self, retry_after_s: float | None, status: int = 429, retry_in_s: float | None = None
    ) -> None:
        """The engine answered ``status`` (429 or 503) and the request is tried again in
        ``retry_in_s`` (default: ``retry_after_s``): a shared engine takes fewer, after a
        pause, and the engine is reported rate limited until a request succeeds there."""
        governor = self.governor
        governor.on_overload(retry_after_s, self._clock.monotonic())
        if governor.paused_until and self._resume is None:
            delay = max(0.0, governor.paused_until - self._clock.monotonic())
            self._resume = asyncio.get_running_loop().call_later(delay, self._resumed)
        now = self._clock.now()
        retry_in = retry_in_s if retry_in_s is not None else retry_after_s or 0.0
        self._holds.overloaded(status, now, now + retry_in)
        # Each time: the stored report says when the next try is (the writer stores at most
        # one change every few seconds, however often the engine answers 429).
        self._changed()

    def hold(self) -> EngineHold | None:
        """What keeps it from taking batch work while up now (None: nothing)."""
        return self._holds.current(self._clock.now())

    def pressure(self, pressure: Pressure | None) -> None:
        """The engine's metrics were read (None: they could not be)."""
        governor = self.governor
        if pressure is None:
            self.metrics_unread += 1
            before = governor.limit
            governor.on_metrics_lost()
            if governor.limit != before:
                self._retune()
        else:
            now = self._clock.monotonic()
            if governor.on_pressure(pressure, self._in_flight, now):
                self._retune()
            self.sends.give_back(governor.to_give_back(pressure, self._in_flight, now))
        # People leave batch work nothing on a shared engine: its batches wait on them.
        if self._holds.people(governor.shared and governor.limit == 0, self._clock.now()):
            self._changed()

    def _resumed(self) -> None:
        self._resume = None
        # Another 429 may have moved the pause later while this timer waited: wait on.
        left = self.governor.paused_until - self._clock.monotonic()
        if left > 0:
            self._resume = asyncio.get_running_loop().call_later(left, self._resumed)
            return
        self._retune()

    def wake_in(self, delay_s: float) -> None:
        """Look for work again after ``delay_s``: a line this slot gave back with a backoff is
        claimable then, and nothing else would wake an idle dispatcher for it."""
        asyncio.get_running_loop().call_later(delay_s, self._wake)

    def _retune(self) -> None:
        """The limit moved: start what now fits, and claim more if it grew."""
        self._wake()
        self._fill()

    def retire(self) -> None:
        """Start nothing more here; the dispatcher gives the backlog back."""
        self.retired = True

    def drop(self, where: Callable[[WorkBatch], bool]) -> list[Queued]:
        """Take the queued requests of the batches ``where`` selects out of the backlog; the
        caller gives their leases back."""
        dropped: list[Queued] = []
        keep: deque[Queued] = deque()
        for queued in self._backlog:
            (dropped if where(queued.batch) else keep).append(queued)
        self._backlog = keep
        return dropped

    async def check_unless_answered(self) -> None:
        """The watch's look: an engine that answered a request within the watch's interval is
        up without being asked (a health request a second beside real ones would only cost
        CPU an engine on the same cores needs); any other is asked."""
        # Only while up: answers that came before it went down say nothing of it now.
        if not self.parked and self.healthy and self._health.answered_within(WATCH_S):
            self._observe(EngineState.UP)
        else:
            await self.check()

    async def check(self) -> bool:
        """Ask the engine whether it is up; one that comes back takes its backlog at once."""
        healthy = not self.parked and await self.engine.healthy()
        # Parked while it was asked: the answer came from a process that is stopping.
        if self.parked:
            self._observe(EngineState.STANDBY)
        elif healthy:
            self._started()
            self._observe(EngineState.UP)
        elif self._still_starting():
            self._observe(EngineState.STARTING)
        else:
            self._observe(EngineState.DOWN, self._health.error)
        return self._health.healthy

    def starting(self) -> None:
        """Its process was just started on demand: until it answers it is starting, not down,
        and the time it takes to answer is learnt."""
        self._starting_since = self._clock.monotonic()
        self._observe(EngineState.STARTING)

    def _still_starting(self) -> bool:
        since = self._starting_since
        if since is not None and self._clock.monotonic() - since >= START_LIMIT_S:
            self._starting_since = None
        return self._starting_since is not None

    def _started(self) -> None:
        since, self._starting_since = self._starting_since, None
        if since is None:
            return
        took = self._clock.monotonic() - since
        learnt = self.start_s
        self.start_s = took if learnt is None else learnt + START_SMOOTHING * (took - learnt)

    def down(self) -> None:
        """Take no more work: the engine is about to stop (on purpose: standby)."""
        self._starting_since = None
        self._observe(EngineState.STANDBY)

    @property
    def url(self) -> str | None:
        return self._health.url

    def _observe(self, state: EngineState, reason: str | None = None) -> None:
        if state != EngineState.UP:
            self._holds.reset()
        if self._health.observe(state, reason):
            self._wake()
            self._fill()

    def _fill(self) -> None:
        while self.free > 0 and self._backlog:
            queued = self._backlog.popleft()
            self._in_flight += 1
            self._start(self, queued)
