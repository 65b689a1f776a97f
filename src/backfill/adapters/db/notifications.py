"""The notification outbox and the org settings it reads: signing secrets, registered webhook
endpoints, the notification email address."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, insert, literal, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.domain.notifications import (
    Attempt,
    Channel,
    DeliveryState,
    Endpoint,
    Notification,
    ReplacedSecret,
    SealedSecrets,
)


def _notification(row: Any) -> Notification:
    return Notification(
        id=row.id,
        org_id=row.org_id,
        batch_id=row.batch_id,
        channel=Channel(row.channel),
        target=row.target,
        event=row.event,
        payload=row.payload,
        created_at=row.created_at,
        state=DeliveryState(row.state),
        attempts=row.attempts,
        next_at=row.next_at,
        endpoint_id=row.endpoint_id,
        last_status_code=row.last_status_code,
        last_error=row.last_error,
        last_attempt_at=row.last_attempt_at,
        delivered_at=row.delivered_at,
    )


async def endpoints_of(conn: AsyncConnection, org_id: str) -> list[Endpoint]:
    """The org's registered webhook endpoints, oldest first."""
    e = t.webhook_endpoints
    rows = await conn.execute(
        select(e.c.id, e.c.url, e.c.events)
        .where(e.c.org_id == org_id)
        .order_by(e.c.created_at, e.c.id)
    )
    return [Endpoint(r.id, r.url, frozenset(r.events.split(","))) for r in rows]


async def _secrets_of(conn: AsyncConnection, org_id: str) -> SealedSecrets:
    o = t.orgs
    row = (
        await conn.execute(
            select(
                o.c.webhook_secret,
                o.c.webhook_secret_previous,
                o.c.webhook_secret_rotated_at,
                o.c.webhook_secret_older,
                o.c.webhook_secret_older_rotated_at,
            ).where(o.c.id == org_id)
        )
    ).one()
    replaced = tuple(
        ReplacedSecret(sealed, at)
        for sealed, at in ((row[1], row[2]), (row[3], row[4]))
        if sealed is not None and at is not None
    )
    return SealedSecrets(row[0], replaced)


# An idle sender's poll, built once.
_ANY_DUE = (
    select(t.notifications.c.id)
    .where(
        t.notifications.c.state == DeliveryState.PENDING,
        t.notifications.c.next_at <= bindparam("now"),
    )
    .limit(1)
)


def _any_due(conn: Connection, now: float) -> bool:
    return conn.execute(_ANY_DUE, {"now": now}).first() is not None


