"""What an operator reads across orgs: each org's credit and the queue by model (the
dashboard's admin views, SPEC §11.4)."""

from __future__ import annotations

from backfill.domain.overview import ModelQueue, OrgCredit
from backfill.domain.records import Page
from backfill.ports import OverviewStore
from backfill.services.account import check_limit


class FleetService:
    def __init__(self, overview: OverviewStore) -> None:
        self._overview = overview

    async def org_credits(self, after: str | None, limit: int) -> Page[OrgCredit]:
        return await self._overview.org_credits(after, check_limit(limit))

    async def queue(self) -> list[ModelQueue]:
        return await self._overview.queue_by_model()
