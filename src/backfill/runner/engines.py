"""Engine slots and health: how many requests each engine may take now, the claimed requests
waiting for one, and the engines that run only while work waits for them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backfill.domain.engine_health import EngineState, HealthTracker, Note, NoteKind
from backfill.domain.records import ClaimedItem, WorkBatch
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode, Pressure
from backfill.ports import Engine, EngineDiagnostics, PressureProbe, WaitingWork
from backfill.runner.inputs import ClaimInput

log = logging.getLogger("backfill.runner")


@dataclass(frozen=True, slots=True)
class Queued:
    """A claimed request waiting for a free slot of its engine; ``body``, when set, is what
    its engine is sent (decoded before the slot, its remote images already inline)."""

    batch: WorkBatch
    item: ClaimedItem
    input: ClaimInput
    body: dict[str, Any] | None = None


Start = Callable[["EngineSlot", Queued], None]
"""Runs a queued request on the slot that just counted it in flight; must not block."""

# A shared engine whose metrics cannot be read is looked at again this much later.
_PROBE_RETRY_S = 5.0
# How often each engine's health is looked at while all are up (while one is down: more often).
_WATCH_S = 5.0
_WATCH_DOWN_S = 0.5
# The fewest claimed items an engine's backlog holds, and the fewest a claim takes.
MIN_PREFETCH = 2
# An engine started on demand stops after this long without a request: idle, its process
# still holds CPU threads and the model's memory, and starting it again takes seconds.
IDLE_STOP_S = 600.0
# How often the queue is asked whether work waits for an engine started on demand that is not
# running: a start takes seconds anyway, and a read every few seconds is little next to the
# dispatcher's claims, several a second.
ON_DEMAND_CHECK_S = 2.0
# While an engine stays down its warning is repeated this often, and a flapping engine's
# outages with the same reason are not warned about more often (engine_down_log_interval_s).
DOWN_REMINDER_S = 300.0


class Switch(Protocol):
    """The process of an engine that runs only while work waits for it."""

    @property
    def running(self) -> bool:
        """Started and not stopped since (it may not answer yet)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """End the process; ``running`` is False from the call on."""
        ...


@dataclass(frozen=True, slots=True)
class Sharing:
    """How the engines are shared with interactive traffic, by engine name: each named one
    has its own adaptive limit (and a metrics probe when it publishes its load); the others
    are dedicated, filled up to their ``max_concurrency``."""

    limits: Mapping[str, ConcurrencyLimit] = field(default_factory=dict)
    probes: Mapping[str, PressureProbe] = field(default_factory=dict)
    probe_interval_s: float = 0.1


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
        now: Callable[[], float] = time.time,
        remind_s: float = DOWN_REMINDER_S,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self._now = now
        self._changed = changed
        self.health = HealthTracker(now(), remind_s=remind_s)
        self.governor = limit or ConcurrencyLimit(engine.max_concurrency, Mode.DEDICATED)
        # Set for an engine started on demand (``OnDemand``); None: it runs all along.
        self.switch = switch
        # Requests ended, ever: an engine started on demand is idle while this stands still.
        self.finished = 0
        self._start = start
        self._wake = wake
        self._in_flight = 0
        self._healthy = False
        # When (monotonic) the engine last answered one of Backfill's requests with a 200.
        self._answered_at = -_WATCH_S
        self._backlog: deque[Queued] = deque()
        self._resume: asyncio.TimerHandle | None = None

    @property
    def limit(self) -> int:
        """Requests this engine may have in flight now (its governor decides)."""
        governor = self.governor
        # Only an engine that was ever paused reads the clock: this runs on every start.
        return governor.allowed(time.monotonic()) if governor.paused_until else governor.limit

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
        return self._healthy

    @property
    def parked(self) -> bool:
        """An engine started on demand that is not running: down, without asking it."""
        return self.switch is not None and not self.switch.running

    @property
    def backlog(self) -> tuple[Queued, ...]:
        return tuple(self._backlog)

    @property
    def free(self) -> int:
        return max(0, self.limit - self._in_flight) if self._healthy else 0

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
        if not self._healthy or limit <= 0:
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
        now = self._answered_at = time.monotonic()
        if self.governor.on_latency(latency_s, output_tokens, now):
            self._retune()

    def overloaded(self, retry_after_s: float | None) -> None:
        """The engine answered 429 or 503: a shared engine takes fewer, after a pause."""
        governor = self.governor
        governor.on_overload(retry_after_s, time.monotonic())
        if governor.paused_until and self._resume is None:
            delay = max(0.0, governor.paused_until - time.monotonic())
            self._resume = asyncio.get_running_loop().call_later(delay, self._resumed)

    def pressure(self, pressure: Pressure | None) -> None:
        """The engine's metrics were read (None: they could not be)."""
        if pressure is None:
            before = self.governor.limit
            self.governor.on_metrics_lost()
            if self.governor.limit != before:
                self._retune()
        elif self.governor.on_pressure(pressure, self._in_flight):
            self._retune()

    def _resumed(self) -> None:
        self._resume = None
        # Another 429 may have moved the pause later while this timer waited: wait on.
        left = self.governor.paused_until - time.monotonic()
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
        if not self.parked and time.monotonic() - self._answered_at < _WATCH_S:
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
            self._observe(EngineState.UP)
        else:
            self._observe(EngineState.DOWN, _health_error(self.engine))
        return self._healthy

    def down(self) -> None:
        """Take no more work: the engine is about to stop (on purpose: standby)."""
        self._observe(EngineState.STANDBY)

    @property
    def url(self) -> str | None:
        engine = self.engine
        return engine.url if isinstance(engine, EngineDiagnostics) else None

    def _observe(self, state: EngineState, reason: str | None = None) -> None:
        seen = self.health.observe(state, reason, self._now())
        if seen.note is not None:
            _log_health(self, seen.note)
        self._set_health(state == EngineState.UP)
        if seen.changed:
            self._changed()

    def _set_health(self, healthy: bool) -> None:
        was, self._healthy = self._healthy, healthy
        if healthy and not was:
            self._wake()
            self._fill()

    def _fill(self) -> None:
        while self.free > 0 and self._backlog:
            queued = self._backlog.popleft()
            self._in_flight += 1
            self._start(self, queued)


