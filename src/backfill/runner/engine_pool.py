"""Every engine's slot, the watch over their health and load, and the wake-up that tells the
dispatcher capacity freed up (or work arrived)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from backfill.domain.engine_health import PriorityOutcome
from backfill.domain.scheduling.concurrency import LOOK_INTERVAL_S, ConcurrencyLimit
from backfill.ports import Clock, Engine, PressureProbe, PriorityProbe, Switch
from backfill.runner.slots import DOWN_REMINDER_S, WATCH_S, EngineSlot, Start

log = logging.getLogger("backfill.runner")

# A shared engine whose metrics cannot be read is looked at again soon, then less and less
# often, down to once this long: one slow read on a busy machine (a timeout) must not leave
# the worker blind for seconds, while people wait for slots it would give back.
_PROBE_RETRY_S = 5.0
_FAILED_TO_SAY = 3
# How often each engine's health is looked at while one is down (while all are up: WATCH_S).
_WATCH_DOWN_S = 0.5
# An engine busy (or otherwise unmeasurable) when its priority is probed is tried again this
# much later, this many times in all; then it is reported as unknown.
PRIORITY_RETRY_S = 30.0
PRIORITY_TRIES = 4


def look_again_in(interval_s: float, failed: int) -> float:
    """When to read an engine's metrics again after ``failed`` reads in a row failed: the
    interval, doubled with each failure, at most ``_PROBE_RETRY_S``."""
    return min(_PROBE_RETRY_S, interval_s * 2.0**failed) if failed else interval_s


@dataclass(frozen=True, slots=True)
class Sharing:
    """How the engines are shared with interactive traffic, by engine name: each named one
    has its own adaptive limit (and a metrics probe when it publishes its load); the others
    are dedicated, filled up to their ``max_concurrency``."""

    limits: Mapping[str, ConcurrencyLimit] = field(default_factory=dict)
    probes: Mapping[str, PressureProbe] = field(default_factory=dict)
    probe_interval_s: float = LOOK_INTERVAL_S
    priority_probes: Mapping[str, PriorityProbe] = field(default_factory=dict)
    """Engines with a ``priority`` setting, ``slots`` and vLLM metrics: whether they apply
    the priority is found out once, while they are idle."""


@dataclass(slots=True)
class _Probes:
    pressure: PressureProbe
    priority: PriorityProbe | None
    task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.pressure.close()


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
        clock: Clock,
        remind_s: float = DOWN_REMINDER_S,
    ) -> None:
        self._woken = asyncio.Event()
        self._clock = clock
        # What each probed engine does with the priority Backfill sends, once known (by engine
        # name): the engine reports carry it.
        self.priority: dict[str, PriorityOutcome] = {}
        self._recheck = asyncio.Event()
        self._sharing = sharing or Sharing()
        limits, switches = self._sharing.limits, switches or {}
        self._start = start
        self._remind_s = remind_s
        self.slots = [self._slot(e, limits.get(e.name), switches.get(e.name)) for e in engines]
        self._tasks: list[asyncio.Task[None]] = []
        # Each engine's pressure probe, its priority probe and the task that reads them (once
        # started), by slot: an engine changed at run time is a new slot under the same name
        # while the old one drains.
        self._probes: dict[EngineSlot, _Probes] = {}
        for slot in self.slots:
            probe = self._sharing.probes.get(slot.engine.name)
            if probe is not None:
                self._probes[slot] = _Probes(
                    probe, self._sharing.priority_probes.get(slot.engine.name)
                )
        self._started = False
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

    def _slot(
        self, engine: Engine, limit: ConcurrencyLimit | None, switch: Switch | None
    ) -> EngineSlot:
        return EngineSlot(
            engine,
            self._start,
            self._woken.set,
            limit,
            switch,
            clock=self._clock,
            remind_s=self._remind_s,
            changed=self._health_moved,
        )

    def start(self) -> None:
        self._started = True
        self._tasks.append(asyncio.create_task(self._watch(), name="engine-health"))
        for slot in self._probes:
            self._follow(slot)

    def _follow(self, slot: EngineSlot) -> None:
        probes = self._probes[slot]
        probes.task = asyncio.create_task(
            self._probe(slot, probes.pressure, probes.priority),
            name=f"engine-pressure-{slot.engine.name}",
        )

    def add(
        self,
        engine: Engine,
        limit: ConcurrencyLimit | None = None,
        probe: PressureProbe | None = None,
        priority: PriorityProbe | None = None,
    ) -> EngineSlot:
        """An engine found while running (a replica that joined, an engine added or changed
        through the admin API): like the others, it gets work once a health check finds it
        up, which the watch does at once. A retired one of the same name may still drain."""
        if any(s.engine.name == engine.name and not s.retired for s in self.slots):
            raise ValueError(f"engine {engine.name} is in the pool already")
        slot = self._slot(engine, limit, None)
        self.slots.append(slot)
        # What a probe found of an earlier engine of this name says nothing of this one.
        self.priority.pop(engine.name, None)
        if probe is not None:
            self._probes[slot] = _Probes(probe, priority)
            if self._started:
                self._follow(slot)
        self._health_moved()
        self.recheck()
        return slot

    def revive(self, slot: EngineSlot) -> bool:
        """An engine that left and came back while its requests still ran there: it takes
        work again as it is (True); False when that slot is gone already."""
        if slot not in self.slots or not slot.retired:
            return False
        slot.retired = False
        self._health_moved()
        self.recheck()
        return True

    def retire(self, name: str) -> None:
        """An engine gone (a replica that left): it takes no more work, its claimed backlog
        goes back to the queue at the next dispatch, what runs there ends (or fails and is
        retried elsewhere), and then ``reap`` removes it."""
        for slot in self.slots:
            if slot.engine.name == name:
                slot.retire()
        self._health_moved()
        self.wake()

    async def reap(self) -> None:
        """Remove retired engines with nothing left in flight or in their backlog."""
        done = [s for s in self.slots if s.retired and not s.in_flight and not s.backlog]
        if not done:
            return
        self.slots = [s for s in self.slots if s not in done]
        for slot in done:
            probes = self._probes.pop(slot, None)
            if probes is not None:
                await probes.close()
            await slot.engine.close()
        self._health_moved()

    def recheck(self) -> None:
        """Look at every engine's health now (an engine was just started)."""
        self._recheck.set()

    async def _watch(self) -> None:
        while True:
            self._recheck.clear()
            # A copy: engines join and leave while the checks are awaited.
            for slot in [s for s in self.slots if not s.retired]:
                await slot.check_unless_answered()
            # A parked engine is down on purpose: the others are not watched closer for it.
            healthy = all(s.healthy or s.parked or s.retired for s in self.slots)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), WATCH_S if healthy else _WATCH_DOWN_S)

    async def _probe(
        self, slot: EngineSlot, probe: PressureProbe, priority: PriorityProbe | None
    ) -> None:
        """Follow a shared engine's load from its metrics, as often as the settings say
        while they can be read, every few seconds while they cannot; not at all once the
        engine says it has none. First, where the engine has a priority probe, find out
        whether it applies the priority Backfill sends (tried while it is up, again while
        it is busy, a few times at most)."""
        tries, next_try, failed = 0, 0.0, 0
        while True:
            if priority is not None and slot.healthy and self._clock.monotonic() >= next_try:
                tries += 1
                if await self._check_priority(slot, priority, tries):
                    priority = None
                next_try = self._clock.monotonic() + PRIORITY_RETRY_S
            pressure = await probe.read()
            slot.pressure(pressure)
            if probe.absent:
                log.info(
                    "engine %s publishes no load metrics: its latency is followed", slot.engine.name
                )
                return
            if pressure is not None:
                if failed >= _FAILED_TO_SAY:
                    log.info("engine %s: its metrics can be read again", slot.engine.name)
                failed = 0
            else:
                failed += 1
                if failed == _FAILED_TO_SAY:  # one slow read on a busy machine is no news
                    log.info(
                        "engine %s: its metrics could not be read %d times in a row; its "
                        "latency is followed until they can",
                        slot.engine.name,
                        failed,
                    )
            await asyncio.sleep(look_again_in(self._sharing.probe_interval_s, failed))

    async def _check_priority(self, slot: EngineSlot, probe: PriorityProbe, tries: int) -> bool:
        """One try of ``probe``; True when no other is due (the answer is known, or the
        tries are spent). An engine found to ignore priority is a warning: people who must
        wait there queue behind batch requests."""
        name = slot.engine.name
        try:
            outcome = await probe.check()
        except Exception as exc:  # the load must still be followed whatever the probe does
            outcome, probe.unknown_reason = None, f"the probe failed ({type(exc).__name__})"
        if outcome is None:
            if tries < PRIORITY_TRIES:
                return False
            log.info(
                "could not tell whether engine %s applies the request priority Backfill sends "
                "(%s, %d tries); it is reported as unknown",
                name,
                probe.unknown_reason or "no reason given",
                tries,
            )
            return True
        self.priority[name] = outcome
        if outcome == PriorityOutcome.IGNORED:
            log.warning(
                "engine %s ignores the request priority Backfill sends: it served queued "
                "requests in arrival order, so batch requests do not yield to people's; start "
                "vLLM with --scheduling-policy priority, or remove priority from the engine's "
                "settings",
                name,
            )
        else:
            log.info("engine %s applies request priority: people's requests go first", name)
        self._health_moved()
        return True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for probes in self._probes.values():
            await probes.close()
        for slot in self.slots:
            await slot.engine.close()
