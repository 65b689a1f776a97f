"""The worker's parts, built and wired: the one place that knows which part tells which."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backfill.domain import ids
from backfill.metrics import Metrics
from backfill.ports import BlobStore, Catalog, Clock, Engine, MediaFetcher, Sealer, Switch
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
from backfill.runner.loops import Pace
from backfill.runner.notify import Notifier
from backfill.runner.on_demand import ON_DEMAND_CHECK_S, OnDemand
from backfill.runner.request import RequestRunner
from backfill.runner.stored_engines import Build, StoredEngines
from backfill.runner.validating import ValidatingTakeover
from backfill.runner.worker import Paces, Worker, WorkerParts, WorkerStore, work_arrived
from backfill.services.batches import BatchStarter
from backfill.services.engine_admin import EngineAdmin
from backfill.services.planner import Planner
from backfill.services.retention import Janitor
from backfill.settings import EngineSettings, FetchSettings, LimitsSettings, WorkerSettings

# The longest the GPU-time charging loop sleeps while no request of a private deployment runs
# (a request that starts wakes it).
_CHARGE_IDLE_S = 3600.0


@dataclass(frozen=True, slots=True)
class WorkerInputs:
    """What the worker is built from: the store, storage, engines and the services it uses."""

    store: WorkerStore
    blobs: BlobStore
    sealer: Sealer
    engines: Sequence[Engine]
    clock: Clock
    catalog: Catalog
    starter: BatchStarter
    janitor: Janitor
    metrics: Metrics
    planner: Planner | None = None
    sharing: Sharing | None = None
    on_demand: Mapping[str, Switch] | None = None
    media: MediaFetcher | None = None
    notifier: Notifier | None = None
    # Tells this worker's engine reports from other workers' (default: random).
    name: str | None = None
    # The engines stored for every worker, and the config file's that seed them.
    stored: StoredEngineInputs | None = None
    # How long each engine started on demand may sit idle before it stops (by name).
    idle_stop_s: Mapping[str, float] | None = None


@dataclass(frozen=True, slots=True)
class StoredEngineInputs:
    admin: EngineAdmin
    build: Build
    file: Sequence[EngineSettings] = ()


def build_worker(
    given: WorkerInputs,
    config: WorkerSettings,
    *,
    limits: LimitsSettings,
    fetch: FetchSettings,
    sole_worker: bool,
) -> Worker:
    """The worker and its parts. Only a worker alone on its database (``sole_worker``) takes
    back every lease at start."""
    store, clock, metrics, media = given.store, given.clock, given.metrics, given.media
    planner, notifier = given.planner, given.notifier
    # A plan that stores nothing (no batch runs, or one runs alone at a steady pace) is made
    # less often, up to two intervals apart (it takes no lease then); a batch created here
    # brings the next one back to the interval.
    plan_s = planner.interval_s if planner is not None else 1.0
    paces = Paces(
        lifecycle=Pace(config.lifecycle_interval_s, config.idle_poll_s),
        planner=Pace(plan_s, 2 * plan_s),
        # A batch ended here has notifications due: the notifier looks within its interval.
        notify=Pace(notifier.interval_s if notifier is not None else 1.0, config.idle_poll_s),
        # GPU time is charged every ``gpu_time_flush_s`` while requests of private deployments
        # run; with none, the loop sleeps until one starts (an hour at most).
        charge=Pace(config.gpu_time_flush_s, _CHARGE_IDLE_S),
        # While every engine started on demand is stopped, the queue is asked less and less
        # often whether work waits for one; a batch created here asks at once.
        on_demand=Pace(ON_DEMAND_CHECK_S, config.idle_poll_s),
    )
    leases = Leases(store, clock, config.lease_s)
    # A write that stored a batch's last result starts its finalize at once.
    results = ResultWriter(
        store,
        config.result_flush_s,
        metrics,
        on_finished=lambda _batch_ids: paces.lifecycle.wake(),
    )
    failures = WorkerFailures(
        config.retry_base_s, config.retry_max_s, give_up_after=config.max_attempts, clock=clock
    )
    meter = GpuMeter(clock)
    meter.on_begin = paces.charge.hurry
    fetches = FetchPool(fetch.concurrency) if media is not None else None
    runner = RequestRunner(
        attempts=Attempts(
            RetryPolicy(config.max_attempts, config.retry_base_s, config.retry_max_s),
            clock,
            metrics,
        ),
        results=results,
        leases=leases,
        failures=failures,
        sealer=given.sealer,
        meter=meter,
        catalog=given.catalog,
        clock=clock,
        retry_max_s=config.retry_max_s,
        media=media,
        media_line_bytes=limits.max_media_bytes_per_line,
        fetches=fetches,
        fetch_total_s=fetch.total_timeout_s,
    )
    # The writer waits for more results while requests run: the runner counts them.
    results.running = lambda: runner.running
    pool = EnginePool(
        given.engines,
        runner.start,
        given.sharing,
        given.on_demand,
        clock=clock,
        remind_s=config.engine_down_log_interval_s,
    )
    reports = EngineReports(
        store,
        pool,
        given.name or ids.lease_token(),
        clock,
        ttl_s=config.lease_s,
        heartbeat_s=config.lease_s / 3,
    )
    pool.on_health_change = reports.changed
    if fetches is not None:
        # Room in the fetch pool again: lines it turned away can be claimed back.
        fetches.on_free = pool.wake
    dispatcher = Dispatcher(
        store,
        store,
        given.blobs,
        pool,
        leases,
        clock,
        poll_interval_s=config.poll_interval_s,
        gather_s=config.dispatch_gather_s,
        idle_poll_s=config.idle_poll_s,
        locality=config.prefix_locality,
        fetch_first=runner.fetch_first if fetches is not None else None,
    )
    finalizer = Finalizer(
        store, given.blobs, given.sealer, clock, limits.output_file_ttl_s, config.lease_s
    )
    validating = ValidatingTakeover(
        store,
        given.starter,
        finalizer,
        grace_s=config.validating_grace_s,
        retry_base_s=config.retry_base_s,
        retry_max_s=config.validating_retry_max_s,
        on_started=lambda _batch_id: work_arrived(pool, paces),
        clock=clock,
    )
    lifecycle = Lifecycle(
        store, store, finalizer, validating, dispatcher, runner, clock, on_ended=paces.notify.hurry
    )
    return Worker(
        WorkerParts(
            store=store,
            clock=clock,
            config=config,
            metrics=metrics,
            paces=paces,
            leases=leases,
            results=results,
            failures=failures,
            requests=runner,
            pool=pool,
            reports=reports,
            on_demand=OnDemand(pool, store, clock=clock, idle_stop_s=given.idle_stop_s),
            stored=None
            if given.stored is None
            else StoredEngines(
                pool,
                given.stored.admin,
                given.stored.build,
                clock,
                poll_s=config.engine_config_poll_s,
                file=given.stored.file,
            ),
            dispatcher=dispatcher,
            charger=GpuCharger(meter, store, dispatcher.pause),
            lifecycle=lifecycle,
            janitor=given.janitor,
            planner=planner,
            notifier=notifier,
            media=media,
            sole_worker=sole_worker,
        )
    )