class EnginePool:
    """Every engine's slot, their health watch, and the wake-up that tells the dispatcher
    capacity freed up (or work arrived)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        start: Start,
        sharing: Sharing | None = None,
        switches: Mapping[str, Switch] | None = None,
        *,
        now: Callable[[], float] = time.time,
        remind_s: float = DOWN_REMINDER_S,
    ) -> None:
        self._woken = asyncio.Event()
        self._recheck = asyncio.Event()
        self._sharing = sharing or Sharing()
        limits, switches = self._sharing.limits, switches or {}
        self.slots = [
            EngineSlot(
                e,
                start,
                self._woken.set,
                limits.get(e.name),
                switches.get(e.name),
                now=now,
                remind_s=remind_s,
                changed=self._health_moved,
            )
            for e in engines
        ]
        self._tasks: list[asyncio.Task[None]] = []
        # Told when a health check changes what it says about an engine. It must not block:
        # the worker's report writer stores the change from its own loop, so neither a slow
        # database nor stopping the watch can hold up the checks or cut a write short.
        self.on_health_change: Callable[[], None] | None = None

    def _health_moved(self) -> None:
        # Told at once, whoever found the change: the watch's round, a request that found the
        # engine unreachable, an on-demand engine parked.
        if self.on_health_change is not None:
            self.on_health_change()

    def wake(self) -> None:
        self._woken.set()

    def clear_wake(self) -> None:
        self._woken.clear()

    async def wait_woken(self, timeout_s: float) -> bool:
        """Wait until ``wake`` (True) or ``timeout_s`` (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._woken.wait(), timeout_s)
        return self._woken.is_set()

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._watch(), name="engine-health"))
        for slot in self.slots:
            probe = self._sharing.probes.get(slot.engine.name)
            if probe is not None:
                name = f"engine-pressure-{slot.engine.name}"
                self._tasks.append(asyncio.create_task(self._probe(slot, probe), name=name))

    def recheck(self) -> None:
        """Look at every engine's health now (an engine was just started)."""
        self._recheck.set()

    async def _watch(self) -> None:
        while True:
            self._recheck.clear()
            for slot in self.slots:
                await slot.check_unless_answered()
            # A parked engine is down on purpose: the others are not watched closer for it.
            healthy = all(s.healthy or s.parked for s in self.slots)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), _WATCH_S if healthy else _WATCH_DOWN_S)

    async def _probe(self, slot: EngineSlot, probe: PressureProbe) -> None:
        """Follow a shared engine's load from its metrics, as often as the settings say
        while they can be read, every few seconds while they cannot; not at all once the
        engine says it has none."""
        while True:
            pressure = await probe.read()
            slot.pressure(pressure)
            if probe.absent:
                log.info(
                    "engine %s publishes no load metrics: its latency is followed", slot.engine.name
                )
                return
            ok = pressure is not None
            await asyncio.sleep(self._sharing.probe_interval_s if ok else _PROBE_RETRY_S)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for slot in self.slots:
            await slot.engine.close()
        for probe in self._sharing.probes.values():
            await probe.close()


