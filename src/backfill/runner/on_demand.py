"""Engines that run only while work waits for them: started when the queue holds work for
their models, stopped after a while without a request."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from backfill.ports import Clock, Switch, WaitingWork
from backfill.runner.engine_pool import EnginePool
from backfill.runner.slots import EngineSlot

log = logging.getLogger("backfill.runner")

# An engine started on demand stops after this long without a request: idle, its process
# still holds CPU threads and the model's memory, and starting it again takes seconds.
IDLE_STOP_S = 600.0
# How often the queue is asked whether work waits for an engine started on demand that is not
# running: a start takes seconds anyway, and a read every few seconds is little next to the
# dispatcher's claims, several a second.
ON_DEMAND_CHECK_S = 2.0


class OnDemand:
    """Starts each engine that has a ``Switch`` once the queue holds work for its models, and
    stops it again after its ``idle_stop_s`` without a request, giving its CPU and memory
    back. A started engine is ``starting`` until it answers, and its slot learns how long that
    took (reported, and counted by deadlines: domain/engine_health.py ``start_delays``)."""

    def __init__(
        self,
        pool: EnginePool,
        queue: WaitingWork,
        *,
        clock: Clock,
        idle_stop_s: Mapping[str, float] | None = None,
    ) -> None:
        self._pool = pool
        self._queue = queue
        # By engine name; an engine not named stops after IDLE_STOP_S.
        self._idle_stop_s = dict(idle_stop_s or {})
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
        ready = await self._queue.ready_models(models, self._clock.now())
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
            slot.starting()
            self._busy[slot.engine.name] = (slot.finished, self._clock.monotonic())
            started = True
        if started:
            self._pool.recheck()
        return started

    async def _stop_if_idle(self, slot: EngineSlot, switch: Switch) -> None:
        name, now = slot.engine.name, self._clock.monotonic()
        finished, since = self._busy.setdefault(name, (slot.finished, now))
        if _busy(slot) or finished != slot.finished:
            self._busy[name] = (slot.finished, now)
            return
        if now - since < self._idle_stop_s.get(name, IDLE_STOP_S):
            return
        # Work may wait that a starting or failing engine could not take yet: keep it running.
        if await self._queue.ready_models(slot.engine.models, self._clock.now()) or _busy(slot):
            self._busy[name] = (slot.finished, now)
            return
        log.info("engine %s stops: no request for %.0f s", name, now - since)
        # No await between the two: the dispatcher claims nothing more for it.
        slot.down()
        await switch.stop()


def _busy(slot: EngineSlot) -> bool:
    return slot.in_flight > 0 or bool(slot.backlog)
