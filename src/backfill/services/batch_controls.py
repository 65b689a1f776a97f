"""A running batch's controls for its owner: priority, pause and resume (docs/api.md,
"Priority and pause"); and each org's priority cap, for administrators."""

from __future__ import annotations

from collections.abc import Mapping

from backfill.domain import priority as prio
from backfill.domain.records import BatchRecord, Org
from backfill.errors import Conflict
from backfill.ports import BatchControlStore, Clock, TenantStore
from backfill.services.batches import BatchService
from backfill.services.tenants import checked_weight, find_org, no_such_org


class BatchControls:
    def __init__(
        self,
        store: BatchControlStore,
        tenants: TenantStore,
        batches: BatchService,
        clock: Clock,
    ) -> None:
        self._store = store
        self._tenants = tenants
        self._batches = batches
        self._clock = clock

    async def set_priority(self, org_id: str, batch_id: str, priority: object) -> BatchRecord:
        """Give the batch ``priority``: its lines move in its org's queue at once."""
        batch = await self._batches.found(org_id, batch_id)
        checked = await self._batches.checked_priority(org_id, priority)
        changed = await self._store.set_priority(batch.id, checked)
        if changed is None:
            raise _ended(batch, "change its priority")
        return await self._batches.annotated(changed)

    async def pause(self, org_id: str, batch_id: str) -> BatchRecord:
        """Start none of its lines until it is resumed; those running finish."""
        batch = await self._batches.found(org_id, batch_id)
        changed = await self._store.pause(batch.id, int(self._clock.now()))
        if changed is None:
            raise _ended(batch, "pause it")
        return await self._batches.annotated(changed)

    async def resume(self, org_id: str, batch_id: str) -> BatchRecord:
        batch = await self._batches.found(org_id, batch_id)
        changed = await self._store.resume(batch.id)
        if changed is None:
            raise _ended(batch, "resume it")
        return await self._batches.annotated(changed)

    async def update_org(self, name: str, changes: Mapping[str, object]) -> Org:
        """Change org ``name``'s ``weight``, ``max_priority`` or both (``changes``, by field,
        a value sent as null included). Both are judged before anything changes, so a refused
        value changes nothing; an unknown org is 404."""
        weight = checked_weight(changes["weight"]) if "weight" in changes else None
        cap = prio.check_cap(changes["max_priority"]) if "max_priority" in changes else None
        org = await find_org(self._tenants, name)
        if weight is not None:
            # None: the org was removed meanwhile.
            updated = await self._tenants.set_org_weight(org.id, weight)
            if updated is None:
                raise no_such_org(name)
            org = updated
        if cap is not None:
            if not await self._store.set_max_priority(org.id, cap):
                raise no_such_org(name)
            org.max_priority = cap
        return org


def _ended(batch: BatchRecord, what: str) -> Conflict:
    return Conflict(
        f"Batch {batch.id} is {batch.status}: only a validating or in-progress batch can {what}.",
        code="batch_not_running",
        param="batch_id",
    )
