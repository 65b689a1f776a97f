"""Files and batches, with admission (credit, limits, capacity) at creation."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Insert, Table, func, insert, literal_column, select, true, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.claims import ChunkState, drop_chunks, open_lane
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.rows import (
    BATCH_FIELDS,
    TERMINAL,
    UNFINISHED,
    batch_of,
    file_of,
    file_values,
)
from backfill.domain import ids
from backfill.domain.chunks import ChunkRef
from backfill.domain.lifecycle import TIMESTAMP_OF, BatchStatus, ItemState
from backfill.domain.money import MAX_BALANCE, MAX_BALANCE_USD, pico_to_usd
from backfill.domain.records import Admission, BatchRecord, FileRecord, Page
from backfill.errors import (
    Conflict,
    InvalidInput,
    PaymentRequired,
    RateLimited,
    retained_input_limit,
)

# Lines per insert transaction: whole chunks are added together.
_INSERT_LINES = 5000
_ITEMS_WELCOME = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS})


def _unknown_anchor(kind: str, after: str) -> InvalidInput:
    # The same answer for an id of another org as for one that never existed.
    return InvalidInput(
        f"'after' must be the id of a {kind} of this organization from an earlier page; "
        f"{after[: ids.MAX_ID_CHARS]!r} is not one.",
        code="invalid_value",
        param="after",
    )


def _pages(chunks: Sequence[ChunkRef]) -> list[list[ChunkRef]]:
    """Whole chunks, about ``_INSERT_LINES`` lines per page."""
    pages: list[list[ChunkRef]] = [[]]
    lines = 0
    for chunk in chunks:
        if lines >= _INSERT_LINES:
            pages.append([])
            lines = 0
        pages[-1].append(chunk)
        lines += len(chunk.lines)
    return [page for page in pages if page]


class BatchQueries(SqlBase):
    # ---- files ------------------------------------------------------------------------

    async def create_file(self, record: FileRecord, max_retained_bytes: int | None = None) -> None:
        async with self.writing() as conn:
            if max_retained_bytes is not None:
                # Under the org row's lock (PostgreSQL; SQLite has one writer) two uploads
                # that each fit alone cannot both be stored past the limit.
                await self._lock_org(conn, record.org_id)
                retained = await self._retained(conn, record.org_id)
                if retained + record.bytes > max_retained_bytes:
                    raise retained_input_limit(retained, record.bytes, max_retained_bytes)
            await conn.execute(insert(t.files).values(**file_values(record)))

    async def retained_input_bytes(self, org_id: str) -> int:
        async with self.engine.connect() as conn:
            return await self._retained(conn, org_id)

    async def _retained(self, conn: AsyncConnection, org_id: str) -> int:
        f = t.files
        total = (
            await conn.execute(
                select(func.coalesce(func.sum(f.c.bytes), 0)).where(
                    f.c.org_id == org_id, f.c.purpose == "batch", f.c.status != "deleted"
                )
            )
        ).scalar_one()
        return int(total)

    async def _lock_org(self, conn: AsyncConnection, org_id: str) -> None:
        if not self.is_sqlite:
            o = t.orgs
            await conn.execute(select(o.c.id).where(o.c.id == org_id).with_for_update())

    async def get_file(self, org_id: str, file_id: str) -> FileRecord | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(t.files).where(t.files.c.id == file_id, t.files.c.org_id == org_id)
                )
            ).first()
        return file_of(row) if row else None

    async def list_files(
        self, org_id: str, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> Page[FileRecord]:
        query = select(t.files).where(t.files.c.org_id == org_id, t.files.c.status != "deleted")
        if purpose:
            query = query.where(t.files.c.purpose == purpose)
        async with self.engine.connect() as conn:
            if after:
                f = t.files
                anchor = (
                    (
                        await conn.execute(
                            select(f.c.seq).where(f.c.id == after, f.c.org_id == org_id)
                        )
                    ).scalar()
                    if ids.plausible(after)
                    else None
                )
                if anchor is None:
                    raise _unknown_anchor("file", after)
                query = query.where(f.c.seq > anchor if ascending else f.c.seq < anchor)
            order = t.files.c.seq.asc() if ascending else t.files.c.seq.desc()
            rows = (await conn.execute(query.order_by(order).limit(limit + 1))).all()
        return Page(items=[file_of(r) for r in rows[:limit]], has_more=len(rows) > limit)

    async def mark_file_deleted(self, file_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(t.files).where(t.files.c.id == file_id).values(status="deleted")
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
                        f.c.status != literal_column("'deleted'"),
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

    # ---- batches ----------------------------------------------------------------------

    async def create_batch(self, batch: BatchRecord, admission: Admission) -> None:
        values = {k: getattr(batch, k) for k in BATCH_FIELDS}
        values["seq"] = time.time_ns()
        values["reserved"] = admission.reserve
        o = t.orgs
        if admission.reserve > MAX_BALANCE:
            # No balance can cover it, and the number would not fit the reserved column.
            raise PaymentRequired(
                f"This batch needs {pico_to_usd(admission.reserve)} USD of credit for its worst "
                f"case, more than any balance may hold ({MAX_BALANCE_USD} USD); split the file "
                "or lower max_tokens."
            )
        async with self.writing() as conn:
            # The org row's lock (PostgreSQL; SQLite has one writer) orders concurrent creations
            # of one org: each sees the ones before it, so none overspends, and a replay of an
            # idempotency key finds the original instead of being refused for its credit.
            await self._lock_org(conn, batch.org_id)
            if batch.idempotency_key is not None:
                b = t.batches
                taken = await conn.execute(
                    select(b.c.id).where(
                        b.c.org_id == batch.org_id, b.c.idempotency_key == batch.idempotency_key
                    )
                )
                if taken.first() is not None:
                    raise Conflict(
                        "A batch with this Idempotency-Key already exists.",
                        code="idempotency_key_conflict",
                    )
            reserved = await conn.execute(
                update(o)
                .where(o.c.id == batch.org_id, o.c.balance - o.c.reserved >= admission.reserve)
                .where(o.c.balance > 0 if admission.require_positive_balance else true())
                .values(reserved=o.c.reserved + admission.reserve)
            )
            if not reserved.rowcount:
                await self._refuse_credit(conn, batch.org_id, admission)
            await self._check_limits(conn, batch, admission)
            try:
                await conn.execute(insert(t.batches).values(**values))
            except IntegrityError:
                raise Conflict(
                    "A batch with this Idempotency-Key was created concurrently; retry the "
                    "request to get it.",
                    code="idempotency_key_conflict",
                ) from None
            if admission.input_expires_at is not None:
                f = t.files
                await conn.execute(
                    update(f)
                    .where(f.c.id == batch.input_file_id)
                    .values(expires_at=admission.input_expires_at)
                )

    async def _refuse_credit(
        self, conn: AsyncConnection, org_id: str, admission: Admission
    ) -> None:
        row = (
            await conn.execute(
                select(t.orgs.c.balance, t.orgs.c.reserved).where(t.orgs.c.id == org_id)
            )
        ).one()
        available = row.balance - row.reserved
        if admission.require_positive_balance:
            raise PaymentRequired(
                f"Batches on a private deployment need a positive balance (it is "
                f"{pico_to_usd(row.balance)} USD); add credit and retry."
            )
        raise PaymentRequired(
            f"This batch needs {pico_to_usd(admission.reserve)} USD of credit for its worst case "
            f"but {pico_to_usd(available)} USD is available; add credit or submit fewer requests. "
            "Nothing was queued and the input file can be used again."
        )

    async def _check_limits(
        self, conn: AsyncConnection, batch: BatchRecord, admission: Admission
    ) -> None:
        b = t.batches
        unfinished = (
            await conn.execute(
                select(func.count())
                .select_from(b)
                .where(b.c.org_id == batch.org_id, b.c.status.not_in(TERMINAL))
            )
        ).scalar_one()
        if unfinished >= admission.max_unfinished:
            raise RateLimited(
                f"This organization already has {unfinished} unfinished batches (the limit is "
                f"{admission.max_unfinished}); wait for one to finish or cancel one, then retry.",
                code="too_many_unfinished_batches",
                retry_after_s=60,
            )
        retained = await self._retained(conn, batch.org_id)
        if retained > admission.max_retained_input_bytes:
            raise retained_input_limit(retained, 0, admission.max_retained_input_bytes)
        if admission.throughput_tokens_per_s:
            await self._check_capacity(conn, batch, admission.throughput_tokens_per_s)

    async def _check_capacity(self, conn: AsyncConnection, batch: BatchRecord, rate: int) -> None:
        b = t.batches
        rows = (
            await conn.execute(
                select(b.c.output_token_bound, b.c.total, b.c.completed, b.c.failed).where(
                    b.c.model == batch.model, b.c.status.not_in(TERMINAL)
                )
            )
        ).all()
        queued = sum(
            r.output_token_bound * (r.total - r.completed - r.failed) // max(r.total, 1)
            for r in rows
        )
        window = batch.expires_at - batch.created_at
        if queued + batch.output_token_bound > rate * window:
            # The queue holds other orgs' work: say only when to retry, rounded up to whole
            # minutes so the wait does not measure their volume to the token.
            wait = -(-(queued + batch.output_token_bound - rate * window) // rate)
            wait = -(-wait // 60) * 60
            raise RateLimited(
                f"{batch.model} cannot take this batch's {batch.output_token_bound} output tokens "
                f"inside its {batch.completion_window} window now. Retry in about {wait}s, use a "
                "longer window, or split the file.",
                code="capacity_exceeded",
                retry_after_s=int(wait),
            )

    async def add_items(self, batch_id: str, chunks: Sequence[ChunkRef]) -> bool:
        """Queue whole chunks of lines; rows already there are kept, so an interrupted
        creation can be resumed from its first line."""
        b = t.batches
        for rows in _pages(chunks):
            async with self.writing() as conn:
                # Items are added only while the batch may still run, checked under the batch
                # row's lock (PostgreSQL; SQLite has one writer): a cancel, expiry or failure
                # either waits for this page, which it then closes or removes, or comes first
                # and no item is added past it. A batch is in progress only once all its items
                # are in, so a late resume adds nothing there.
                query = select(b.c.status, b.c.model, b.c.org_id, b.c.expires_at).where(
                    b.c.id == batch_id
                )
                if not self.is_sqlite:
                    query = query.with_for_update()
                batch = (await conn.execute(query)).first()
                if batch is None or batch.status not in _ITEMS_WELCOME:
                    return False
                await conn.execute(
                    self._insert_new(t.items),
                    [
                        {
                            "batch_id": batch_id,
                            "idx": line.idx,
                            "offset": line.offset,
                            "length": line.length,
                            "custom_id": line.custom_id,
                            "state": ItemState.QUEUED,
                            "chunk": chunk.chunk,
                        }
                        for chunk in rows
                        for line in chunk.lines
                    ],
                )
                await conn.execute(
                    self._insert_new(t.chunks),
                    [
                        {
                            "batch_id": batch_id,
                            "chunk": chunk.chunk,
                            "first_idx": chunk.chunk,
                            "end_idx": chunk.end_idx,
                            "model": batch.model,
                            "org_id": batch.org_id,
                            "expires_at": batch.expires_at,
                            "state": ChunkState.READY,
                        }
                        for chunk in rows
                    ],
                )
        return True

    def _insert_new(self, table: Table) -> Insert:
        """An insert that leaves rows already there alone."""
        if self.is_sqlite:
            return insert(table).prefix_with("OR IGNORE")
        return pg_insert(table).on_conflict_do_nothing()

    async def get_batch(self, org_id: str | None, batch_id: str) -> BatchRecord | None:
        query = select(t.batches).where(t.batches.c.id == batch_id)
        if org_id is not None:
            query = query.where(t.batches.c.org_id == org_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return batch_of(row) if row else None

    async def batch_by_idempotency_key(self, org_id: str, key: str) -> BatchRecord | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(t.batches).where(
                        t.batches.c.org_id == org_id, t.batches.c.idempotency_key == key
                    )
                )
            ).first()
        return batch_of(row) if row else None

    async def list_batches(self, org_id: str, after: str | None, limit: int) -> Page[BatchRecord]:
        query = select(t.batches).where(t.batches.c.org_id == org_id)
        async with self.engine.connect() as conn:
            if after:
                b = t.batches
                anchor = (
                    (
                        await conn.execute(
                            select(b.c.seq).where(b.c.id == after, b.c.org_id == org_id)
                        )
                    ).scalar()
                    if ids.plausible(after)
                    else None
                )
                if anchor is None:
                    raise _unknown_anchor("batch", after)
                query = query.where(b.c.seq < anchor)
            rows = (
                await conn.execute(query.order_by(t.batches.c.seq.desc()).limit(limit + 1))
            ).all()
        return Page(items=[batch_of(r) for r in rows[:limit]], has_more=len(rows) > limit)

    async def transition(
        self, batch_id: str, from_statuses: Sequence[str], to: str, now: int
    ) -> bool:
        values: dict[str, Any] = {"status": to}
        column = TIMESTAMP_OF.get(BatchStatus(to))
        if column:
            values[column] = now
        b = t.batches
        async with self.writing() as conn:
            moved = (
                await conn.execute(
                    update(b)
                    .where(b.c.id == batch_id, b.c.status.in_(list(from_statuses)))
                    .values(**values)
                    .returning(b.c.id, b.c.model, b.c.org_id, b.c.billing)
                )
            ).first()
            if moved is not None:
                # Its chunks become claimable with the status, or stop being so.
                if to == BatchStatus.IN_PROGRESS:
                    await open_lane(conn, moved, self.is_sqlite)
                elif to != BatchStatus.VALIDATING:
                    await drop_chunks(conn, batch_id)
        return moved is not None

    async def batches_in(self, statuses: Sequence[str]) -> list[BatchRecord]:
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(t.batches)
                    .where(t.batches.c.status.in_(list(statuses)))
                    .order_by(t.batches.c.expires_at)
                )
            ).all()
        return [batch_of(r) for r in rows]

    async def lifecycle_batches(self, now: float) -> list[BatchRecord]:
        """The batches a lifecycle pass acts on: validating, cancelling or finalizing ones, and
        in-progress ones past their deadline. Running batches are not read: a claim finds
        their work, and the result that finishes one moves it to ``finalizing``."""
        b = t.batches
        waiting = [BatchStatus.VALIDATING, BatchStatus.CANCELLING, BatchStatus.FINALIZING]
        async with self.engine.connect() as conn:
            rows = [
                *(await conn.execute(select(b).where(b.c.status.in_(waiting)))).all(),
                *(
                    await conn.execute(
                        select(b).where(
                            b.c.status == BatchStatus.IN_PROGRESS, b.c.expires_at <= now
                        )
                    )
                ).all(),
            ]
        return sorted((batch_of(r) for r in rows), key=lambda batch: batch.expires_at)

    async def finish_drained(self, now: int) -> int:
        """Move in-progress batches whose every line is done to ``finalizing`` (a safety net:
        the result write that finishes a batch normally does it)."""
        b = t.batches
        async with self.engine.connect() as conn:
            drained = (
                (
                    await conn.execute(
                        select(b.c.id).where(
                            b.c.status == BatchStatus.IN_PROGRESS,
                            b.c.completed + b.c.failed >= b.c.total,
                        )
                    )
                )
                .scalars()
                .all()
            )
        moved = 0
        for batch_id in drained:
            moved += await self.transition(
                batch_id, [BatchStatus.IN_PROGRESS], BatchStatus.FINALIZING, now
            )
        return moved
