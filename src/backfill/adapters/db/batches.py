"""Files and batches, with admission (credit, limits, capacity) at creation."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, insert, literal_column, select, true, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
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
from backfill.domain.lifecycle import TIMESTAMP_OF, BatchStatus, ItemState
from backfill.domain.money import MAX_BALANCE, MAX_BALANCE_USD, pico_to_usd
from backfill.errors import (
    Conflict,
    InvalidInput,
    PaymentRequired,
    RateLimited,
    retained_input_limit,
)
from backfill.ports import (
    Admission,
    BatchRecord,
    FileRecord,
    LineRef,
    Page,
)

_INSERT_CHUNK = 5000
_ITEMS_WELCOME = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS})


def _unknown_anchor(kind: str, after: str) -> InvalidInput:
    # The same answer for an id of another org as for one that never existed.
    return InvalidInput(
        f"'after' must be the id of a {kind} of this organization from an earlier page; "
        f"{after[: ids.MAX_ID_CHARS]!r} is not one.",
        code="invalid_value",
        param="after",
    )


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
    ) -> Page:
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

    async def add_items(self, batch_id: str, lines: Sequence[LineRef]) -> bool:
        for start in range(0, len(lines), _INSERT_CHUNK):
            chunk = lines[start : start + _INSERT_CHUNK]
            # Ignoring rows already there lets an interrupted creation be resumed.
            stmt = (
                insert(t.items).prefix_with("OR IGNORE")
                if self.is_sqlite
                else pg_insert(t.items).on_conflict_do_nothing()
            )
            async with self.writing() as conn:
                # Items are added only while the batch may still run, checked under the batch
                # row's lock (PostgreSQL; SQLite has one writer): a cancel, expiry or failure
                # either waits for this chunk, which it then closes or removes, or comes first
                # and no item is added past it. A batch is in progress only once all its items
                # are in, so a late resume adds nothing there.
                status = select(t.batches.c.status).where(t.batches.c.id == batch_id)
                if not self.is_sqlite:
                    status = status.with_for_update()
                if (await conn.execute(status)).scalar() not in _ITEMS_WELCOME:
                    return False
                await conn.execute(
                    stmt,
                    [
                        {
                            "batch_id": batch_id,
                            "idx": line.idx,
                            "offset": line.offset,
                            "length": line.length,
                            "custom_id": line.custom_id,
                            "state": ItemState.QUEUED,
                        }
                        for line in chunk
                    ],
                )
        return True

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

    async def list_batches(self, org_id: str, after: str | None, limit: int) -> Page:
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
        async with self.writing() as conn:
            result = await conn.execute(
                update(t.batches)
                .where(t.batches.c.id == batch_id, t.batches.c.status.in_(list(from_statuses)))
                .values(**values)
            )
        return bool(result.rowcount)

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
