"""Credit, receipts and the ledger (SPEC §6.4, §7.3, §7.7)."""

from __future__ import annotations

from backfill.domain.money import usd_to_pico
from backfill.errors import InvalidInput, NotFound
from backfill.ports import Clock, Ledger, Receipt, Store


class BillingService:
    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    async def add_credit(self, org_name: str, usd: str, note: str | None = None) -> int:
        """Credit ``usd`` (an exact decimal string) to an org; returns the new balance (pUSD)."""
        try:
            amount = usd_to_pico(usd)
        except ValueError as exc:
            raise InvalidInput(str(exc), code="invalid_value", param="usd") from None
        if amount <= 0:
            raise InvalidInput(
                "Credit must be a positive amount of USD.", code="invalid_value", param="usd"
            )
        org = await self._store.org_by_name(org_name)
        if org is None:
            raise NotFound(f"No organization named {org_name!r}.")
        return await self._store.add_credit(org.id, amount, note, int(self._clock.now()))

    async def ledger(self, org_id: str) -> Ledger:
        return await self._store.ledger(org_id)

    async def receipt(self, org_id: str, request_id: str) -> Receipt:
        receipt = await self._store.get_receipt(org_id, request_id)
        if receipt is None:
            raise NotFound(
                f"No receipt for request {request_id!r}; only successful requests of catalog "
                "batches are charged per request.",
                param="request_id",
            )
        return receipt
