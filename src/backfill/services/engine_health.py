"""Engine health as every process shows it (the admin API, ``backfill admin engine list``,
batches' ``waiting_on``, ``/metrics``): the reports live workers stored, with this process's
own worker seen as it is now rather than as of its last report; and, for ``waiting_on``, the
lanes' waits the planner stored (domain/waiting.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from backfill.domain.engine_health import EngineReport, ModelHealth, model_health
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord, Page
from backfill.domain.waiting import AheadInLane, LaneWait, may_wait, waiting_on
from backfill.ports import BatchControlStore, Clock, EngineHealthStore

# Batch reads are the API's most frequent requests (SDKs poll): the models' health and the
# lanes' waits they show are read from the database at most this often per process.
MODELS_CACHE_S = 1.0


class EngineHealth:
    def __init__(
        self,
        store: EngineHealthStore,
        clock: Clock,
        local: Callable[[], list[EngineReport]] | None = None,
        ahead: BatchControlStore | None = None,
        *,
        cache_s: float = MODELS_CACHE_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``local``: this process's worker's reports as of now (None: no worker here);
        ``ahead``: where the batches that go before others of their org are read (None: the
        ``priority`` reason is not shown)."""
        self._store = store
        self._ahead_store = ahead
        self._clock = clock
        self._local = local
        self._cache_s = cache_s
        self._monotonic = monotonic
        self._models: tuple[float, dict[str, ModelHealth]] | None = None
        self._lanes: tuple[float, dict[tuple[str, str], LaneWait]] | None = None

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

    async def lane_waits(self) -> dict[tuple[str, str], LaneWait]:
        """Why lanes' batches wait (credit, fair share), as the planner last stored it."""
        cached, at = self._lanes, self._monotonic()
        if cached is not None and at - cached[0] < self._cache_s:
            return cached[1]
        waits = await self._store.lane_waits()
        self._lanes = (at, waits)
        return waits

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
        """``batch`` with ``waiting_on`` set when something keeps it from moving now."""
        if not may_wait(batch):
            return batch
        health, lanes = await self.models(), await self.lane_waits()
        ahead = await self._ahead([batch])
        wait = waiting_on(batch, health, lanes, self._clock.now(), ahead.get(batch.id))
        return replace(batch, waiting_on=wait)

    async def annotate_page(self, page: Page[BatchRecord]) -> Page[BatchRecord]:
        if not any(may_wait(batch) for batch in page.items):
            return page
        health, lanes, now = await self.models(), await self.lane_waits(), self._clock.now()
        ahead = await self._ahead(page.items)
        items = [
            replace(b, waiting_on=waiting_on(b, health, lanes, now, ahead.get(b.id)))
            for b in page.items
        ]
        return replace(page, items=items)

    async def _ahead(self, batches: Sequence[BatchRecord]) -> dict[str, AheadInLane]:
        """The org's batches that go before each running, unpaused one with nothing running:
        read only for those (the API's polls of other batches read nothing more)."""
        ids = [
            b.id
            for b in batches
            if may_wait(b) and b.status == BatchStatus.IN_PROGRESS and b.paused_at is None
        ]
        if not ids or self._ahead_store is None:
            return {}
        return await self._ahead_store.batches_ahead(ids)
