"""The worker: a supervisor that builds the runner's parts and runs them as named tasks.

- dispatch (``dispatch.py``) claims work and hands it to engine slots (``slots.py``, held by
  ``engine_pool.py``; ``on_demand.py`` starts and stops engines);
- each request runs as its own task (``request.py``);
- the lifecycle (``lifecycle.py``) drives batches to their terminal state;
- side tasks renew leases, charge GPU time, sweep expired content, and send notifications
  (``notify.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Protocol

from backfill.domain import ids
from backfill.domain.engine_health import EngineReport
from backfill.metrics import Metrics
from backfill.ports import (
    BatchStore,
    BlobStore,
    Catalog,
    Clock,
    Engine,
    EngineHealthStore,
    LedgerStore,
    MediaFetcher,
    ResultStore,
    Sealer,
    Switch,
    WaitingWork,
    WorkQueue,
)
from backfill.runner.attempts import Attempts, RetryPolicy
from backfill.runner.dispatch import Dispatcher
from backfill.runner.engine_pool import EnginePool, Sharing
from backfill.runner.engine_reports import EngineReports
from backfill.runner.failures import WorkerFailures
from backfill.runner.fetch_pool import FetchPool
from backfill.runner.finalize import Finalizer
from backfill.runner.gpu_meter import GpuCharger, GpuMeter
from backfill.runner.group_commit import ResultWriter
from backfill.runner.leases import Leases
from backfill.runner.lifecycle import Lifecycle
from backfill.runner.loops import Loops, Pace, end_within
from backfill.runner.notify import Notifier
from backfill.runner.on_demand import ON_DEMAND_CHECK_S, OnDemand
from backfill.runner.request import RequestRunner
from backfill.runner.validating import ValidatingTakeover
from backfill.services.batches import BatchStarter
from backfill.services.planner import Planner
from backfill.services.retention import Janitor
from backfill.settings import FetchSettings, LimitsSettings, WorkerSettings

# The longest the GPU-time charging loop sleeps while no request of a private deployment runs
# (a request that starts wakes it).
_CHARGE_IDLE_S = 3600.0
# How long a stop waits for the loops, and then the finalizes, to end before cancelling them.
_STOP_GRACE_S = 10.0


class WorkerStore(
    WorkQueue, WaitingWork, BatchStore, ResultStore, LedgerStore, EngineHealthStore, Protocol
):
    """The roles the worker's parts use, each handed only its own."""