class NotificationQueries(SqlBase):
    async def claim_notifications(
        self, now: float, token: str, until: float, limit: int
    ) -> list[Notification]:
        n = t.notifications
        # Every sender polls: a read answers "nothing due" without taking the write lock (one
        # trip on SQLite).
        if not await self.in_one_trip("looking for due notifications", _any_due, now):
            return []
        due = (
            select(n.c.id)
            .where(n.c.state == DeliveryState.PENDING, n.c.next_at <= now)
            .order_by(n.c.next_at)
            .limit(limit)
        )
        async with self.writing("leasing notifications") as conn:
            if not self.is_sqlite:
                # Senders on other processes skip the rows one has locked instead of queueing.
                due = due.with_for_update(skip_locked=True)
            picked = list((await conn.execute(due)).scalars())
            if not picked:
                return []
            # ``next_at`` moves to the lease's end: a sender that dies mid-attempt leaves the
            # message due again then, to be tried (with the same id) by whoever is alive.
            rows = await conn.execute(
                update(n)
                # Checked again here: on SQLite another sender may have leased one since the
                # read (PostgreSQL holds the rows locked).
                .where(n.c.id.in_(picked), n.c.state == DeliveryState.PENDING, n.c.next_at <= now)
                .values(
                    lease_token=token,
                    lease_until=until,
                    next_at=until,
                    attempts=n.c.attempts + 1,
                    last_attempt_at=int(now),
                )
                .returning(*n.c)
            )
            return [_notification(row) for row in rows]

    async def finish_attempt(self, message_id: str, token: str, attempt: Attempt) -> bool:
        n = t.notifications
        if attempt.delivered:
            state, next_at = DeliveryState.DELIVERED, None
        elif attempt.next_at is None:
            state, next_at = DeliveryState.GIVEN_UP, None
        else:
            state, next_at = DeliveryState.PENDING, attempt.next_at
        values: dict[str, Any] = {
            "state": state,
            "lease_token": None,
            "lease_until": None,
            "last_status_code": attempt.status_code,
            "last_error": attempt.error,
        }
        if next_at is not None:
            values["next_at"] = next_at
        if attempt.delivered:
            values["delivered_at"] = attempt.at
        async with self.writing("recording a notification attempt") as conn:
            res = await conn.execute(
                update(n).where(n.c.id == message_id, n.c.lease_token == token).values(**values)
            )
        return bool(res.rowcount)

    async def give_back(self, message_id: str, token: str, now: float) -> bool:
        n = t.notifications
        async with self.writing("handing back a notification") as conn:
            res = await conn.execute(
                update(n)
                .where(
                    n.c.id == message_id,
                    n.c.lease_token == token,
                    n.c.state == DeliveryState.PENDING,
                )
                .values(lease_token=None, lease_until=None, next_at=now, attempts=n.c.attempts - 1)
            )
        return bool(res.rowcount)

    async def prune_notifications(self, settled_before: int) -> int:
        n = t.notifications
        async with self.writing("pruning notifications") as conn:
            res = await conn.execute(
                delete(n).where(n.c.state != DeliveryState.PENDING, n.c.created_at < settled_before)
            )
        return int(res.rowcount)

    async def batch_notifications(self, org_id: str, batch_id: str) -> list[Notification]:
        n = t.notifications
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(n)
                .where(n.c.batch_id == batch_id, n.c.org_id == org_id)
                .order_by(n.c.created_at, n.c.channel, n.c.id)
            )
            return [_notification(row) for row in rows]

    async def webhook_secrets(self, org_id: str) -> SealedSecrets:
        async with self.engine.connect() as conn:
            return await _secrets_of(conn, org_id)

    async def set_webhook_secret(
        self, org_id: str, sealed: bytes, now: int, *, rotate: bool
    ) -> SealedSecrets:
        o = t.orgs
        async with self.writing() as conn:
            if rotate:
                await conn.execute(
                    update(o)
                    .where(o.c.id == org_id)
                    # One statement, each value from the row as it was: concurrent rotations
                    # replace one after the other and lose no secret they handed out.
                    .values(
                        webhook_secret_older=o.c.webhook_secret_previous,
                        webhook_secret_older_rotated_at=o.c.webhook_secret_rotated_at,
                        webhook_secret_previous=o.c.webhook_secret,
                        webhook_secret=sealed,
                        webhook_secret_rotated_at=now,
                    )
                )
            else:
                # Two senders making an org's first secret at once keep the one stored first.
                await conn.execute(
                    update(o)
                    .where(o.c.id == org_id, o.c.webhook_secret.is_(None))
                    .values(webhook_secret=sealed)
                )
            return await _secrets_of(conn, org_id)

    async def add_webhook_endpoint(
        self, org_id: str, endpoint: Endpoint, now: int, max_endpoints: int
    ) -> bool:
        e = t.webhook_endpoints
        held = select(func.count()).select_from(e).where(e.c.org_id == org_id).scalar_subquery()
        row = select(
            literal(endpoint.id),
            literal(org_id),
            literal(endpoint.url),
            literal(",".join(sorted(endpoint.events))),
            literal(now),
        ).where(held < max_endpoints)
        async with self.writing() as conn:
            # The org row is PostgreSQL's lock between concurrent adds; on SQLite the one
            # statement that counts and inserts is the unit of serialisation.
            await self.dialect.lock(conn, select(t.orgs.c.id).where(t.orgs.c.id == org_id))
            res = await conn.execute(
                insert(e).from_select(["id", "org_id", "url", "events", "created_at"], row)
            )
        return bool(res.rowcount)

    async def webhook_endpoints(self, org_id: str) -> list[Endpoint]:
        async with self.engine.connect() as conn:
            return await endpoints_of(conn, org_id)

    async def remove_webhook_endpoint(self, org_id: str, endpoint_id: str) -> bool:
        e = t.webhook_endpoints
        async with self.writing() as conn:
            res = await conn.execute(delete(e).where(e.c.id == endpoint_id, e.c.org_id == org_id))
        return bool(res.rowcount)

    async def set_notify_email(self, org_id: str, email: str | None) -> None:
        async with self.writing() as conn:
            await conn.execute(
                update(t.orgs).where(t.orgs.c.id == org_id).values(notify_email=email)
            )

    async def notify_email(self, org_id: str) -> str | None:
        async with self.engine.connect() as conn:
            value = (
                await conn.execute(select(t.orgs.c.notify_email).where(t.orgs.c.id == org_id))
            ).scalar_one_or_none()
        return None if value is None else str(value)
