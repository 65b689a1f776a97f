"""What an API key may read about itself and its org: who it is, the org's credit and ledger,
and what its batches were charged so far (the dashboard's account views, SPEC §11.4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backfill.domain import ids
from backfill.domain.overview import BatchCharges, LedgerEntry, OrgAccount
from backfill.domain.records import ApiKey, Org, Page
from backfill.errors import InvalidInput, Unauthorized
from backfill.ports import OverviewStore, TenantStore
from backfill.services.tenants import hash_secret

MAX_PAGE = 100
MAX_BATCH_IDS = 100


@dataclass(frozen=True, slots=True)
class Identity:
    """The key a request carries and the org it acts for."""

    key: ApiKey
    org: Org


def check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(
            f"'limit' must be from 1 to {MAX_PAGE} (it is {limit}).",
            code="invalid_value",
            param="limit",
        )
    return limit


def _key_gone() -> Unauthorized:
    return Unauthorized("The API key is not valid; check it or create a new one.")


class AccountService:
    def __init__(self, tenants: TenantStore, overview: OverviewStore) -> None:
        self._tenants = tenants
        self._overview = overview

    async def identity(self, secret: str) -> Identity:
        """The key with this secret and its org; the caller authenticated it already, so a
        miss here means it was revoked or removed in between."""
        key = await self._tenants.api_key_by_hash(hash_secret(secret))
        org = await self._overview.org_by_id(key.org_id) if key is not None else None
        if key is None or org is None or key.revoked_at is not None:
            raise _key_gone()
        return Identity(key, org)

    async def organization(self, org_id: str) -> OrgAccount:
        """The org and its credit: one read of its row and its credits, however many
        requests it was charged for."""
        found = await self._overview.org_account(org_id)
        if found is None:  # the key's org exists as long as the key does
            raise _key_gone()
        return found

    async def ledger_entries(self, org_id: str, after: str | None, limit: int) -> Page[LedgerEntry]:
        return await self._overview.ledger_entries(org_id, after, check_limit(limit))

    async def batch_charges(self, org_id: str, batch_ids: Sequence[str]) -> list[BatchCharges]:
        """The org's batches among ``batch_ids``, in that order, read at once; ids of no batch
        of the org (another org's, a deleted one) are left out, as a listing leaves them out."""
        if len(batch_ids) > MAX_BATCH_IDS:
            raise InvalidInput(
                f"'ids' names {len(batch_ids)} batches; ask for at most {MAX_BATCH_IDS} at once.",
                code="invalid_value",
                param="ids",
            )
        wanted = [batch_id for batch_id in dict.fromkeys(batch_ids) if ids.plausible(batch_id)]
        found = {c.id: c for c in await self._overview.batch_charges(org_id, wanted)}
        return [found[batch_id] for batch_id in wanted if batch_id in found]
