"""Batches: creation under admission, queueing their lines, status changes, listings."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.bulk import BulkInsert
from backfill.adapters.db.claims import ChunkState, drop_chunks, open_lane
from backfill.adapters.db.dialect import Dialect
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.engine_health import report_from_row
from backfill.adapters.db.files import retained_input
from backfill.adapters.db.outbox import enqueue_terminal
from backfill.adapters.db.rows import (
    TERMINAL,
    batch_of,
    batch_values,
    listing_anchor,
    lock_org,
)
from backfill.adapters.db.spend_caps import caps_in_force, open_spend
from backfill.domain.admission import (
    AdmissionSnapshot,
    check,
    check_worst_case,
    output_tokens_left,
)
from backfill.domain.chunks import ChunkRef
from backfill.domain.engine_health import start_delays
from backfill.domain.lifecycle import TIMESTAMP_OF, BatchStatus, ItemState
from backfill.domain.priority import claim_rank
from backfill.domain.records import Admission, BatchRecord, Page
from backfill.errors import Conflict

# Lines per insert transaction: whole chunks are added together.
_INSERT_LINES = 5000
_ITEMS_WELCOME = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS})
# A status poll's read, built once: every poll of every client runs it.
_BATCH_BY_ID = select(t.batches).where(t.batches.c.id == bindparam("batch"))
_ORGS_BATCH = _BATCH_BY_ID.where(t.batches.c.org_id == bindparam("org"))


@functools.cache
def _insert_items(dialect: Dialect) -> BulkInsert:
    """A batch's queued lines: a million of them at creation, so straight to the driver."""
    return BulkInsert(
        dialect.insert_ignoring(t.items),
        ["batch_id", "idx", "offset", "length", "custom_id", "state", "chunk"],
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


# A lifecycle pass's reads, built once: every idle worker makes them every few seconds.
_WAITING_ON_DECISION = select(t.batches).where(
    t.batches.c.status.in_([BatchStatus.VALIDATING, BatchStatus.CANCELLING, BatchStatus.FINALIZING])
)
_PAST_DEADLINE = select(t.batches).where(
    t.batches.c.status == BatchStatus.IN_PROGRESS, t.batches.c.expires_at <= bindparam("now")
)


def _lifecycle_rows(conn: Connection, now: float) -> list[Any]:
    """``BatchQueries.lifecycle_batches``'s reads, in one trip on SQLite."""
    return [
        *conn.execute(_WAITING_ON_DECISION).all(),
        *conn.execute(_PAST_DEADLINE, {"now": now}).all(),
    ]


# The batches whose lines are still to run: a cancelling batch runs nothing more.
_AHEAD = [BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value]


async def _backlog(conn: AsyncConnection, model: str) -> tuple[float | None, int]:
    """The model's measured throughput and, when it has one, the lines of its accepted batches
    not finished yet (read through the status index: running batches, not history)."""
    rps = (
        await conn.execute(select(t.model_rates.c.rps).where(t.model_rates.c.model == model))
    ).scalar()
    if not rps:
        return None, 0
    b = t.batches
    lines = (
        await conn.execute(
            select(func.coalesce(func.sum(b.c.total - b.c.completed - b.c.failed), 0)).where(
                b.c.status.in_(_AHEAD), b.c.model == model
            )
        )
    ).scalar_one()
    return float(rps), int(lines)


async def _start_delay(conn: AsyncConnection, model: str, now: float) -> float:
    """How long until an engine for ``model`` answers, when all of them run on demand and are
    stopped or starting (0: one is up, or none is known). The live reports are few: one row
    per worker and engine."""
    h = t.engine_health
    rows = (await conn.execute(select(h).where(h.c.until >= now))).all()
    return start_delays([report_from_row(row) for row in rows], now).get(model, 0.0)


class BatchQueries(SqlBase):
    async def create_batch(self, batch: BatchRecord, admission: Admission) -> None:
        values = batch_values(batch)
        values["reserved"] = admission.reserve
        check_worst_case(admission.reserve)
        async with self.writing() as conn:
            # The org row's lock orders concurrent creations of one org: each sees the ones
            # before it, so none overspends, and a replay of an idempotency key finds the
            # original instead of being refused for its credit.
            await lock_org(conn, self.dialect, batch.org_id)
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
            # Decided on what this transaction read under the lock, and written in it.
            check(await self._admission_snapshot(conn, batch, admission), batch, admission)
            o = t.orgs
            await conn.execute(
                update(o)
                .where(o.c.id == batch.org_id)
                .values(reserved=o.c.reserved + admission.reserve)
            )
            try:
                await conn.execute(insert(t.batches).values(**values))
            except IntegrityError as exc:
                raise Conflict(
                    "A batch with this Idempotency-Key was created concurrently; retry the "
                    "request to get it.",
                    code="idempotency_key_conflict",
                ) from exc
            # Counted under the spend caps of its org and key from now on, in this window.
            await open_spend(conn, batch.id, batch.org_id, admission.api_key_id, batch.created_at)
            if admission.input_expires_at is not None:
                f = t.files
                await conn.execute(
                    update(f)
                    .where(f.c.id == batch.input_file_id)
                    .values(expires_at=admission.input_expires_at)
                )

    async def _admission_snapshot(
        self, conn: AsyncConnection, batch: BatchRecord, admission: Admission
    ) -> AdmissionSnapshot:
        o, b = t.orgs, t.batches
        org = (
            await conn.execute(select(o.c.balance, o.c.reserved).where(o.c.id == batch.org_id))
        ).one()
        unfinished = (
            await conn.execute(
                select(func.count())
                .select_from(b)
                .where(b.c.org_id == batch.org_id, b.c.status.not_in(TERMINAL))
            )
        ).scalar_one()
        queued = 0
        if admission.throughput_tokens_per_s:
            rows = (
                await conn.execute(
                    select(b.c.output_token_bound, b.c.total, b.c.completed, b.c.failed).where(
                        b.c.model == batch.model, b.c.status.not_in(TERMINAL)
                    )
                )
            ).all()
            queued = sum(
                output_tokens_left(r.output_token_bound, r.total, r.completed + r.failed)
                for r in rows
            )
        rps, lines, delay = None, 0, 0.0
        if admission.deadline_aware:
            rps, lines = await _backlog(conn, batch.model)
            if rps is not None:
                delay = await _start_delay(conn, batch.model, float(batch.created_at))
        return AdmissionSnapshot(
            balance=int(org.balance),
            reserved=int(org.reserved),
            unfinished=int(unfinished),
            retained_input_bytes=await retained_input(conn, batch.org_id, batch.created_at),
            queued_output_tokens=queued,
            measured_rps=rps,
            unfinished_lines=lines,
            start_delay_s=delay,
            caps=await caps_in_force(
                conn, batch.org_id, admission.api_key_id, float(batch.created_at)
            ),
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
                query = select(
                    b.c.status,
                    b.c.model,
                    b.c.org_id,
                    b.c.expires_at,
                    b.c.priority,
                    b.c.urgent,
                    b.c.paused_at,
                ).where(b.c.id == batch_id)
                batch = (await conn.execute(self.dialect.for_update(query))).first()
                if batch is None or batch.status not in _ITEMS_WELCOME:
                    return False
                queued = ItemState.QUEUED
                await _insert_items(self.dialect).run(
                    conn,
                    [
                        (
                            batch_id,
                            line.idx,
                            line.offset,
                            line.length,
                            line.custom_id,
                            queued,
                            chunk.chunk,
                        )
                        for chunk in rows
                        for line in chunk.lines
                    ],
                )
                rank = claim_rank(batch.priority, batch.urgent)
                state = ChunkState.READY if batch.paused_at is None else ChunkState.PAUSED
                await conn.execute(
                    self.dialect.insert_ignoring(t.chunks),
                    [
                        {
                            "batch_id": batch_id,
                            "chunk": chunk.chunk,
                            "first_idx": chunk.chunk,
                            "end_idx": chunk.end_idx,
                            "model": batch.model,
                            "org_id": batch.org_id,
                            "expires_at": batch.expires_at,
                            "rank": rank,
                            # A paused batch's chunks wait for its resume (batch_controls.py).
                            "state": state,
                        }
                        for chunk in rows
                    ],
                )
        return True

    async def get_batch(self, org_id: str | None, batch_id: str) -> BatchRecord | None:
        async with self.reads.connect() as conn:
            if org_id is None:
                found = await conn.execute(_BATCH_BY_ID, {"batch": batch_id})
            else:
                found = await conn.execute(_ORGS_BATCH, {"batch": batch_id, "org": org_id})
            row = found.first()
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
                anchor = await listing_anchor(conn, b, org_id, after, "batch")
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
                    await open_lane(conn, moved, self.dialect)
                elif to != BatchStatus.VALIDATING:
                    await conn.run_sync(drop_chunks, batch_id)
                if to in TERMINAL:
                    await enqueue_terminal(conn, batch_id, now)
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
        rows = await self.in_one_trip("reading batches to act on", _lifecycle_rows, now)
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
