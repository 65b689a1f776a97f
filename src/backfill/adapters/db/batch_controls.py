"""A running batch's controls: its priority, pause and resume, and the planner's rescue of a
batch about to miss its window (docs/scheduling.md, "Priority and pause").

Each acts on the batch row and its chunks together. A chunk's ``rank`` (domain/priority.py)
orders a lane's chunks for the claim; a paused batch's chunks that hold queued lines are
``PAUSED``, which no claim reads and no lane counts as ready.

Lock order as everywhere (adapters/db/claims.py): the batch, then its chunks in key order,
then its lane.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import ColumnElement, bindparam, case, exists, func, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.claims import open_lane
from backfill.adapters.db.dialect import Dialect
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.rows import batch_of
from backfill.domain.lifecycle import BatchStatus, ItemState
from backfill.domain.priority import DEFAULT_MAX_PRIORITY, URGENT_RANK, claim_rank
from backfill.domain.records import BatchRecord
from backfill.domain.scheduling.claim_model import ChunkState
from backfill.domain.waiting import AheadInLane

# A batch that may be paused, resumed or given a priority: one that can still claim lines.
CONTROLLABLE = (BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value)


def _rank(b: Any) -> ColumnElement[int]:
    """``claim_rank`` of a batch row, in SQL."""
    return case((b.c.urgent, URGENT_RANK), else_=-b.c.priority)


def _goes_before(o: Any, b: Any) -> ColumnElement[bool]:
    """Batch row ``o``'s chunks come before ``b``'s in their lane (claim_model.CHUNK_ORDER:
    rank, then deadline, then id)."""
    return tuple_(_rank(o), o.c.expires_at, o.c.id) < tuple_(_rank(b), b.c.expires_at, b.c.id)


_b, _o, _i, _c = t.batches, t.batches.alias("o"), t.items, t.chunks
# The running batches of each asked-for batch's lane (same org and model) that claims serve
# first (a higher priority, a rescue, or the same rank and an earlier deadline) and that have
# queued lines ready, for asked-for batches with no line leased.
_AHEAD = (
    select(
        _b.c.id,
        func.count(_o.c.id).label("n"),
        func.max(_o.c.priority).label("top"),
        func.max(_o.c.in_progress_at).label("since"),
        func.max(_o.c.estimated_completion_at).label("done_by"),
        func.sum(case((_o.c.estimated_completion_at.is_(None), 1), else_=0)).label("unknown"),
    )
    .join_from(
        _b,
        _o,
        (_o.c.org_id == _b.c.org_id)
        & (_o.c.model == _b.c.model)
        & (_o.c.id != _b.c.id)
        & (_o.c.status == BatchStatus.IN_PROGRESS.value)
        & _o.c.paused_at.is_(None)
        & _goes_before(_o, _b),
    )
    .where(
        _b.c.id.in_(bindparam("ids", expanding=True)),
        ~exists().where(_i.c.batch_id == _b.c.id, _i.c.state == ItemState.LEASED),
        exists().where(_c.c.batch_id == _o.c.id, _c.c.state == ChunkState.READY),
    )
    .group_by(_b.c.id)
)


class BatchControlQueries(SqlBase):
    async def max_priority(self, org_id: str) -> int:
        async with self.reads.connect() as conn:
            cap = (
                await conn.execute(select(t.orgs.c.max_priority).where(t.orgs.c.id == org_id))
            ).scalar()
        return DEFAULT_MAX_PRIORITY if cap is None else int(cap)

    async def batches_ahead(self, batch_ids: Sequence[str]) -> dict[str, AheadInLane]:
        if not batch_ids:
            return {}
        async with self.reads.connect() as conn:
            rows = (await conn.execute(_AHEAD, {"ids": list(batch_ids)})).all()
        return {
            row.id: AheadInLane(
                batches=int(row.n),
                top_priority=int(row.top),
                since=int(row.since or 0),
                # Unknown for one of them: unknown for all.
                done_by=int(row.done_by) if row.unknown == 0 and row.done_by else None,
            )
            for row in rows
        }

    async def set_max_priority(self, org_id: str, cap: int) -> bool:
        """The org's cap; batches already above it keep their priority (it is checked when a
        priority is set)."""
        async with self.writing() as conn:
            found = await conn.execute(
                update(t.orgs).where(t.orgs.c.id == org_id).values(max_priority=cap)
            )
        return bool(found.rowcount)

    async def set_priority(self, batch_id: str, priority: int) -> BatchRecord | None:
        """Give a batch that can still claim lines ``priority``; its chunks move in their
        lane's order at once. None when it cannot (it ended, or is ending)."""
        async with self.writing() as conn:
            batch = await _lock_controllable(conn, self.dialect, batch_id)
            if batch is None:
                return None
            b, c = t.batches, t.chunks
            await conn.execute(update(b).where(b.c.id == batch_id).values(priority=priority))
            await conn.execute(
                update(c)
                .where(c.c.batch_id == batch_id)
                .values(rank=claim_rank(priority, bool(batch.urgent)))
            )
            return await _read(conn, batch_id)

    async def pause(self, batch_id: str, now: int) -> BatchRecord | None:
        """Claims take no new line of the batch; lines in flight finish. Pausing a paused
        batch changes nothing. None when it cannot be paused (it ended, or is ending)."""
        async with self.writing() as conn:
            batch = await _lock_controllable(conn, self.dialect, batch_id)
            if batch is None:
                return None
            if batch.paused_at is None:
                b = t.batches
                await conn.execute(update(b).where(b.c.id == batch_id).values(paused_at=now))
                await _hold_chunks(conn, self.dialect, batch_id, batch.status)
            return await _read(conn, batch_id)

    async def resume(self, batch_id: str) -> BatchRecord | None:
        """The batch's queued lines are claimable again; its lane starts level with the
        busiest (``open_lane``): a pause does not bank turns. None when it cannot."""
        async with self.writing() as conn:
            batch = await _lock_controllable(conn, self.dialect, batch_id)
            if batch is None:
                return None
            if batch.paused_at is not None:
                b, c = t.batches, t.chunks
                await conn.execute(update(b).where(b.c.id == batch_id).values(paused_at=None))
                await conn.execute(
                    update(c)
                    .where(c.c.batch_id == batch_id, c.c.state == ChunkState.PAUSED)
                    .values(state=ChunkState.READY)
                )
                # While validating, the batch's lane counts its chunks when it starts.
                if batch.status == BatchStatus.IN_PROGRESS.value:
                    await open_lane(conn, batch, self.dialect)
            return await _read(conn, batch_id)


