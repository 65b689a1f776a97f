"""This worker's engine health, stored for every process to read: an API process has no worker
and learns from these rows what ``/admin/v1/engines``, batches' ``waiting_on`` and ``/metrics``
show.

One writer, the worker's ``engine-reports`` loop, does every write: the health watch only
marks a change (``changed``) and goes on checking. The writer stores the latest snapshot as
soon as it is woken, but not sooner than ``min_gap_s`` after its last write (a flapping engine
costs one write per gap, and its latest state is written at the end of it), and again at every
heartbeat (the lease renewal's period), each time good for ``ttl_s``: rows of a worker that
died stop counting when that runs out, as its leases do. Being one loop, its writes commit in
order, and stopping lets the write under way finish, as the worker's other loops do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from backfill.domain.engine_health import EngineReport, EngineState, PriorityOutcome
from backfill.ports import Clock, EngineHealthStore
from backfill.runner.engine_pool import EnginePool
from backfill.runner.slots import EngineSlot

log = logging.getLogger("backfill.runner")

# A change is stored at most this often per worker: health checks run every 0.5 s while an
# engine is down, and one that flaps would otherwise write a row at each of them.
MIN_WRITE_GAP_S = 2.0


def write_delay(
    now: float, *, dirty: bool, last_write: float | None, heartbeat_at: float, min_gap_s: float
) -> float:
    """Seconds until the next write: at once for a change (``dirty``), otherwise at the
    heartbeat; never sooner than ``min_gap_s`` after the last write."""
    due = now if dirty else heartbeat_at
    if last_write is not None:
        due = max(due, last_write + min_gap_s)
    return max(0.0, due - now)


class EngineReports:
    def __init__(
        self,
        store: EngineHealthStore,
        pool: EnginePool,
        worker: str,
        clock: Clock,
        ttl_s: float,
        *,
        heartbeat_s: float,
        min_gap_s: float = MIN_WRITE_GAP_S,
    ) -> None:
        self._store = store
        self._pool = pool
        self.worker = worker
        self._clock = clock
        self._ttl_s = ttl_s
        self._heartbeat_s = heartbeat_s
        # Rows must be rewritten before their ``until``: the gap never outlasts the heartbeat.
        self._min_gap_s = min(min_gap_s, heartbeat_s)
        self._failing = False
        # The engines the last write stored: one gone from the pool since loses its row.
        self._stored: set[str] = set()
        self._dirty = asyncio.Event()
        self._last_write: float | None = None
        self._heartbeat_at = clock.monotonic() + heartbeat_s

    def current(self) -> list[EngineReport]:
        """Every engine as this worker sees it now (those not checked yet included)."""
        until = self._clock.now() + self._ttl_s
        priority = self._pool.priority
        return [
            _report(slot, self.worker, until, priority.get(slot.engine.name))
            for slot in self._pool.slots
            # A replica that left takes no work: it is not shown while its requests end.
            if not slot.retired
        ]

    def changed(self) -> None:
        """What a health check found moved: the writer stores it soon. Never blocks."""
        self._dirty.set()

    async def step(self, stopping: asyncio.Event) -> None:
        """One turn of the writer loop: wait for a change, the heartbeat or ``stopping``, then
        write the latest snapshot unless stopping. Only the wait is ever cut short."""
        delay = write_delay(
            self._clock.monotonic(),
            dirty=self._dirty.is_set(),
            last_write=self._last_write,
            heartbeat_at=self._heartbeat_at,
            min_gap_s=self._min_gap_s,
        )
        if delay > 0:
            waits = [stopping.wait()]
            # Within the gap a change is already known: only stopping ends that wait early.
            if not self._dirty.is_set():
                waits.append(self._dirty.wait())
            await _first(waits, delay)
            return
        if stopping.is_set():
            return
        self._dirty.clear()
        await self.publish()
        self._last_write = self._clock.monotonic()
        self._heartbeat_at = self._last_write + self._heartbeat_s

    async def publish(self) -> None:
        """Store the reports of the engines checked so far. The writer must go on whatever the
        database does: a failure is logged once per outage, and the next write (at the latest
        the next heartbeat) stores the rows again."""
        reports = [r for r in self.current() if r.checked_at is not None]
        try:
            await self._store.report_engines(reports, self._clock.now())
            pooled = {slot.engine.name for slot in self._pool.slots if not slot.retired}
            for gone in sorted(self._stored - pooled):
                await self._store.forget_engines(self.worker, gone)
            self._stored = {r.engine for r in reports} | (self._stored & pooled)
        except Exception as exc:  # the database may be down; the writer must not stop
            if not self._failing:
                log.warning(
                    "could not store engine health (%s); the next heartbeat tries again",
                    type(exc).__name__,
                )
            self._failing = True
            return
        self._failing = False

    async def withdraw(self) -> None:
        """Remove this worker's rows as it stops, after the writer loop ended (best effort:
        they run out anyway)."""
        try:
            await self._store.forget_engines(self.worker)
        except Exception as exc:  # stopping goes on; the rows stop counting at their until
            log.info("could not remove this worker's engine health: %s", type(exc).__name__)


async def _first(waits: list[Coroutine[Any, Any, Any]], timeout_s: float) -> None:
    """Wait until one of ``waits`` ends or ``timeout_s`` passes; cancel the others."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def _report(
    slot: EngineSlot, worker: str, until: float, priority: PriorityOutcome | None
) -> EngineReport:
    health, governor = slot.health, slot.governor
    return EngineReport(
        worker=worker,
        engine=slot.engine.name,
        url=slot.url,
        models=slot.engine.models,
        # Not checked yet reads as down: nothing is sent to it until a check passes.
        state=health.state or EngineState.DOWN,
        last_error=health.reason if health.state is not None else "not checked yet",
        since=health.since,
        checked_at=health.checked_at,
        in_flight=slot.in_flight,
        max_concurrency=slot.engine.max_concurrency,
        concurrency_limit=slot.limit,
        mode=governor.mode.value,
        signal=governor.signal.value,
        pressure=round(governor.pressure, 3),
        until=until,
        priority=priority.value if priority is not None else None,
        start_s=slot.start_s,
        hold=slot.hold(),
    )
