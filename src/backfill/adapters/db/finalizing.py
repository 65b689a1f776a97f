"""Finalizing: the per-batch finalize lease, the fenced publish, and named singleton leases.

Many worker processes share one database; these leases make one of them finalize a batch and
one of them run the janitor, and the token fence keeps a holder whose lease ran out from
publishing over the one that took its place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, or_, select, update

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.outbox import enqueue_terminal
from backfill.adapters.db.rows import file_values, release_reservation
from backfill.domain.files import FileRecord, input_expiry_at_publish
from backfill.domain.lifecycle import TIMESTAMP_OF, BatchStatus
from backfill.domain.records import FinalizeLease


class FinalizeQueries(SqlBase):
    async def take_finalize(
        self, batch_id: str, statuses: Sequence[str], token: str, until: float, now: float
    ) -> FinalizeLease:
        b = t.batches
        async with self.engine.connect() as conn:
            seen = (
                await conn.execute(
                    select(b.c.status, b.c.finalizer, b.c.finalize_until).where(b.c.id == batch_id)
                )
            ).one_or_none()
        # Every worker polls finalizing batches: a read answers "held" without writing.
        if seen is None or seen.status not in statuses:
            return FinalizeLease(taken=False)
        if not (
            seen.finalize_until is None or seen.finalize_until < now or seen.finalizer == token
        ):
            return FinalizeLease(taken=False)
        async with self.engine.begin() as conn:
            res = await conn.execute(
                update(b)
                .where(
                    b.c.id == batch_id,
                    b.c.status.in_(statuses),
                    or_(
                        b.c.finalize_until.is_(None),
                        b.c.finalize_until < now,
                        b.c.finalizer == token,
                    ),
                    # Also compare-and-set on the holder read above: the one statement decides,
                    # and when it succeeds ``previous`` is exactly the attempt it replaced.
                    b.c.finalizer.is_(None)
                    if seen.finalizer is None
                    else b.c.finalizer == seen.finalizer,
                )
                .values(finalizer=token, finalize_until=until)
            )
        if not res.rowcount:
            return FinalizeLease(taken=False)
        return FinalizeLease(taken=True, previous=seen.finalizer)

    async def renew_finalize(self, batch_id: str, token: str, until: float) -> bool:
        b = t.batches
        async with self.engine.begin() as conn:
            res = await conn.execute(
                update(b)
                .where(b.c.id == batch_id, b.c.finalizer == token)
                .values(finalize_until=until)
            )
        return bool(res.rowcount)

    async def release_finalize(self, batch_id: str, token: str) -> None:
        b = t.batches
        # The token stays: the next holder reads it as ``previous`` and removes what this
        # attempt may have left in blob storage.
        async with self.engine.begin() as conn:
            await conn.execute(
                update(b)
                .where(b.c.id == batch_id, b.c.finalizer == token)
                .values(finalize_until=None)
            )

    async def publish(
        self,
        batch_id: str,
        expected_status: str,
        status: str,
        now: int,
        output: FileRecord,
        errors: FileRecord,
        *,
        token: str,
    ) -> bool:
        b = t.batches
        values: dict[str, Any] = {
            "status": status,
            "output_file_id": output.id,
            "error_file_id": errors.id,
            "finalizer": None,
            "finalize_until": None,
        }
        column = TIMESTAMP_OF.get(BatchStatus(status))
        if column:
            values[column] = now
        async with self.engine.begin() as conn:
            published = (
                await conn.execute(
                    update(b)
                    .where(
                        b.c.id == batch_id,
                        b.c.status == expected_status,
                        # The fence: only the current lease holder publishes. One whose lease
                        # ran out and was taken over finds another token here.
                        b.c.finalizer == token,
                    )
                    .values(**values)
                    .returning(b.c.input_file_id)
                )
            ).first()
            if published is None:
                return False
            for record in (output, errors):
                await conn.execute(insert(t.files).values(**file_values(record)))
            await release_reservation(conn, batch_id)
            await enqueue_terminal(conn, batch_id, now)
            # Accepted input is removed once its batch is over (SPEC §10.3): the janitor takes
            # it unless another unfinished batch still reads it.
            f = t.files
            current = (
                await conn.execute(
                    self.dialect.for_update(
                        select(f.c.expires_at).where(f.c.id == published.input_file_id)
                    )
                )
            ).first()
            if current is not None:
                await conn.execute(
                    update(f)
                    .where(f.c.id == published.input_file_id)
                    .values(expires_at=input_expiry_at_publish(current.expires_at, now))
                )
        return True

    async def take_singleton(self, name: str, holder: str, until: float, now: float) -> bool:
        s = t.singletons
        # One upsert: concurrent takers of a free or expired name serialise on its row, and
        # the conflict branch only fires for an expired lease or its holder.
        stmt = self.dialect.upsert(
            s,
            {"name": name, "holder": holder, "until": until},
            key=[s.c.name],
            replace=["holder", "until"],
            where=or_(s.c.until < now, s.c.holder == holder),
        ).returning(s.c.name)
        async with self.engine.begin() as conn:
            return (await conn.execute(stmt)).first() is not None