async def rescue(conn: AsyncConnection, urgent: Collection[str], calm: Collection[str]) -> None:
    """The planner's rescue, in its plan's transaction: the ``urgent`` batches' chunks go
    before every priority of their lane, the ``calm`` ones' back to their priority's rank.
    Batch rows first, then chunks, each in key order (the lock order of claims.py)."""
    b, c = t.batches, t.chunks
    priorities: dict[str, int] = {}
    for batch_id in sorted({*urgent, *calm}):
        found = (
            await conn.execute(
                update(b)
                .where(b.c.id == batch_id)
                .values(urgent=batch_id in urgent)
                .returning(b.c.priority)
            )
        ).scalar()
        if found is not None:
            priorities[batch_id] = int(found)
    for batch_id, priority in sorted(priorities.items()):
        rank = claim_rank(priority, batch_id in urgent)
        await conn.execute(update(c).where(c.c.batch_id == batch_id).values(rank=rank))


async def _lock_controllable(conn: AsyncConnection, dialect: Dialect, batch_id: str) -> Any:
    """The batch's row, locked, if it can still claim lines."""
    b = t.batches
    query = select(
        b.c.id, b.c.model, b.c.org_id, b.c.billing, b.c.status, b.c.paused_at, b.c.urgent
    ).where(b.c.id == batch_id)
    row = (await conn.execute(dialect.for_update(query))).first()
    return row if row is not None and row.status in CONTROLLABLE else None


async def _read(conn: AsyncConnection, batch_id: str) -> BatchRecord:
    row = (await conn.execute(select(t.batches).where(t.batches.c.id == batch_id))).one()
    return batch_of(row)


async def _hold_chunks(conn: AsyncConnection, dialect: Dialect, batch_id: str, status: str) -> None:
    """A batch pauses: its ready chunks are held, and its lane stops counting them. Every
    chunk of the batch is locked first (key order), so a line put back concurrently either
    finds the batch paused or is held here (``claims._reopen``)."""
    c = t.chunks
    await dialect.lock(conn, select(c.c.chunk).where(c.c.batch_id == batch_id).order_by(c.c.chunk))
    held = (
        await conn.execute(
            update(c)
            .where(c.c.batch_id == batch_id, c.c.state == ChunkState.READY)
            .values(state=ChunkState.PAUSED)
            .returning(c.c.model, c.c.org_id)
        )
    ).all()
    # A validating batch's lane has not counted its chunks yet (``open_lane`` does, later).
    if held and status == BatchStatus.IN_PROGRESS.value:
        model, org_id = held[0]
        await conn.execute(
            update(t.lanes)
            .where(t.lanes.c.model == model, t.lanes.c.org_id == org_id)
            .values(ready=t.lanes.c.ready - len(held))
        )
