"""The notification outbox: messages written in the transaction that ends a batch, so a
process killed right after the batch ended still sends them once it is back."""

from __future__ import annotations

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.notifications import endpoints_of
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.notifications import (
    DeliveryState,
    EndedBatch,
    messages_for,
)


async def enqueue_terminal(conn: AsyncConnection, batch_id: str, now: int) -> int:
    """Write the messages of ``batch_id``'s end (it was just moved to a terminal status in
    ``conn``'s transaction); how many."""
    b = t.batches
    row = (
        await conn.execute(
            select(
                b.c.id,
                b.c.org_id,
                b.c.status,
                b.c.metadata,
                b.c.webhook_url,
                b.c.total,
                b.c.completed,
                b.c.failed,
            ).where(b.c.id == batch_id)
        )
    ).one()
    ended = EndedBatch(
        id=row.id,
        org_id=row.org_id,
        status=BatchStatus(row.status),
        metadata=row.metadata,
        webhook_url=row.webhook_url,
        total=row.total,
        completed=row.completed,
        failed=row.failed,
    )
    endpoints = await endpoints_of(conn, row.org_id)
    email = (
        await conn.execute(select(t.orgs.c.notify_email).where(t.orgs.c.id == row.org_id))
    ).scalar_one_or_none()
    messages = messages_for(ended, endpoints, email, now)
    if messages:
        await conn.execute(
            insert(t.notifications),
            [
                {
                    "id": m.id,
                    "org_id": row.org_id,
                    "batch_id": batch_id,
                    "channel": m.channel.value,
                    "endpoint_id": m.endpoint_id,
                    "target": m.target,
                    "event": m.event,
                    "payload": m.payload,
                    "created_at": now,
                    "state": DeliveryState.PENDING,
                    "attempts": 0,
                    "next_at": float(now),
                }
                for m in messages
            ],
        )
    return len(messages)
