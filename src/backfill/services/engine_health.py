"""Engine health as every process shows it (the admin API, ``backfill admin engine list``,
batches' ``waiting_on``, ``/metrics``): the reports live workers stored, with this process's
own worker seen as it is now rather than as of its last report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from backfill.domain.engine_health import (
    EngineReport,
    ModelHealth,
    may_wait,
    model_health,
    waiting_on,
)
from backfill.domain.records import BatchRecord, Page
from backfill.ports import Clock, EngineHealthStore

# Batch reads are the API's most frequent requests (SDKs poll): the models' health they show is
# read from the database at most this often per process.
MODELS_CACHE_S = 1.0


class EngineHealth:
    def __init__(
        self,
        store: EngineHealthStore,
        clock: Clock,
        local: Callable[[], list[EngineReport]] | None = None,
        *,
        cache_s: float = MODELS_CACHE_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``local``: this process's worker's reports as of now (None: no worker here)."""
        self._store = store
        self._clock = clock
        self._local = local
        self._cache_s = cache_s
        self._monotonic = monotonic
        self._models: tuple[float, dict[str, ModelHealth]] | None = None

    async def reports(self) -> list[EngineReport]:
        """Every live worker's engines, by engine name then worker."""
        stored = await self._store.engine_reports(self._clock.now())
        if self._local is None:
            return stored
        live = self._local()
        here = {report.worker for report in live}
        merged = [r for r in stored if r.worker not in here] + live
        return sorted(merged, key=lambda r: (r.engine, r.worker))

    async def models(self) -> dict[str, ModelHealth]:
        """Each model some engine serves, and whether one of them can take its work now."""
        cached, at = self._models, self._monotonic()
        if cached is not None and at - cached[0] < self._cache_s:
            return cached[1]
        health = model_health(await self.reports())
        self._models = (at, health)
        return health

    async def batches_waiting(self) -> dict[str, int]:
        """By model (each one an engine serves or a running batch names): how many running
        batches wait because no engine can serve the model now (0 when one can)."""
        models = await self.models()
        running = await self._store.running_batches_by_model()
        return {
            model: 0 if model in models and models[model].available else running.get(model, 0)
            for model in sorted(set(models) | set(running))
        }

    async def annotate(self, batch: BatchRecord) -> BatchRecord:
        """``batch`` with ``waiting_on`` set when no engine can serve its model now."""
        if not may_wait(batch):
            return batch
        return replace(batch, waiting_on=waiting_on(batch, await self.models()))

    async def annotate_page(self, page: Page[BatchRecord]) -> Page[BatchRecord]:
        if not any(may_wait(batch) for batch in page.items):
            return page
        health = await self.models()
        items = [replace(b, waiting_on=waiting_on(b, health)) for b in page.items]
        return replace(page, items=items)
