"""The one place that picks concrete adapters and wires them together."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from fastapi import FastAPI
from sqlalchemy.engine import make_url

from backfill.adapters.blobs.encrypted import EncryptedBlobStore
from backfill.adapters.blobs.master import (
    CURRENT_BLOB_FORMAT,
    MasterKey,
    load_master_key,
    verify_master_key,
)
from backfill.adapters.blobs.raw import LocalRawStore, RawStore
from backfill.adapters.clock import SystemClock
from backfill.adapters.db.store import SqlStore
from backfill.adapters.engines.dns import DnsReplicas
from backfill.adapters.engines.managed import ManagedProcess, llama_cpp_command
from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.adapters.engines.pressure import Flavor, MetricsProbe
from backfill.adapters.engines.priority_probe import VllmPriorityProbe
from backfill.adapters.fetch import FetchPolicy, SafeFetcher
from backfill.adapters.http.app import create_app
from backfill.adapters.notify.smtp import SmtpMailer, SmtpSettings
from backfill.adapters.notify.webhooks import SignedWebhooks
from backfill.adapters.private import private_dir, tighten_file
from backfill.container.worker import StoredEngineInputs, WorkerInputs, build_worker
from backfill.domain.files import content_key
from backfill.domain.input_format import Limits
from backfill.domain.media import MediaLimits
from backfill.domain.notifications import RetrySchedule
from backfill.domain.scheduling.concurrency import ConcurrencyLimit, Mode, SharedTargets
from backfill.metrics import Metrics
from backfill.ports import Clock, Engine, PressureProbe, PriorityProbe, Sealer
from backfill.runner.discovery import DiscoveredEngine, Replica, replica_name
from backfill.runner.engine_pool import Sharing
from backfill.runner.notify import Notifier, NotifyConfig
from backfill.runner.worker import Worker
from backfill.services.account import AccountService
from backfill.services.audit import AuditLog
from backfill.services.batch_controls import BatchControls
from backfill.services.batches import BatchService, BatchStarter, OrgLimits
from backfill.services.billing import BillingService
from backfill.services.bundle import Services
from backfill.services.catalog import CatalogService
from backfill.services.engine_admin import EngineAdmin
from backfill.services.engine_health import EngineHealth
from backfill.services.error_codes import ErrorCodeService
from backfill.services.estimates import EstimateService
from backfill.services.files import FileService
from backfill.services.fleet import FleetService
from backfill.services.notifications import NotificationService
from backfill.services.operations import Operations
from backfill.services.planner import Planner
from backfill.services.reruns import RerunService
from backfill.services.results import ResultService
from backfill.services.retention import Janitor
from backfill.services.spend_caps import SpendCapService
from backfill.services.tenants import TenantService
from backfill.settings import (
    LOCAL_CONTEXT,
    LOCAL_EMBEDDING_ENGINE,
    LOCAL_EMBEDDING_MODEL,
    LOCAL_ENGINE,
    LOCAL_MODEL,
    EngineSettings,
    Settings,
    catalog_model_from,
)

log = logging.getLogger("backfill")


@dataclass
class Backfill:
    settings: Settings
    store: SqlStore
    blobs: EncryptedBlobStore
    services: Services
    worker: Worker | None
    master: MasterKey
    clock: Clock
    processes: list[ManagedProcess] = field(default_factory=list)
    # Started by the worker when work waits for them (runner/on_demand.py), not at start.
    on_demand: list[ManagedProcess] = field(default_factory=list)

    async def init(self) -> None:
        """Bring the schema up to date and check the master key against the database."""
        await self.store.init()
        floor = await verify_master_key(
            self.store, self.master, int(self.clock.now()), self._opens_stored_content
        )
        self.blobs.legacy_reads = floor < CURRENT_BLOB_FORMAT

    async def _opens_stored_content(self) -> bool | None:
        """Whether the master key opens any of a few stored files (None: none to try); one
        damaged or deleted blob must not decide it."""
        answers = [
            await self.blobs.opens(content_key(file_id))
            for file_id in await self.store.stored_file_ids(None, 5)
        ]
        if True in answers:
            return True
        return False if False in answers else None

    async def start(self) -> None:
        await self.init()
        await self.seed_catalog()
        for process in self.processes:
            await process.start()
        if self.worker is not None:
            await self.services.batches.resume_interrupted()
            await self.worker.start()

    async def stop(self) -> None:
        await self.services.batches.stop()
        if self.worker is not None:
            await self.worker.stop()
        await asyncio.gather(*(p.stop() for p in [*self.processes, *self.on_demand]))
        await self.blobs.close()
        await self.store.close()

    async def seed_catalog(self) -> None:
        """Add the configured models and deployments that the database does not have yet."""
        models = [catalog_model_from(m) for m in self.settings.catalog()]
        for d in self.settings.deployments:
            org = await self.store.org_by_name(d.org)
            if org is None:
                log.warning("deployment %s names unknown organization %s; skipped", d.id, d.org)
                continue
            models.append(catalog_model_from(d, org.id))
        await self.services.catalog.seed(models)

    def app(self) -> FastAPI:
        return create_app(
            self.services,
            on_start=self.start,
            on_stop=self.stop,
            settings=self.settings,
        )


def _private_sqlite(store: SqlStore) -> None:
    """Make the SQLite database 0600 before SQLite opens it: SQLite gives its -wal and -shm
    files the database file's mode, so they follow."""
    if not store.is_sqlite:
        return
    database = make_url(store.url).database
    if not database or database == ":memory:":
        return
    path = Path(database)
    if not path.parent.is_dir():
        private_dir(path.parent)
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        if name == path or name.exists():
            tighten_file(name)


