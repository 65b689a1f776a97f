"""Readiness and metrics for operators (SPEC §11.5)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from backfill.metrics import Metrics
from backfill.ports import OperationsStore

log = logging.getLogger("backfill.api")


class Operations:
    def __init__(
        self,
        store: OperationsStore,
        metrics: Metrics,
        observe: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self.metrics = metrics
        # Called before each scrape: the worker refreshes the gauges only it knows.
        self._observe = observe

    async def ready(self) -> bool:
        try:
            await self._store.ping()
        except Exception:  # any failure to reach the database means "not ready"
            log.warning("readiness check: the database is not reachable")
            return False
        return True

    async def render_metrics(self) -> bytes:
        statuses, depth = await self._store.gauges()
        self.metrics.batches.clear()
        for status, count in statuses.items():
            self.metrics.batches.labels(status).set(count)
        self.metrics.queue_depth.set(depth)
        self.metrics.dispatch_share.clear()
        for share in await self._store.dispatch_shares():
            self.metrics.dispatch_share.labels(share.model, share.org).set(share.share)
        if self._observe is not None:
            self._observe()
        return self.metrics.render()
