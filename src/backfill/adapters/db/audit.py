"""The audit log's reads, its settling writes and its retention (domain/audit.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select, update

from backfill.adapters.db import audit_rows
from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.domain.audit import AuditEntry, Outcome

_a = t.audit_log


def _entry(row: Any) -> AuditEntry:
    return AuditEntry(
        id=int(row.id),
        at=float(row.at),
        actor=row.actor,
        org_id=row.org_id,
        action=row.action,
        target=row.target,
        address=row.address,
        outcome=Outcome(row.outcome),
        status=int(row.status),
        error=row.error,
    )


class AuditQueries(SqlBase):
    async def append_audit(self, entry: AuditEntry) -> int:
        async with self.writing() as conn:
            return await audit_rows.append(conn, entry)

    async def settle_audit(
        self, entry_id: int, outcome: Outcome, status: int, error: str | None
    ) -> None:
        async with self.writing() as conn:
            await conn.execute(
                update(_a)
                .where(_a.c.id == entry_id)
                .values(outcome=outcome.value, status=status, error=error)
            )

    async def audit_page(
        self,
        *,
        before: int | None,
        limit: int,
        org_id: str | None = None,
        action: str | None = None,
        actor: str | None = None,
    ) -> list[AuditEntry]:
        query = select(_a).order_by(_a.c.id.desc()).limit(limit)
        if before is not None:
            query = query.where(_a.c.id < before)
        if org_id is not None:
            query = query.where(_a.c.org_id == org_id)
        if action is not None:
            query = query.where(_a.c.action == action)
        if actor is not None:
            query = query.where(_a.c.actor == actor)
        async with self.reads.connect() as conn:
            return [_entry(row) for row in await conn.execute(query)]

    async def prune_audit(self, before_at: float) -> int:
        async with self.writing() as conn:
            done = await conn.execute(delete(_a).where(_a.c.at < before_at))
        return done.rowcount or 0
