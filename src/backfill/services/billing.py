"""Credit, receipts and the ledger (SPEC §6.4, §7.3, §7.7)."""

from __future__ import annotations

from backfill.domain.money import MAX_CREDIT, MAX_CREDIT_USD, usd_to_pico
from backfill.domain.records import Ledger, Receipt
from backfill.errors import InvalidInput, NotFound
from backfill.ports import Clock, LedgerStore, TenantStore
from backfill.services.tenants import find_org, printable

MAX_NOTE_CHARS = 200


class BillingService:
    def __init__(self, store: LedgerStore, tenants: TenantStore, clock: Clock) -> None:
        self._store = store
        self._tenants = tenants
        self._clock = clock

    async def add_credit(self, org_name: str, usd: str, note: str | None = None) -> int:
        """Credit ``usd`` (an exact decimal string) to an org; returns the new balance (pUSD)."""
        return (await self.credit(org_name, usd, note)).balance

    async def credit(self, org_name: str, usd: str, note: str | None = None) -> Ledger:
        """Credit ``usd`` to an org; returns the ledger as the crediting transaction left it,
        so a caller never has to read again (and never retries a credit that went through)."""
        limit = f"a credit is a positive USD amount of at most {MAX_CREDIT_USD} (e.g. 12.50)"
        try:
            amount = usd_to_pico(usd)
        except ValueError as exc:
            raise InvalidInput(f"{exc}; {limit}.", code="invalid_value", param="usd") from None
        if not 0 < amount <= MAX_CREDIT:
            raise InvalidInput(
                f"{usd!r} is out of range; {limit}.", code="invalid_value", param="usd"
            )
        if note is not None:
            printable(note, "note", MAX_NOTE_CHARS, allow_empty=True)
        org = await find_org(self._tenants, org_name)
        return await self._store.credit(org.id, amount, note, int(self._clock.now()))

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
