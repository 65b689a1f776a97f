"""Files: uploads under the org's retained-input limit, listings, expiry and deletion."""

from __future__ import annotations

from sqlalchemy import ColumnElement, func, insert, literal_column, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.rows import (
    TERMINAL,
    UNFINISHED,
    file_of,
    file_values,
    listing_anchor,
    lock_org,
)
from backfill.domain.admission import check_retained
from backfill.domain.files import FilePurpose, FileRecord, FileStatus
from backfill.domain.records import Page


def not_due(now: int) -> ColumnElement[bool]:
    """Files the janitor would keep at ``now``: not past their expiry, or read by an unfinished
    batch (the opposite of expired_files). The rest already read as removed."""
    f, b = t.files, t.batches
    busy = select(b.c.input_file_id).where(b.c.status.in_(UNFINISHED))
    return or_(f.c.expires_at.is_(None), f.c.expires_at > now, f.c.id.in_(busy))


async def retained_input(conn: AsyncConnection, org_id: str, now: int | None = None) -> int:
    """Bytes of the org's input files that are not deleted (with ``now``: nor due for the
    janitor, since those already read as removed)."""
    f = t.files
    query = select(func.coalesce(func.sum(f.c.bytes), 0)).where(
        f.c.org_id == org_id,
        f.c.purpose == FilePurpose.BATCH,
        f.c.status != FileStatus.DELETED,
    )
    if now is not None:
        query = query.where(not_due(now))
    total = (await conn.execute(query)).scalar_one()
    return int(total)


class FileQueries(SqlBase):
    async def create_file(self, record: FileRecord, max_retained_bytes: int | None = None) -> None:
        async with self.writing() as conn:
            if max_retained_bytes is not None:
                # Under the org row's lock two uploads that each fit alone cannot both be
                # stored past the limit.
                await lock_org(conn, self.dialect, record.org_id)
                retained = await retained_input(conn, record.org_id, record.created_at)
                check_retained(retained, record.bytes, max_retained_bytes)
            await conn.execute(insert(t.files).values(**file_values(record)))

    async def retained_input_bytes(self, org_id: str, now: int | None = None) -> int:
        async with self.engine.connect() as conn:
            return await retained_input(conn, org_id, now)

    async def get_file(self, org_id: str, file_id: str) -> FileRecord | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(t.files).where(t.files.c.id == file_id, t.files.c.org_id == org_id)
                )
            ).first()
        return file_of(row) if row else None

    async def list_files(
        self,
        org_id: str,
        purpose: str | None,
        after: str | None,
        limit: int,
        ascending: bool,
        now: int | None = None,
    ) -> Page[FileRecord]:
        f = t.files
        query = select(f).where(f.c.org_id == org_id, f.c.status != FileStatus.DELETED)
        if now is not None:
            # What the janitor removes next is left out already (it reads as removed).
            query = query.where(not_due(now))
        if purpose:
            query = query.where(f.c.purpose == purpose)
        async with self.engine.connect() as conn:
            if after:
                anchor = await listing_anchor(conn, f, org_id, after, "file")
                query = query.where(f.c.seq > anchor if ascending else f.c.seq < anchor)
            order = f.c.seq.asc() if ascending else f.c.seq.desc()
            rows = (await conn.execute(query.order_by(order).limit(limit + 1))).all()
        return Page(items=[file_of(r) for r in rows[:limit]], has_more=len(rows) > limit)

    async def mark_file_deleted(self, file_id: str) -> None:
        async with self.writing() as conn:
            await conn.execute(
                update(t.files).where(t.files.c.id == file_id).values(status=FileStatus.DELETED)
            )

    async def expired_files(self, now: int, limit: int) -> list[FileRecord]:
        f, b = t.files, t.batches
        # Unfinished batches only, read through ix_batches_status_expires: finished ones
        # pile up and must not be scanned every sweep.
        busy = select(b.c.input_file_id).where(b.c.status.in_(UNFINISHED))
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(f)
                    .where(
                        # A literal, not a bound parameter: a generic plan of the prepared
                        # statement must see the partial index's own predicate to use it.
                        f.c.status != literal_column(f"'{FileStatus.DELETED.value}'"),
                        f.c.expires_at <= now,
                        f.c.id.not_in(busy),
                    )
                    .order_by(f.c.expires_at)
                    .limit(limit)
                )
            ).all()
        return [file_of(r) for r in rows]

    async def purge_results(self, batch_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t.items).where(t.items.c.batch_id == batch_id).values(result=None)
            )

    async def unfinished_batch_for_file(self, file_id: str) -> str | None:
        async with self.engine.connect() as conn:
            return (
                await conn.execute(
                    select(t.batches.c.id)
                    .where(t.batches.c.input_file_id == file_id)
                    .where(t.batches.c.status.not_in(TERMINAL))
                    .limit(1)
                )
            ).scalar()
