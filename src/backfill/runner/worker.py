"""The worker: a supervisor that runs the runner's parts as named tasks (the container builds
and wires them: ``container/worker.py``).

- dispatch (``dispatch.py``) claims work and hands it to engine slots (``slots.py``, held by
  ``engine_pool.py``; ``on_demand.py`` starts and stops engines);
- each request runs as its own task (``request.py``);
- the lifecycle (``lifecycle.py``) drives batches to their terminal state;
- side tasks renew leases, charge GPU time, sweep expired content, and send notifications
  (``notify.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from backfill.domain.engine_health import EngineReport
from backfill.metrics import Metrics
from backfill.ports import (
    BatchStore,
    Clock,
    EngineHealthStore,
    LedgerStore,
    MediaFetcher,
    ResultStore,
    WaitingWork,
    WorkQueue,
)
from backfill.runner.dispatch import Dispatcher
from backfill.runner.engine_pool import EnginePool
from backfill.runner.engine_reports import EngineReports
from backfill.runner.failures import WorkerFailures
from backfill.runner.gpu_meter import GpuCharger
from backfill.runner.group_commit import ResultWriter
from backfill.runner.leases import Leases
from backfill.runner.lifecycle import Lifecycle
from backfill.runner.loops import Loops, Pace, end_within
from backfill.runner.notify import Notifier
from backfill.runner.on_demand import OnDemand
from backfill.runner.request import RequestRunner
from backfill.runner.slots import EngineSlot
from backfill.runner.stored_engines import StoredEngines
from backfill.services.planner import Planner
from backfill.services.retention import Janitor
from backfill.settings import WorkerSettings

# How long a stop waits for the loops, and then the finalizes, to end before cancelling them.
_STOP_GRACE_S = 10.0


class WorkerStore(
    WorkQueue, WaitingWork, BatchStore, ResultStore, LedgerStore, EngineHealthStore, Protocol
):
    """The roles the worker's parts use, each handed only its own."""


@dataclass(frozen=True, slots=True)
class Paces:
    """How often each polling loop looks for work; the parts hurry or wake them."""

    lifecycle: Pace
    planner: Pace
    notify: Pace
    charge: Pace
    on_demand: Pace


@dataclass(frozen=True, slots=True)
class WorkerParts:
    """What the worker runs, built and wired by the container."""

    store: WorkerStore
    clock: Clock
    config: WorkerSettings
    metrics: Metrics
    paces: Paces
    leases: Leases
    results: ResultWriter
    failures: WorkerFailures
    requests: RequestRunner
    pool: EnginePool
    reports: EngineReports
    on_demand: OnDemand
    dispatcher: Dispatcher
    charger: GpuCharger
    lifecycle: Lifecycle
    janitor: Janitor
    planner: Planner | None
    notifier: Notifier | None
    media: MediaFetcher | None
    # Only a worker alone on its database may take back every lease at start.
    sole_worker: bool
    # The engines stored for every worker (None: the engines given are all there is).
    stored: StoredEngines | None = None


def work_arrived(pool: EnginePool, paces: Paces) -> None:
    """A batch was created in this process: every loop that could act on it looks now."""
    pool.wake()
    paces.lifecycle.hurry()
    paces.planner.hurry()
    paces.on_demand.wake()