class Worker:
    def __init__(
        self,
        store: WorkerStore,
        blobs: BlobStore,
        sealer: Sealer,
        engines: Sequence[Engine],
        clock: Clock,
        config: WorkerSettings,
        catalog: Catalog,
        starter: BatchStarter,
        janitor: Janitor,
        metrics: Metrics | None = None,
        planner: Planner | None = None,
        sharing: Sharing | None = None,
        on_demand: Mapping[str, Switch] | None = None,
        media: MediaFetcher | None = None,
        notifier: Notifier | None = None,
        name: str | None = None,
        *,
        limits: LimitsSettings,
        fetch: FetchSettings,
        sole_worker: bool,
    ) -> None:
        """``name`` tells this worker's engine reports from other workers' (default: random).
        Only a worker alone on its database (``sole_worker``) takes back every lease at start."""
        self._media = media
        self._notifier = notifier
        self._store = store
        self._config = config
        self._sole_worker = sole_worker
        self._clock = clock
        self._janitor = janitor
        self._planner = planner
        # A plan that stores nothing (no batch runs, or one runs alone at a steady pace) is
        # made less often, up to two intervals apart (it takes no lease then); a batch created
        # here brings the next one back to the interval.
        plan_s = planner.interval_s if planner is not None else 1.0
        self._planner_pace = Pace(plan_s, 2 * plan_s)
        # A batch ended here has notifications due: the notifier looks within its interval.
        self._notify_pace = Pace(
            notifier.interval_s if notifier is not None else 1.0, config.idle_poll_s
        )
        self._metrics = metrics or Metrics()
        self._loops = Loops()
        self._leases = Leases(store, clock, config.lease_s)
        self._lifecycle_pace = Pace(config.lifecycle_interval_s, config.idle_poll_s)
        # A write that stored a batch's last result starts its finalize at once.
        self._results = ResultWriter(
            store,
            config.result_flush_s,
            self._metrics,
            on_finished=lambda _batch_ids: self._lifecycle_pace.wake(),
            running=lambda: self._requests.running,
        )
        self._failures = WorkerFailures(
            config.retry_base_s, config.retry_max_s, give_up_after=config.max_attempts, clock=clock
        )
        meter = GpuMeter(clock)
        # GPU time is charged every ``gpu_time_flush_s`` while requests of private deployments
        # run; with none, the loop sleeps until one starts (an hour at most).
        self._charge_pace = Pace(config.gpu_time_flush_s, _CHARGE_IDLE_S)
        meter.on_begin = self._charge_pace.hurry
        fetches = FetchPool(fetch.concurrency) if media is not None else None
        self._requests = RequestRunner(
            attempts=Attempts(
                RetryPolicy(config.max_attempts, config.retry_base_s, config.retry_max_s),
                clock,
                self._metrics,
            ),
            results=self._results,
            leases=self._leases,
            failures=self._failures,
            sealer=sealer,
            meter=meter,
            catalog=catalog,
            clock=clock,
            retry_max_s=config.retry_max_s,
            media=media,
            media_line_bytes=limits.max_media_bytes_per_line,
            fetches=fetches,
            fetch_total_s=fetch.total_timeout_s,
        )
        self._pool = EnginePool(
            engines,
            self._requests.start,
            sharing,
            on_demand,
            clock=clock,
            remind_s=config.engine_down_log_interval_s,
        )
        self._reports = EngineReports(
            store,
            self._pool,
            name or ids.lease_token(),
            clock,
            ttl_s=config.lease_s,
            heartbeat_s=config.lease_s / 3,
        )
        self._pool.on_health_change = self._reports.changed
        if fetches is not None:
            # Room in the fetch pool again: lines it turned away can be claimed back.
            fetches.on_free = self._pool.wake
        self._on_demand = OnDemand(self._pool, store, clock=clock)
        # While every engine started on demand is stopped, the queue is asked less and less
        # often whether work waits for one; a batch created here asks at once.
        self._on_demand_pace = Pace(ON_DEMAND_CHECK_S, config.idle_poll_s)
        self._dispatcher = Dispatcher(
            store,
            store,
            blobs,
            self._pool,
            self._leases,
            clock,
            poll_interval_s=config.poll_interval_s,
            gather_s=config.dispatch_gather_s,
            idle_poll_s=config.idle_poll_s,
            locality=config.prefix_locality,
            fetch_first=self._requests.fetch_first if fetches is not None else None,
        )
        self._charger = GpuCharger(meter, store, self._dispatcher.pause)
        finalizer = Finalizer(store, blobs, sealer, clock, limits.output_file_ttl_s, config.lease_s)
        validating = ValidatingTakeover(
            store,
            starter,
            finalizer,
            grace_s=config.validating_grace_s,
            retry_base_s=config.retry_base_s,
            retry_max_s=config.validating_retry_max_s,
            on_started=self.note_created,
            clock=clock,
        )
        self._lifecycle = Lifecycle(
            store,
            store,
            finalizer,
            validating,
            self._dispatcher,
            self._requests,
            clock,
            on_ended=self._notify_pace.hurry,
        )

    async def start(self) -> None:
        if self._sole_worker:
            await self._leases.release_all()
        self._results.start()
        self._pool.start()
        config, loops = self._config, self._loops
        loops.repeat("dispatch", self._dispatcher.round)
        loops.poll("lifecycle", self._lifecycle_pace, self._lifecycle_step)
        loops.every("leases", config.lease_s / 3, self.heartbeat)
        # The one writer of engine health: changes the watch marks, and a heartbeat.
        loops.repeat("engine-reports", lambda: self._reports.step(loops.stopping))
        loops.poll("gpu-charge", self._charge_pace, self._charge_step)
        loops.every("janitor", config.janitor_interval_s, self._tidy)
        if self._notifier is not None:
            loops.poll("notify", self._notify_pace, self._notifier.step)
        if self._on_demand.slots:
            loops.poll("engines-on-demand", self._on_demand_pace, self._on_demand.step)
        if self._planner is not None:
            loops.poll("planner", self._planner_pace, self._plan)

    async def stop(self) -> None:
        # Loops finish the statement they are in: a statement cut short by cancellation can
        # leave SQLite locked for the next process on the same data directory.
        self._loops.stop()
        self._pool.wake()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _STOP_GRACE_S
        await end_within(self._loops.tasks, _STOP_GRACE_S)
        # Only now: a lifecycle pass under way as the stop began may have started a finalize
        # or a take-over as it ended, and one left running would outlive the store.
        await end_within(self._lifecycle.tasks, max(0.0, deadline - loop.time()))
        # The backlogs go first: a cancelled request frees its slot, which must start nothing.
        self._dispatcher.drop_all()
        await end_within(self._requests.tasks, 0.0)
        await self._leases.settle()
        await self._results.stop()
        await self.charge_gpu_time()
        # The health watch writes nothing (the engine-reports loop, ended above, does), so
        # stopping it cuts no statement short; the rows go after the last write.
        await self._pool.stop()
        await self._reports.withdraw()
        if self._media is not None:
            await self._media.close()
        if self._notifier is not None:
            await self._notifier.stop()

    def observe(self) -> None:
        """Refresh the gauges the worker alone knows (scraped with /metrics)."""
        metrics = self._metrics
        for slot in self._pool.slots:
            name = slot.engine.name
            metrics.in_flight.labels(name).set(slot.in_flight)
            metrics.concurrency_limit.labels(name).set(slot.limit)
            metrics.engine_pressure.labels(name).set(slot.governor.pressure)

    def engine_reports(self) -> list[EngineReport]:
        """This worker's engines as it sees them now (what it stores, without the delay)."""
        return self._reports.current()

    def note_created(self, _batch_id: str) -> None:
        """Called when a batch is created in this process: look for work now."""
        self._pool.wake()
        self._lifecycle_pace.hurry()
        self._planner_pace.hurry()
        self._on_demand_pace.wake()

    def stop_starting(self, batch_id: str) -> None:
        """Called when a batch is cancelled in this process: nothing of it starts any more,
        and the lifecycle looks at it soon."""
        self._dispatcher.stop_starting(batch_id)
        self._lifecycle_pace.hurry()

    def held_leases(self) -> dict[str, set[int]]:
        """The items whose requests run now or wait in a backlog, by batch."""
        held = self._requests.held()
        for slot in self._pool.slots:
            for queued in slot.backlog:
                held.setdefault(queued.batch.id, set()).add(queued.item.idx)
        return held

    async def heartbeat(self) -> None:
        await self._leases.renew(self.held_leases())

    async def dispatch_once(self) -> int:
        return await self._dispatcher.dispatch_once()

    async def lifecycle_once(self) -> None:
        await self._lifecycle.once()

    async def charge_gpu_time(self) -> None:
        await self._charger.charge()

    async def _plan(self) -> bool:
        """One planning pass; whether it changed anything (None: another process plans)."""
        assert self._planner is not None
        made = await self._planner.plan()
        return made is not None and not made.empty

    async def _charge_step(self) -> bool:
        await self.charge_gpu_time()
        return self._charger.metering

    async def _lifecycle_step(self) -> bool:
        found = await self._lifecycle.once()
        self._failures.summarise()
        return found

    async def _tidy(self) -> None:
        # Batches are moved on as their last result is stored; this catches any that were not.
        await self._store.finish_drained(int(self._clock.now()))
        await self._janitor.sweep()
