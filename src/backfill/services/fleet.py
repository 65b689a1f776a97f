"""What an operator reads across orgs: each org's credit, the queue by model, and what each
model's queue asks of its fleet (the dashboard's admin views, SPEC §11.4; the autoscaling
signal on /metrics)."""

from __future__ import annotations

from dataclasses import replace

from backfill.domain.overview import ModelQueue, OrgCredit
from backfill.domain.records import Page
from backfill.domain.scheduling.demand import ModelDemand, demand
from backfill.ports import Clock, OverviewStore
from backfill.services.account import check_limit


class FleetService:
    def __init__(self, overview: OverviewStore, clock: Clock, *, margin_fraction: float) -> None:
        """``margin_fraction``: the planner's deadline margin, which the demand keeps too."""
        self._overview = overview
        self._clock = clock
        self._margin_fraction = margin_fraction

    async def org_credits(self, after: str | None, limit: int) -> Page[OrgCredit]:
        return await self._overview.org_credits(after, check_limit(limit))

    async def queue(self) -> list[ModelQueue]:
        """Each model with unfinished batches, with what its queue asks of its fleet."""
        found = await self._overview.queue_by_model()
        demands = {d.model: d for d in await self.demand(also=[q.model for q in found])}
        return [replace(q, demand=demands[q.model]) for q in found]

    async def demand(self, also: list[str] | None = None) -> list[ModelDemand]:
        """What each model's queue asks of its fleet now (every model with queued work, a
        measured rate or a replica up, and each of ``also``), computed from stored state:
        every process answers the same."""
        inputs = await self._overview.demand_inputs()
        return demand(inputs, self._clock.now(), self._margin_fraction, also or ())
