"""The audit log's one insert, shared by the write transaction's hook (engine.py) and the
audit queries: a module of its own, since both build on it."""

from __future__ import annotations

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.domain.audit import AuditEntry


async def append(conn: AsyncConnection, entry: AuditEntry) -> int:
    """Inserts ``entry`` in ``conn``'s transaction; returns its id."""
    done = await conn.execute(
        insert(t.audit_log)
        .values(
            at=entry.at,
            actor=entry.actor,
            org_id=entry.org_id,
            action=entry.action,
            target=entry.target,
            address=entry.address,
            outcome=entry.outcome.value,
            status=entry.status,
            error=entry.error,
        )
        .returning(t.audit_log.c.id)
    )
    return int(done.scalar_one())