def _raw_store(settings: Settings) -> RawStore:
    if settings.storage_url.startswith("s3://"):
        # Imported here: botocore's models take ~10 MB of memory a process on local storage
        # (the embedded default) never uses.
        from backfill.adapters.blobs.s3 import S3RawStore

        return S3RawStore(
            settings.storage_url,
            endpoint_url=settings.s3.endpoint_url,
            region=settings.s3.region,
            access_key_id=settings.s3.access_key_id,
            secret_access_key=settings.s3.secret_access_key,
        )
    return LocalRawStore(settings.resolved_storage_path)


@dataclass
class _Engines:
    engines: list[Engine] = field(default_factory=list)
    # Managed processes started with Backfill, and those started when work waits for them.
    processes: list[ManagedProcess] = field(default_factory=list)
    on_demand: dict[str, ManagedProcess] = field(default_factory=dict)
    # How long each engine started on demand may sit idle before it is stopped (by name).
    idle_stop_s: dict[str, float] = field(default_factory=dict)
    sharing: Sharing | None = None
    # The config file's engines stored for every worker (those without a command).
    stored: list[EngineSettings] = field(default_factory=list)


def _engines(settings: Settings) -> _Engines:
    built = _Engines()
    engines, processes = built.engines, built.processes
    limits: dict[str, ConcurrencyLimit] = {}
    probes: dict[str, PressureProbe] = {}
    priority_probes: dict[str, PriorityProbe] = {}
    if settings.local_engine:
        process, engine = _local(LOCAL_ENGINE, LOCAL_MODEL, settings.local_engine_concurrency)
        processes.append(process)
        engines.append(engine)
        limits[LOCAL_ENGINE] = ConcurrencyLimit(
            settings.local_engine_concurrency, settings.local_engine_mode
        )
    if settings.serves_local_embeddings:
        process, engine = _local(
            LOCAL_EMBEDDING_ENGINE,
            LOCAL_EMBEDDING_MODEL,
            settings.local_engine_concurrency,
            embedding=True,
        )
        if settings.local_embeddings == "auto":
            built.on_demand[LOCAL_EMBEDDING_ENGINE] = process
        else:
            processes.append(process)
        engines.append(engine)
    for spec in settings.engines:
        if not spec.command:
            # Served from the table every worker follows, which the file seeds.
            built.stored.append(spec)
            continue
        process = ManagedProcess(spec.name, spec.command)
        if spec.on_demand:
            built.on_demand[spec.name] = process
            built.idle_stop_s[spec.name] = spec.idle_stop_s
        else:
            processes.append(process)
        replica = _http_engine(spec, spec.name, process.base_url)
        engines.append(replica.engine)
        limits[spec.name] = replica.limit
        if replica.probe is not None:
            probes[spec.name] = replica.probe
        if replica.priority is not None:
            priority_probes[spec.name] = replica.priority
    built.sharing = Sharing(
        limits, probes, settings.worker.pressure_interval_s, priority_probes=priority_probes
    )
    return built