class Worker:
    def __init__(self, parts: WorkerParts) -> None:
        self.parts = parts
        self._loops = Loops()
        # The engines whose gauges ``observe`` set last.
        self._observed: set[str] = set()
        self._unread_counted: dict[EngineSlot, int] = {}

    async def start(self) -> None:
        if self.parts.sole_worker:
            await self.parts.leases.release_all()
        self.parts.results.start()
        self.parts.pool.start()
        if self.parts.stored is not None:
            # Before the first claim: the engines it claims for are the stored ones.
            await self.parts.stored.start()
        config, loops = self.parts.config, self._loops
        loops.repeat("dispatch", self.parts.dispatcher.round)
        loops.poll("lifecycle", self.parts.paces.lifecycle, self._lifecycle_step)
        loops.every("leases", config.lease_s / 3, self.heartbeat)
        # The one writer of engine health: changes the watch marks, and a heartbeat.
        loops.repeat("engine-reports", lambda: self.parts.reports.step(loops.stopping))
        loops.poll("gpu-charge", self.parts.paces.charge, self._charge_step)
        loops.every("janitor", config.janitor_interval_s, self._tidy)
        if self.parts.notifier is not None:
            loops.poll("notify", self.parts.paces.notify, self.parts.notifier.step)
        stored = self.parts.stored
        if stored is not None:

            async def follow_stored() -> None:
                await loops.pause(await stored.step())

            loops.repeat("stored-engines", follow_stored)
        if self.parts.on_demand.slots:
            loops.poll("engines-on-demand", self.parts.paces.on_demand, self.parts.on_demand.step)
        if self.parts.planner is not None:
            loops.poll("planner", self.parts.paces.planner, self._plan)

    async def stop(self) -> None:
        # Loops finish the statement they are in: a statement cut short by cancellation can
        # leave SQLite locked for the next process on the same data directory.
        self._loops.stop()
        self.parts.pool.wake()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _STOP_GRACE_S
        await end_within(self._loops.tasks, _STOP_GRACE_S)
        # Only now: a lifecycle pass under way as the stop began may have started a finalize
        # or a take-over as it ended, and one left running would outlive the store.
        await end_within(self.parts.lifecycle.tasks, max(0.0, deadline - loop.time()))
        # The backlogs go first: a cancelled request frees its slot, which must start nothing.
        self.parts.dispatcher.drop_all()
        await end_within(self.parts.requests.tasks, 0.0)
        await self.parts.leases.settle()
        await self.parts.results.stop()
        await self.charge_gpu_time()
        # The health watch writes nothing (the engine-reports loop, ended above, does), so
        # stopping it cuts no statement short; the rows go after the last write.
        await self.parts.pool.stop()
        await self.parts.reports.withdraw()
        if self.parts.media is not None:
            await self.parts.media.close()
        if self.parts.notifier is not None:
            await self.parts.notifier.stop()

    def observe(self) -> None:
        """Refresh the gauges the worker alone knows (scraped with /metrics)."""
        metrics = self.parts.metrics
        slots = self.parts.pool.slots
        # A replica that left is no longer shown.
        names = {slot.engine.name for slot in slots}
        for gone in self._observed - names:
            metrics.forget_engine(gone)
        self._observed = names
        self._unread_counted = {s: n for s, n in self._unread_counted.items() if s in slots}
        for slot in slots:
            name = slot.engine.name
            metrics.in_flight.labels(name).set(slot.in_flight)
            metrics.concurrency_limit.labels(name).set(slot.limit)
            metrics.engine_pressure.labels(name).set(slot.governor.pressure)
            counted = self._unread_counted.get(slot, 0)
            if slot.metrics_unread > counted:
                metrics.engine_metrics_unread.labels(name).inc(slot.metrics_unread - counted)
                self._unread_counted[slot] = slot.metrics_unread
            curve = slot.governor.steps.curve
            if curve is not None:
                step = metrics.engine_step_seconds
                step.labels(name, "base").set(curve.base_s)
                step.labels(name, "per_sequence").set(curve.per_seq_s)
                step.labels(name, "per_sequence_squared").set(curve.per_seq2_s)

    def engine_reports(self) -> list[EngineReport]:
        """This worker's engines as it sees them now (what it stores, without the delay)."""
        return self.parts.reports.current()

    def note_created(self, _batch_id: str) -> None:
        """Called when a batch is created in this process: look for work now."""
        work_arrived(self.parts.pool, self.parts.paces)

    def stop_starting(self, batch_id: str) -> None:
        """Called when a batch is cancelled in this process: nothing of it starts any more,
        and the lifecycle looks at it soon."""
        self.parts.dispatcher.stop_starting(batch_id)
        self.parts.paces.lifecycle.hurry()

    def held_leases(self) -> dict[str, set[int]]:
        """The items whose requests run now or wait in a backlog, by batch."""
        held = self.parts.requests.held()
        for slot in self.parts.pool.slots:
            for queued in slot.backlog:
                held.setdefault(queued.batch.id, set()).add(queued.item.idx)
        return held

    async def heartbeat(self) -> None:
        await self.parts.leases.renew(self.held_leases())

    async def dispatch_once(self) -> int:
        return await self.parts.dispatcher.dispatch_once()

    async def lifecycle_once(self) -> None:
        await self.parts.lifecycle.once()

    async def charge_gpu_time(self) -> None:
        await self.parts.charger.charge()

    async def _plan(self) -> bool:
        """One planning pass; whether it changed anything (None: another process plans)."""
        assert self.parts.planner is not None
        made = await self.parts.planner.plan()
        return made is not None and not made.empty

    async def _charge_step(self) -> bool:
        await self.charge_gpu_time()
        return self.parts.charger.metering

    async def _lifecycle_step(self) -> bool:
        found = await self.parts.lifecycle.once()
        self.parts.failures.summarise()
        return found

    async def _tidy(self) -> None:
        # Batches are moved on as their last result is stored; this catches any that were not.
        await self.parts.store.finish_drained(int(self.parts.clock.now()))
        await self.parts.janitor.sweep()