class OnDemand:
    """Starts each engine that has a ``Switch`` once the queue holds work for its models, and
    stops it again after ``idle_stop_s`` without a request, giving its CPU and memory back."""

    def __init__(
        self,
        pool: EnginePool,
        queue: WaitingWork,
        *,
        idle_stop_s: float = IDLE_STOP_S,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self._now = now
        self._queue = queue
        self._idle_stop_s = idle_stop_s
        self._clock = clock
        self._switched = [(s, s.switch) for s in pool.slots if s.switch is not None]
        # Per engine: its ``finished`` count when last seen busy, and when that was.
        self._busy: dict[str, tuple[int, float]] = {}

    @property
    def slots(self) -> list[EngineSlot]:
        return [slot for slot, _ in self._switched]

    async def step(self) -> bool:
        """Start the parked engines that work waits for; stop the running ones long idle.
        Whether any engine runs (or was just started)."""
        parked = [(slot, switch) for slot, switch in self._switched if not switch.running]
        started = await self._start_wanted(parked) if parked else False
        running = False
        for slot, switch in self._switched:
            if switch.running:
                await self._stop_if_idle(slot, switch)
                running = running or switch.running
        return started or running

    async def _start_wanted(self, parked: list[tuple[EngineSlot, Switch]]) -> bool:
        models = sorted({model for slot, _ in parked for model in slot.engine.models})
        ready = await self._queue.ready_models(models, self._now())
        started = False
        for slot, switch in parked:
            waiting = sorted(ready.intersection(slot.engine.models))
            if not waiting:
                continue
            log.info(
                "engine %s starts on demand: work waits for %s",
                slot.engine.name,
                ", ".join(waiting),
            )
            await switch.start()
            self._busy[slot.engine.name] = (slot.finished, self._clock())
            started = True
        if started:
            self._pool.recheck()
        return started

    async def _stop_if_idle(self, slot: EngineSlot, switch: Switch) -> None:
        name, now = slot.engine.name, self._clock()
        finished, since = self._busy.setdefault(name, (slot.finished, now))
        if _busy(slot) or finished != slot.finished:
            self._busy[name] = (slot.finished, now)
            return
        if now - since < self._idle_stop_s:
            return
        # Work may wait that a starting or failing engine could not take yet: keep it running.
        if await self._queue.ready_models(slot.engine.models, self._now()) or _busy(slot):
            self._busy[name] = (slot.finished, now)
            return
        log.info("engine %s stops: no request for %.0f s", name, now - since)
        # No await between the two: the dispatcher claims nothing more for it.
        slot.down()
        await switch.stop()


def _busy(slot: EngineSlot) -> bool:
    return slot.in_flight > 0 or bool(slot.backlog)


def _health_error(engine: Engine) -> str | None:
    return engine.health_error if isinstance(engine, EngineDiagnostics) else None


def _log_health(slot: EngineSlot, note: Note) -> None:
    """One line an operator can act on: which engine, where, what is wrong, what waits."""
    name, where = slot.engine.name, slot.url or "no URL"
    models = ", ".join(slot.engine.models) or "no model"
    if note.kind == NoteKind.UP:
        log.info("engine %s (%s) is up", name, where)
    elif note.kind == NoteKind.RECOVERED:
        log.info("engine %s (%s) is up again after %.0f s down", name, where, note.down_for_s)
    elif note.kind == NoteKind.DOWN:
        log.warning(
            "engine %s (%s) is down: %s; requests for %s wait in the queue until it answers%s",
            name,
            where,
            slot.health.reason,
            models,
            _flapping(note.unlogged_outages),
        )
    else:
        log.warning(
            "engine %s (%s) is still down after %.0f s: %s; requests for %s wait in the queue",
            name,
            where,
            note.down_for_s,
            slot.health.reason,
            models,
        )


def _flapping(unlogged: int) -> str:
    if not unlogged:
        return ""
    times = "time" if unlogged == 1 else "times"
    return f" (it also went down and came back {unlogged} {times} since the previous warning)"
