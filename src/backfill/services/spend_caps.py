"""Spend caps of orgs and API keys (docs/billing.md, "Spend caps"): set, remove and read them
with what their current windows hold. Admission enforces them (domain/spend_caps.py)."""

from __future__ import annotations

from backfill.domain import ids
from backfill.domain.records import ApiKey
from backfill.domain.spend_caps import (
    CapScope,
    CapUse,
    Period,
    SpendCap,
    parse_limit,
    parse_period,
)
from backfill.errors import NotFound
from backfill.ports import Clock, SpendCapStore, TenantStore
from backfill.services.tenants import find_org, no_such_key


class SpendCapService:
    def __init__(self, store: SpendCapStore, tenants: TenantStore, clock: Clock) -> None:
        self._store = store
        self._tenants = tenants
        self._clock = clock

    async def set_org_cap(self, org_name: str, period: object, usd: object) -> CapUse:
        """Cap what org ``org_name`` may spend in each ``period``: ``usd``, an exact decimal
        string. Replaces the org's cap of that period; answers it with its current window."""
        when, limit = parse_period(period), parse_limit(usd)
        org = await find_org(self._tenants, org_name)
        return await self._put(CapScope.ORG, org.id, org.id, when, limit)

    async def set_key_cap(self, key_id: str, period: object, usd: object) -> CapUse:
        """Cap what API key ``key_id`` may spend in each ``period``, as ``set_org_cap``."""
        when, limit = parse_period(period), parse_limit(usd)
        key = await self._key(key_id)
        return await self._put(CapScope.KEY, key.id, key.org_id, when, limit)

    async def remove_org_cap(self, org_name: str, period: object) -> None:
        when = parse_period(period)
        org = await find_org(self._tenants, org_name)
        if not await self._store.delete_spend_cap(org.id, when):
            raise NotFound(
                f"Organization {org_name!r} has no {when.value} spend cap.", param="period"
            )

    async def remove_key_cap(self, key_id: str, period: object) -> None:
        when = parse_period(period)
        key = await self._key(key_id)
        if not await self._store.delete_spend_cap(key.id, when):
            raise NotFound(f"API key {key_id!r} has no {when.value} spend cap.", param="period")

    async def org_caps(self, org_name: str) -> list[CapUse]:
        """Org ``org_name``'s caps, its own and its keys', with what their windows hold."""
        org = await find_org(self._tenants, org_name)
        return await self.uses(org.id)

    async def uses(self, org_id: str) -> list[CapUse]:
        """The caps of org ``org_id`` and of its keys, with what their windows hold now."""
        return await self._store.spend_cap_uses(org_id, self._clock.now())

    async def _put(
        self, scope: CapScope, scope_id: str, org_id: str, period: Period, limit: int
    ) -> CapUse:
        now = self._clock.now()
        return await self._store.put_spend_cap(
            SpendCap(scope, scope_id, org_id, period, limit, int(now)), now
        )

    async def _key(self, key_id: str) -> ApiKey:
        key = await self._tenants.api_key_by_id(key_id) if ids.plausible(key_id) else None
        if key is None:
            raise no_such_key(key_id)
        return key
