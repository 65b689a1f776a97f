"""Readiness, metrics and engine health for operators (SPEC §11.5)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from backfill.domain.engine_health import EngineReport, EngineState
from backfill.metrics import Metrics
from backfill.ports import OperationsStore
from backfill.services.engine_health import EngineHealth
from backfill.services.fleet import FleetService

log = logging.getLogger("backfill.api")


class Operations:
    def __init__(
        self,
        store: OperationsStore,
        metrics: Metrics,
        observe: Callable[[], None] | None = None,
        *,
        health: EngineHealth,
        fleet: FleetService,
    ) -> None:
        self._store = store
        self.metrics = metrics
        # Called before each scrape: the worker refreshes the gauges only it knows.
        self._observe = observe
        self._health = health
        self._fleet = fleet

    async def ready(self) -> bool:
        try:
            await self._store.ping()
        except Exception:  # any failure to reach the database means "not ready"
            log.warning("readiness check: the database is not reachable")
            return False
        return True

    async def engines(self) -> list[EngineReport]:
        """Every engine each live worker runs, with its health (by engine name, then worker)."""
        return await self._health.reports()

    async def render_metrics(self) -> bytes:
        statuses, depth = await self._store.gauges()
        self.metrics.batches.clear()
        for status, count in statuses.items():
            self.metrics.batches.labels(status).set(count)
        self.metrics.queue_depth.set(depth)
        self.metrics.dispatch_share.clear()
        for share in await self._store.dispatch_shares():
            self.metrics.dispatch_share.labels(share.model, share.org).set(share.share)
        await self._engine_gauges()
        await self._demand_gauges()
        if self._observe is not None:
            self._observe()
        return self.metrics.render()

    async def _engine_gauges(self) -> None:
        """Engine health and the batches it holds up, from what every live worker reported:
        labels are engine and model names only, as many as the configuration has."""
        reports = await self._health.reports()
        up: dict[str, bool] = {}
        for report in reports:
            # Stopped on purpose until work waits for it, or being started for it: neither
            # healthy nor a fault.
            if report.state not in (EngineState.STANDBY, EngineState.STARTING):
                up[report.engine] = up.get(report.engine, False) or report.healthy
        self.metrics.engine_healthy.clear()
        for engine, healthy in up.items():
            self.metrics.engine_healthy.labels(engine).set(1 if healthy else 0)
        self.metrics.batches_waiting_on_engine.clear()
        for model, count in (await self._health.batches_waiting()).items():
            self.metrics.batches_waiting_on_engine.labels(model).set(count)

    async def _demand_gauges(self) -> None:
        """What each model's queue asks of its fleet, by model name (as many labels as
        models)."""
        m = self.metrics
        gauges = (
            m.model_queued_requests,
            m.model_queued_tokens_bound,
            m.model_replicas,
            m.model_replica_requests_per_s,
            m.model_replicas_needed,
        )
        for gauge in gauges:
            gauge.clear()
        for found in await self._fleet.demand():
            model = found.model
            m.model_queued_requests.labels(model).set(found.queued_requests)
            m.model_queued_tokens_bound.labels(model).set(found.queued_tokens_bound)
            m.model_replicas.labels(model).set(found.replicas)
            if found.per_replica_rps is not None:
                m.model_replica_requests_per_s.labels(model).set(found.per_replica_rps)
            m.model_replicas_needed.labels(model).set(found.replicas_needed)
