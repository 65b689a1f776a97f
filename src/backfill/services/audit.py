"""The audit log's service (domain/audit.py): settling an action once its answer is known,
paging the log for the admin API and the CLI, and keeping it as long as the setting says."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from backfill.domain.audit import AuditEntry, AuditScope, Outcome
from backfill.errors import InvalidInput
from backfill.ports import AuditStore, TenantStore
from backfill.services.tenants import find_org

log = logging.getLogger("backfill.audit")

MAX_PAGE = 100
ID_PREFIX = "audit_"


def entry_id(entry: AuditEntry) -> str:
    return f"{ID_PREFIX}{entry.id}"


def parse_entry_id(value: str, param: str) -> int:
    number = value.removeprefix(ID_PREFIX)
    if not number.isdigit() or len(number) > 18:
        raise InvalidInput(
            f"'{param}' must be an audit entry id such as '{ID_PREFIX}42' (the 'id' of an "
            f"entry); got {value!r}.",
            param=param,
        )
    return int(number)


@dataclass(frozen=True, slots=True)
class AuditPage:
    entries: list[AuditEntry]
    has_more: bool


class AuditLog:
    def __init__(self, store: AuditStore, tenants: TenantStore) -> None:
        self._store = store
        self._tenants = tenants

    async def settle(self, scope: AuditScope, status: int, error: str | None = None) -> None:
        """Records how ``scope``'s action ended: a failure marks the row its change appended
        (a later step failed), and an action that appended none gets its row now. A request
        refused before its credentials were known is no one's action and is not recorded (the
        failed-credentials brake counts those)."""
        if scope.actor is None:
            return
        outcome = Outcome.SUCCEEDED if status < 400 else Outcome.FAILED
        try:
            if scope.recorded is None:
                await self._store.append_audit(scope.entry(outcome, status, error))
            elif outcome is Outcome.FAILED:
                await self._store.settle_audit(scope.recorded, outcome, status, error)
        except Exception:
            # The answer is already decided; the operator learns the row is missing.
            log.exception("could not record %s by %s in the audit log", scope.action, scope.actor)

    async def page(
        self,
        *,
        after: str | None = None,
        limit: int = 20,
        org: str | None = None,
        action: str | None = None,
        actor: str | None = None,
    ) -> AuditPage:
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidInput(f"'limit' must be 1 to {MAX_PAGE}; got {limit}.", param="limit")
        org_id = (await find_org(self._tenants, org)).id if org is not None else None
        entries = await self._store.audit_page(
            # Newest first: the entries after the one named are the older ones.
            before=parse_entry_id(after, "after") if after is not None else None,
            limit=limit + 1,
            org_id=org_id,
            action=action,
            actor=actor,
        )
        return AuditPage(entries[:limit], len(entries) > limit)