def _http_engine(spec: EngineSettings, name: str, base_url: str) -> Replica:
    """The engine an entry names at ``base_url`` (one of its replicas, when they are found
    by name), with its own limit and probes: every replica's load is its own."""
    engine = OpenAIHttpEngine(
        name,
        base_url,
        {m: spec.served_names.get(m, m) for m in spec.models},
        max_concurrency=spec.max_concurrency,
        request_timeout_s=spec.request_timeout_s,
        connect_timeout_s=spec.connect_timeout_s,
        api_key=spec.api_key,
        priority=spec.priority,
        json_schema_as_object=spec.json_schema_format == "json_object",
    )
    probe = priority = None
    if spec.mode == Mode.SHARED and spec.signal != "latency":
        flavor = None if spec.signal == "auto" else Flavor(spec.signal)
        metrics_url = spec.metrics_url or engine.metrics_url
        probe = MetricsProbe(metrics_url, flavor)
        priority = _priority_probe(spec, engine, metrics_url)
    return Replica(engine, _limit(spec), probe, priority)


def _stored_engine(spec: EngineSettings) -> Replica | DiscoveredEngine:
    """An engine stored for every worker: at its address, or its replicas found by name."""
    if spec.discovery != "none":
        return _discovered(spec)
    return _http_engine(spec, spec.name, spec.base_url)


def _reserved(settings: Settings) -> list[str]:
    """Engines only this process's file runs: the bundled ones and those with a command."""
    names = [spec.name for spec in settings.engines if spec.command]
    if settings.local_engine:
        names.append(LOCAL_ENGINE)
    if settings.serves_local_embeddings:
        names.append(LOCAL_EMBEDDING_ENGINE)
    return names


def _discovered(spec: EngineSettings) -> DiscoveredEngine:
    """An entry whose replicas are the addresses its base_url's host resolves to."""
    where = urlsplit(spec.base_url)
    port = where.port or (443 if where.scheme == "https" else 80)
    finder = DnsReplicas(
        where.hostname or "",
        port,
        srv=spec.discovery == "dns-srv",
        nameservers=spec.nameservers(),
    )

    def build(address: str, port: int) -> Replica:
        host = f"[{address}]" if ":" in address else address
        base_url = urlunsplit(where._replace(netloc=f"{host}:{port}"))
        return _http_engine(spec, replica_name(spec.name, address, port), base_url)

    return DiscoveredEngine(spec.name, tuple(spec.models), finder, spec.discovery_interval_s, build)


