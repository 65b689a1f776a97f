"""Ended batches: deleting one with what the database holds of its content (SPEC §4.8)."""

from __future__ import annotations

from sqlalchemy import delete, update

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.rows import TERMINAL
from backfill.domain.files import FileStatus
from backfill.domain.notifications import DeliveryState


class EndedBatchQueries(SqlBase):
    async def delete_batch(self, org_id: str, batch_id: str, now: int) -> list[str] | None:
        b, f = t.batches, t.files
        async with self.writing() as conn:
            # The batch row first, as every writer locks; its status decides in the same
            # statement, so a batch that is still running is never touched.
            row = (
                await conn.execute(
                    delete(b)
                    .where(b.c.id == batch_id, b.c.org_id == org_id, b.c.status.in_(TERMINAL))
                    .returning(b.c.output_file_id, b.c.error_file_id)
                )
            ).first()
            if row is None:
                return None
            # Receipts stay: they are the ledger, and hold no content.
            for table in (t.items, t.chunks):
                await conn.execute(delete(table).where(table.c.batch_id == batch_id))
            # Its delivery log goes too, but a notification still being delivered is sent
            # to its end (it holds ids and counts, no content); the janitor prunes it then.
            n = t.notifications
            await conn.execute(
                delete(n).where(n.c.batch_id == batch_id, n.c.state != DeliveryState.PENDING)
            )
            file_ids = [i for i in (row.output_file_id, row.error_file_id) if i is not None]
            if file_ids:
                # Due now: a caller that dies before removing the blobs leaves them to the
                # janitor, which removes them as it removes any expired file.
                await conn.execute(
                    update(f)
                    .where(f.c.id.in_(file_ids), f.c.status != FileStatus.DELETED)
                    .values(expires_at=now)
                )
        return file_ids