def _priority_probe(
    spec: EngineSettings, engine: OpenAIHttpEngine, metrics_url: str
) -> PriorityProbe | None:
    """Whether the engine applies the ``priority`` Backfill sends is found out where that can
    be measured: a priority to check, the slots to fill (``slots``) and vLLM's load gauges
    (signal auto or vllm; SGLang's priorities work otherwise)."""
    if spec.priority is None or spec.slots is None or spec.signal not in ("auto", "vllm"):
        return None
    if not spec.models:
        return None
    model = spec.models[0]
    return VllmPriorityProbe(
        engine.base_url,
        spec.served_names.get(model, model),
        spec.slots,
        spec.priority,
        metrics_url=metrics_url,
        headers={"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else None,
    )


def _local(
    name: str, model: str, concurrency: int, *, embedding: bool = False
) -> tuple[ManagedProcess, OpenAIHttpEngine]:
    """A llama.cpp process on the bundled GGUF serving ``model``, and the engine that calls it."""
    command = llama_cpp_command(model, n_ctx=LOCAL_CONTEXT, parallel=1, embedding=embedding)
    process = ManagedProcess(name, command)
    # llama-cpp-python's server takes a JSON Schema only inside json_object.
    engine = OpenAIHttpEngine(
        name,
        process.base_url,
        {model: model},
        max_concurrency=concurrency,
        json_schema_as_object=True,
    )
    return process, engine


def _media_fetcher(settings: Settings) -> SafeFetcher:
    """Fetches https images when their requests run (SPEC §10.4, docs/security.md)."""
    policy = FetchPolicy.outbound(
        settings.fetch,
        max_bytes=settings.limits.max_media_part_bytes,
        connect_timeout_s=settings.fetch.connect_timeout_s,
    )
    return SafeFetcher(policy)


def _webhooks(settings: Settings) -> SignedWebhooks:
    """Signs and posts webhooks under the same address rules as image fetches (SPEC §10.4)."""
    policy = FetchPolicy.outbound(
        settings.webhooks,
        # A receiver's answer is never read; the bound only keeps the policy whole.
        max_bytes=64 * 1024,
        connect_timeout_s=min(5.0, settings.webhooks.timeout_s),
        max_redirects=0,
    )
    return SignedWebhooks(policy)


def _notifier(
    settings: Settings,
    store: SqlStore,
    webhooks: SignedWebhooks,
    sealer: Sealer,
    clock: Clock,
    metrics: Metrics,
) -> Notifier:
    mailer = None
    smtp = settings.smtp
    if smtp.host:
        mailer = SmtpMailer(
            SmtpSettings(
                host=smtp.host,
                port=smtp.port,
                sender=smtp.sender,
                security=smtp.security,
                username=smtp.username,
                password=smtp.password,
                timeout_s=smtp.timeout_s,
            )
        )
    config = NotifyConfig(
        webhooks=RetrySchedule(settings.webhooks.attempts, settings.webhooks.retry_base_s),
        emails=RetrySchedule(smtp.attempts, smtp.retry_base_s),
        # The transport's own timeout decides first, with its own message; this bounds the rest.
        attempt_timeout_s=max(settings.webhooks.timeout_s, smtp.timeout_s) + 2,
        interval_s=settings.worker.notify_interval_s,
        public_url=settings.public_url,
    )
    return Notifier(store, webhooks, mailer, sealer, clock, config, metrics)


def _limit(spec: EngineSettings) -> ConcurrencyLimit:
    targets = SharedTargets(
        slots=spec.slots,
        headroom=spec.headroom,
        headroom_sigmas=spec.headroom_sigmas,
        kv_target=spec.kv_target,
        latency_tolerance=spec.latency_tolerance,
        engine_priority=spec.priority is not None,
        latency_budget=spec.latency_budget,
        give_back=spec.give_back,
        idle_after_s=spec.idle_after_s,
    )
    return ConcurrencyLimit(spec.max_concurrency, spec.mode, targets)


def _worker_name() -> str:
    """How operators tell workers apart in engine health: host and process, and a few random
    characters for processes that share both (tests run several in one)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def build(
    settings: Settings,
    *,
    role: str = "all",
    clock: Clock | None = None,
    engines: list[Engine] | None = None,
    sharing: Sharing | None = None,
) -> Backfill:
    clock = clock or SystemClock()
    private_dir(settings.data_dir)
    store = SqlStore(settings.resolved_database_url)
    _private_sqlite(store)
    if settings.storage_url.startswith("s3://") and not settings.master_key:
        raise ValueError(
            "With shared object storage every process needs the same master key: set "
            "master_key (BACKFILL_MASTER_KEY) to base64 of 32 random bytes."
        )
    master = load_master_key(settings.master_key, settings.data_dir / "master.key")
    keyring = master.keyring
    metrics = Metrics()
    blobs = EncryptedBlobStore(
        _raw_store(settings), keyring, on_damage=metrics.count_stored_file_damaged
    )
    catalog = CatalogService(store, clock)
    limits = Limits(
        settings.limits.max_file_bytes,
        settings.limits.max_lines,
        settings.limits.max_line_bytes,
        MediaLimits(
            settings.limits.max_media_part_bytes,
            settings.limits.max_media_bytes_per_line,
            settings.limits.max_media_parts_per_line,
            # Plain http image URLs are accepted at upload exactly when they can be fetched.
            allow_http=settings.fetch.allow_http,
        ),
        settings.limits.max_expanded_file_bytes,
        ignore_stream=settings.limits.ignore_stream,
    )
    files = FileService(
        store,
        blobs,
        catalog,
        clock,
        limits,
        settings.limits.input_file_ttl_s,
        max_retained_input_bytes=settings.limits.max_retained_input_bytes,
        on_damage=metrics.count_stored_file_damaged,
    )
    # Judges webhook URLs where they are given (batch creation, org endpoints) and, in a
    # worker, sends them.
    webhooks = _webhooks(settings)
    worker: Worker | None = None
    starter = BatchStarter(store, files, clock)
    built = _Engines()
    engine_admin = EngineAdmin(store, keyring, clock, reserved=_reserved(settings))
    # Engines given in code (the tests') are this worker's alone: nothing stored is served.
    stored_engines = engines is None
    if role in ("all", "worker"):
        if engines is None:
            built = _engines(settings)
            engines, sharing = built.engines, built.sharing
        worker = build_worker(
            WorkerInputs(
                store,
                blobs,
                keyring,
                engines,
                clock,
                catalog,
                starter,
                Janitor(
                    store,
                    files,
                    clock,
                    notifications=store,
                    keep_notifications_s=settings.limits.output_file_ttl_s,
                    audit=store,
                    keep_audit_s=settings.audit.retention_days * 86_400,
                ),
                metrics,
                Planner(
                    store,
                    clock,
                    interval_s=settings.scheduling.plan_interval_s,
                    margin_fraction=settings.scheduling.deadline_margin_fraction,
                ),
                sharing,
                built.on_demand,
                _media_fetcher(settings),
                _notifier(settings, store, webhooks, keyring, clock, metrics),
                name=_worker_name(),
                stored=StoredEngineInputs(engine_admin, _stored_engine, built.stored)
                if stored_engines
                else None,
                idle_stop_s=built.idle_stop_s,
            ),
            settings.worker,
            limits=settings.limits,
            fetch=settings.fetch,
            # Only a worker alone on its database may take back every lease at start.
            sole_worker=role == "all" and store.is_sqlite,
        )
    health = EngineHealth(
        store, clock, worker.engine_reports if worker is not None else None, ahead=store
    )
    batches = BatchService(
        store,
        files,
        catalog,
        clock,
        min_window_s=settings.limits.min_completion_window_s,
        max_window_s=settings.limits.max_completion_window_s,
        idempotency_required=settings.idempotency_required,
        limits=OrgLimits(
            settings.limits.max_unfinished_batches, settings.limits.max_retained_input_bytes
        ),
        starter=starter,
        events=worker,
        deadline_admission=settings.scheduling.deadline_admission,
        webhook_refusal=webhooks.refusal,
        health=health,
    )
    fleet = FleetService(store, clock, margin_fraction=settings.scheduling.deadline_margin_fraction)
    operations = Operations(
        store,
        metrics,
        worker.observe if worker is not None else None,
        health=health,
        fleet=fleet,
    )
    services = Services(
        TenantService(store, store, clock),
        files,
        batches,
        catalog,
        BillingService(store, store, clock),
        operations,
        NotificationService(store, store, store, keyring, clock, webhooks.refusal),
        ResultService(store, keyring, files),
        reruns=RerunService(store, batches, files, clock),
        account=AccountService(store, store),
        fleet=fleet,
        error_codes=ErrorCodeService(store, keyring, files),
        engines=engine_admin,
        audit=AuditLog(store, store),
        spend_caps=SpendCapService(store, store, clock),
        controls=BatchControls(store, store, batches, clock),
        estimates=EstimateService(store, batches, files, clock),
    )
    return Backfill(
        settings,
        store,
        blobs,
        services,
        worker,
        master,
        clock,
        built.processes,
        list(built.on_demand.values()),
    )
