"""Claims: queued lines leased a chunk at a time, by weighted fair share across lanes (urgent
lanes first); lines put back.

Lock order, for every transaction that takes more than one kind of row (PostgreSQL):
batches → items → chunks → lanes → orgs, each kind in key order. A claim is the one exception
and cannot deadlock: it skips locked chunks and items (SKIP LOCKED) and waits only for lanes,
which it takes last, in key order.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Select,
    TextClause,
    Update,
    and_,
    bindparam,
    delete,
    func,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.dialect import POSTGRES, SQLITE, Dialect
from backfill.adapters.db.engine import SqlBase
from backfill.domain.catalog import Billing
from backfill.domain.lifecycle import BatchStatus, ItemState
from backfill.domain.records import Claim, ClaimedItem, WorkBatch
from backfill.domain.scheduling.claim_model import (
    CHUNK_ORDER,
    LANES_LOOKED_AT,
    LANES_PER_CLAIM,
    TURN_ORDER,
    ChunkState,
    lane_turn,
    level_on_reopen,
    turn_key,
)
from backfill.domain.scheduling.fair_share import split_claim, vtime_step

# Re-exported: the store's other queries and the benchmarks name them from here.
__all__ = ["LANES_PER_CLAIM", "ChunkState"]

# Items per renewal statement: well under the bind-parameter limits of SQLite and asyncpg.
_RENEW_CHUNK = 1000
# Expired leases put back per sweep statement.
_SWEEP_LIMIT = 5000
# The end given to leases released all at once: earlier than any lease a clock could set.
_ENDED = -1.0

# The rules the statements below share, each written once (the reference model,
# domain/scheduling/claim_model.py, holds them in Python; tests/contract/test_claim_model.py
# pins one to the other). Values are rendered into the text, not bound: a partial index is
# used only for a query whose own condition says its literal (``state = 0``).
#
# The lanes' turn (claim_model.TURN_ORDER): urgent first by deadline, then least virtual time.
_TURN = ", ".join(f"l.{column}" for column in TURN_ORDER)
# A lane l of org o that may be claimed: it has ready chunks and passes the credit gate
# (claim_model.has_claimable_work).
_CLAIMABLE_LANE = "l.ready > 0 AND (NOT l.metered OR o.balance > 0)"
# A chunk c of lane l a claim may take at :now (claim_model.ChunkView.open_at).
_OPEN_CHUNK = f"""c.model = l.model AND c.org_id = l.org_id AND c.state = {ChunkState.READY:d}
          AND c.expires_at > :now AND (c.not_before IS NULL OR c.not_before <= :now)
          AND EXISTS (SELECT 1 FROM batches b
                      WHERE b.id = c.batch_id AND b.status = '{BatchStatus.IN_PROGRESS.value}')"""
# A lane's chunks: by rank, then earliest deadline first (claim_model.CHUNK_ORDER).
_CHUNK_ORDER = ", ".join(f"c.{column}" for column in CHUNK_ORDER)

# The claim's pick, one statement per dialect. Its parameters: :models (a list), :now, :k
# (LANES_PER_CLAIM) and :lanes (LANES_LOOKED_AT). Of the first :lanes claimable lanes of the
# models in turn order, read through ix_lanes_turn (model, urgent_by, vtime; ready > 0), it
# takes the first open chunk of each in CHUNK_ORDER, read through ix_chunks_ready (model,
# org_id, rank, expires_at, batch_id, chunk; state = 0), and returns those of the first :k
# lanes that have one, with what the claim needs of their batch, lane and org.
#
# SQLite: the chunk of each lane as a correlated subquery over the ordered lanes, rows in no
# particular order (the claim sorts them by turn). One writer: nothing to lock.
PICK_SQLITE = f"""-- name: PickChunksPerLane (SQLite)
SELECT c.batch_id, c.chunk, c.first_idx, c.end_idx, c.model, c.org_id,
       b.endpoint, b.input_file_id, b.billing, b.expires_at AS batch_expires_at,
       b.output_validation,
       l.vtime, l.urgent_by, o.weight
FROM chunks c
JOIN batches b ON b.id = c.batch_id
JOIN lanes l ON l.model = c.model AND l.org_id = c.org_id
JOIN orgs o ON o.id = c.org_id
WHERE c.rowid IN (
    SELECT r FROM (
        SELECT (
            SELECT c.rowid FROM chunks c
            WHERE {_OPEN_CHUNK}
            ORDER BY {_CHUNK_ORDER} LIMIT 1
        ) AS r
        FROM (
            SELECT l.model, l.org_id, l.vtime, l.urgent_by
            FROM lanes l JOIN orgs o ON o.id = l.org_id
            WHERE l.model IN :models AND {_CLAIMABLE_LANE}
            ORDER BY {_TURN} LIMIT :lanes
        ) l
    ) WHERE r IS NOT NULL LIMIT :k
)
"""
# PostgreSQL: a lateral join, locking the chunks it returns; chunks other claimers hold are
# skipped (the lane's next chunk comes instead), never waited for.
PICK_POSTGRES = f"""-- name: PickChunksPerLane (PostgreSQL)
SELECT c.batch_id, c.chunk, c.first_idx, c.end_idx, c.model, c.org_id,
       b.endpoint, b.input_file_id, b.billing, b.expires_at AS batch_expires_at,
       b.output_validation,
       l.vtime, l.urgent_by, o.weight
FROM (
    SELECT l.model, l.org_id, l.vtime, l.urgent_by
    FROM lanes l JOIN orgs o ON o.id = l.org_id
    WHERE l.model IN :models AND {_CLAIMABLE_LANE}
    ORDER BY {_TURN} LIMIT :lanes
) l
CROSS JOIN LATERAL (
    SELECT c.* FROM chunks c
    WHERE {_OPEN_CHUNK}
    ORDER BY {_CHUNK_ORDER} LIMIT 1
    FOR UPDATE OF c SKIP LOCKED
) c
JOIN batches b ON b.id = c.batch_id
JOIN orgs o ON o.id = l.org_id
ORDER BY {_TURN} LIMIT :k
"""
# Which models have a lane a claim could take lines from (the pick's own tests, no locks).
READY_MODELS = f"""-- name: ReadyModels
SELECT DISTINCT l.model
FROM lanes l JOIN orgs o ON o.id = l.org_id
WHERE l.model IN :models AND {_CLAIMABLE_LANE}
  AND EXISTS (SELECT 1 FROM chunks c WHERE {_OPEN_CHUNK})
"""
_PICKS: dict[Dialect, str] = {SQLITE: PICK_SQLITE, POSTGRES: PICK_POSTGRES}


def pick_sql(dialect: Dialect) -> str:
    """The claim's pick in ``dialect`` (``PICK_SQLITE`` or ``PICK_POSTGRES``)."""
    return _PICKS[dialect]


@functools.cache
def _pick_statement(dialect: Dialect) -> TextClause:
    """The statement that picks a chunk per lane, built once per dialect, not per claim."""
    return text(pick_sql(dialect)).bindparams(bindparam("models", expanding=True))


_READY_MODELS = text(READY_MODELS).bindparams(bindparam("models", expanding=True))


@functools.cache
def lease_statement(dialect: Dialect) -> Update:
    """A claim's lease of one chunk's queued lines, built once per dialect: its parameters
    ``batch``, ``first``, ``end``, ``now``, ``limit``, ``token`` and ``until``."""
    i = t.items
    pick = queued_lines(
        bindparam("batch"), bindparam("first"), bindparam("end"), bindparam("now"), None
    ).limit(bindparam("limit"))
    # The chunk's range bounds the update's own scan too: without it PostgreSQL may join the
    # picked lines to every line of the batch (a hash join over a sequential scan, chosen for
    # batches of up to about 100,000 lines), where an index range of one chunk is enough.
    chunk = and_(
        i.c.batch_id == bindparam("batch"),
        i.c.idx >= bindparam("first"),
        i.c.idx < bindparam("end"),
    )
    return (
        dialect.update_picked(i, chunk, i.c.idx, pick)
        .values(
            state=ItemState.LEASED, lease_token=bindparam("token"), lease_until=bindparam("until")
        )
        .returning(i.c.idx, i.c.offset, i.c.length, i.c.custom_id)
    )


def _chunk_key() -> ColumnElement[bool]:
    c = t.chunks
    return (c.c.batch_id == bindparam("batch")) & (c.c.chunk == bindparam("c_chunk"))


# After a claim, of one chunk: the earliest time one of its queued lines may go, then the
# chunk waiting for it or taken. Built once: a claim runs them for every chunk it empties.
_i = t.items
_SOONEST = select(func.min(func.coalesce(_i.c.lease_until, 0.0))).where(
    _i.c.batch_id == bindparam("batch"),
    _i.c.state == ItemState.QUEUED,
    _i.c.idx >= bindparam("first"),
    _i.c.idx < bindparam("end"),
)
_CHUNK_WAITS = update(t.chunks).where(_chunk_key()).values(not_before=bindparam("soonest"))
_CHUNK_TAKEN = update(t.chunks).where(_chunk_key()).values(state=ChunkState.TAKEN, not_before=None)
# Relative to the row's current values: concurrent claims of one lane add up.
_LANE_SERVED = (
    update(t.lanes)
    .where(t.lanes.c.model == bindparam("lane_model"), t.lanes.c.org_id == bindparam("lane_org"))
    .values(
        served=t.lanes.c.served + bindparam("n_served"),
        vtime=t.lanes.c.vtime + bindparam("d_vtime"),
        ready=t.lanes.c.ready - bindparam("n_drained"),
    )
)


def _claim(
    conn: Connection,
    dialect: Dialect,
    models: Sequence[str],
    limit: int,
    token: str,
    lease_until: float,
    now: float,
) -> list[Claim]:
    """A claim's transaction (``ClaimQueries.claim``)."""
    claims: list[Claim] = []
    served: Counter[tuple[str, str]] = Counter()
    drained: Counter[tuple[str, str]] = Counter()
    weights: dict[tuple[str, str], int] = {}
    picked = sorted(
        conn.execute(
            _pick_statement(dialect),
            {"models": list(models), "now": now, "k": LANES_PER_CLAIM, "lanes": LANES_LOOKED_AT},
        ).all(),
        key=turn_key,
    )
    shares = split_claim(
        limit,
        [
            lane_turn(row.vtime, row.weight, row.urgent_by, row.end_idx - row.first_idx)
            for row in picked
        ],
    )
    for row, share in zip(picked, shares, strict=True):
        if not share:
            continue
        items = _lease_lines(conn, dialect, row, share, token, lease_until, now)
        lane = (row.model, row.org_id)
        served[lane] += len(items)
        weights[lane] = row.weight
        # Lines are leased in index order, so a chunk that gave all that was asked and
        # not its last line holds more: it stays ready without a look.
        exhausted = len(items) < share or items[-1].idx == row.end_idx - 1
        if exhausted and _settle_chunk(conn, row, now):
            drained[lane] += 1
        if items:
            batch = WorkBatch(
                id=row.batch_id,
                org_id=row.org_id,
                model=row.model,
                endpoint=row.endpoint,
                input_file_id=row.input_file_id,
                billing=Billing(row.billing),
                expires_at=row.batch_expires_at,
                output_validation=bool(row.output_validation),
            )
            claims.append(Claim(batch, row.chunk, items))
    for lane in sorted(served):
        conn.execute(
            _LANE_SERVED,
            {
                "lane_model": lane[0],
                "lane_org": lane[1],
                "n_served": served[lane],
                "d_vtime": vtime_step(served[lane], weights[lane]),
                "n_drained": drained[lane],
            },
        )
    return claims


def _lease_lines(
    conn: Connection,
    dialect: Dialect,
    chunk: Any,
    limit: int,
    token: str,
    lease_until: float,
    now: float,
) -> list[ClaimedItem]:
    rows = conn.execute(
        lease_statement(dialect),
        {
            "batch": chunk.batch_id,
            "first": chunk.first_idx,
            "end": chunk.end_idx,
            "now": now,
            "limit": limit,
            "token": token,
            "until": lease_until,
        },
    ).all()
    return sorted(
        (
            ClaimedItem(chunk.batch_id, r.idx, r.offset, r.length, r.custom_id, chunk.chunk)
            for r in rows
        ),
        key=lambda c: c.idx,
    )


def _settle_chunk(conn: Connection, chunk: Any, now: float) -> bool:
    """After a claim: the chunk stays ready while it holds claimable lines, waits for the
    earliest backoff when all it holds wait, and is taken once it holds none; True then."""
    where = {"batch": chunk.batch_id, "first": chunk.first_idx, "end": chunk.end_idx}
    soonest = conn.execute(_SOONEST, where).scalar()
    if soonest is not None and soonest <= now:
        return False
    key = {"batch": chunk.batch_id, "c_chunk": chunk.chunk}
    if soonest is not None:
        conn.execute(_CHUNK_WAITS, {**key, "soonest": soonest})
        return False
    conn.execute(_CHUNK_TAKEN, key)
    return True


def _renew(
    conn: Connection, token: str, lease_until: float, held: Mapping[str, Collection[int]]
) -> None:
    """``ClaimQueries.renew_leases``'s transaction: the heartbeat of a worker's leases."""
    i = t.items
    for batch_id, idxs in sorted(held.items()):
        ordered = sorted(idxs)
        for start in range(0, len(ordered), _RENEW_CHUNK):
            conn.execute(
                update(i)
                .where(
                    i.c.batch_id == batch_id,
                    i.c.idx.in_(ordered[start : start + _RENEW_CHUNK]),
                    i.c.lease_token == token,
                    i.c.state == ItemState.LEASED,
                )
                .values(lease_until=lease_until)
            )


def _release(
    conn: Connection,
    dialect: Dialect,
    batch_id: str,
    idx: int,
    token: str,
    not_before: float | None,
) -> None:
    """A request's line goes back to the queue (``ClaimQueries.release``)."""
    i = t.items
    chunk = conn.execute(
        update(i)
        .where(
            i.c.batch_id == batch_id,
            i.c.idx == idx,
            i.c.lease_token == token,
            i.c.state == ItemState.LEASED,
        )
        .values(state=ItemState.QUEUED, lease_token=None, lease_until=not_before)
        .returning(i.c.chunk)
    ).scalar()
    if chunk is not None:
        _reopen(conn, dialect, {(batch_id, chunk): not_before})


def _requeue_expired(conn: Connection, dialect: Dialect, now: float) -> int:
    """``ClaimQueries.requeue_expired``'s transaction."""
    i = t.items
    expired = sorted(conn.execute(expired_leases(now)).all(), key=lambda r: (r.batch_id, r.idx))
    if not expired:
        return 0
    moved = conn.execute(
        update(i)
        .where(
            tuple_(i.c.batch_id, i.c.idx).in_([(r.batch_id, r.idx) for r in expired]),
            i.c.state == ItemState.LEASED,
            i.c.lease_until < now,
        )
        .values(state=ItemState.QUEUED, lease_token=None, lease_until=None)
        .returning(i.c.idx)
    ).all()
    _reopen(conn, dialect, {(r.batch_id, r.chunk): None for r in expired if r.chunk is not None})
    return len(moved)


class ClaimQueries(SqlBase):
    async def claim(
        self, models: Sequence[str], limit: int, token: str, lease_until: float, now: float
    ) -> list[Claim]:
        """Lease up to ``limit`` queued lines for an engine serving ``models``: a chunk from
        each of the lanes whose turn it is, split among them by weighted fair share (urgent
        lanes first), lines in index order within each."""
        if not models or limit <= 0:
            return []
        return await self.in_one_trip(
            "claiming work", _claim, self.dialect, models, limit, token, lease_until, now
        )

    async def ready_models(self, models: Sequence[str], now: float) -> set[str]:
        """Which of ``models`` have a lane a claim could take lines from at ``now`` (the
        claim's own tests, without its locks): what an engine started on demand waits for."""
        if not models:
            return set()
        async with self.engine.connect() as conn:
            rows = await conn.execute(_READY_MODELS, {"models": list(models), "now": now})
            return {row.model for row in rows}

    async def renew_leases(
        self, token: str, lease_until: float, held: Mapping[str, Collection[int]]
    ) -> None:
        await self.in_one_trip("renewing leases", _renew, token, lease_until, held)

    async def release(
        self, batch_id: str, idx: int, token: str, not_before: float | None = None
    ) -> None:
        await self.in_one_trip(
            "releasing a request", _release, self.dialect, batch_id, idx, token, not_before
        )

    async def requeue_expired(self, now: float) -> int:
        """Put lines whose lease ran out back in the queue (their worker died or stalled).
        Reads only leased lines (a partial index), never the batch's history. One trip on
        SQLite: every idle worker's lifecycle pass makes it."""
        return await self.in_one_trip(
            "requeueing expired leases", _requeue_expired, self.dialect, now
        )

    async def release_all_leases(self) -> None:
        """At the start of a worker alone on its database: every lease is its own, from before,
        the finalize leases of batches it was finalizing included (the next lifecycle pass takes
        those over, and cleans up what the dead attempt left, at once)."""
        async with self.writing("releasing leases") as conn:
            await conn.execute(
                update(t.items)
                .where(t.items.c.state == ItemState.LEASED)
                .values(lease_until=_ENDED)
            )
            await conn.execute(
                update(t.batches)
                .where(t.batches.c.finalize_until.is_not(None))
                .values(finalize_until=_ENDED)
            )
        # Every lease now ended before any clock's zero, whatever clock the worker keeps.
        while await self.requeue_expired(0.0):
            pass


def queued_lines(batch_id: Any, first: Any, end: Any, now: Any, limit: int | None) -> Select[Any]:
    """A claim's lines: queued ones of one chunk in index order, through the claim index. A
    queued line may carry a not-before time in lease_until (a release with backoff). Each
    value may be a bound parameter instead (the claim's statement is built once)."""
    i = t.items
    return (
        select(i.c.idx)
        .where(
            i.c.batch_id == batch_id,
            i.c.state == ItemState.QUEUED,
            i.c.idx >= first,
            i.c.idx < end,
            (i.c.lease_until.is_(None)) | (i.c.lease_until <= now),
        )
        .order_by(i.c.idx)
        .limit(limit)
    )


def expired_leases(now: float) -> Select[Any]:
    """Leased lines whose lease ran out, through the partial index of leased lines. Not
    ordered: an ORDER BY on the key makes SQLite walk every line ever queued instead."""
    i = t.items
    return (
        select(i.c.batch_id, i.c.idx, i.c.chunk)
        .where(i.c.state == ItemState.LEASED, i.c.lease_until < now)
        .limit(_SWEEP_LIMIT)
    )


async def open_lane(conn: AsyncConnection, batch: Any, dialect: Dialect) -> None:
    """A batch starts: its lane gains its chunks. A lane that was idle (no ready chunk) starts
    level with the busy lane of its model that has the least virtual time, from below or from
    above: it neither takes a burst to catch up nor waits for the others to pass its own
    history. From then on they share by weight. With no busy lane it keeps its time (any lane
    opened later is levelled to it): ``claim_model.level_on_reopen``."""
    ready = (
        await conn.execute(
            select(func.count())
            .select_from(t.chunks)
            .where(t.chunks.c.batch_id == batch.id, t.chunks.c.state == ChunkState.READY)
        )
    ).scalar_one()
    lanes = t.lanes
    row = {
        "model": batch.model,
        "org_id": batch.org_id,
        "metered": batch.billing == Billing.GPU_TIME,
    }
    await conn.execute(dialect.insert_ignoring(lanes).values(**row))
    key = (lanes.c.model == batch.model) & (lanes.c.org_id == batch.org_id)
    # The lane's row is locked before the level is read: its ready count and virtual time
    # cannot change under the level (claims and plans update lanes, so they wait for it).
    lane = (
        await conn.execute(dialect.for_update(select(lanes.c.vtime, lanes.c.ready).where(key)))
    ).one()
    # None when no lane of the model has ready work; an idle lane itself is never counted.
    least_busy = (
        await conn.execute(
            select(func.min(lanes.c.vtime)).where(lanes.c.model == batch.model, lanes.c.ready > 0)
        )
    ).scalar()
    await conn.execute(
        update(lanes)
        .where(key)
        .values(
            vtime=level_on_reopen(lane.vtime, lane.ready, least_busy),
            ready=lanes.c.ready + ready,
            metered=row["metered"],
        )
    )


def drop_chunks(conn: Connection, batch_id: str) -> None:
    """A batch stops running: its chunks go, and their lanes lose the ready ones. Synchronous
    (a group commit's transaction runs it); an async caller uses ``conn.run_sync``."""
    c = t.chunks
    # RETURNING reports each row as deleted, after any claim that held it committed, so a
    # chunk a concurrent claim took is not counted twice.
    rows = conn.execute(
        delete(c).where(c.c.batch_id == batch_id).returning(c.c.model, c.c.org_id, c.c.state)
    ).all()
    ready = Counter((r.model, r.org_id) for r in rows if r.state == ChunkState.READY)
    for (model, org_id), n in sorted(ready.items()):
        conn.execute(
            update(t.lanes)
            .where(t.lanes.c.model == model, t.lanes.c.org_id == org_id)
            .values(ready=t.lanes.c.ready - n)
        )


def _paused(conn: Connection, batch_id: str) -> bool:
    """Read after the chunk's lock: a pause holds every chunk of its batch while it commits
    (batch_controls.py), so this sees a pause that raced the line's return."""
    b = t.batches
    return conn.execute(select(b.c.paused_at).where(b.c.id == batch_id)).scalar() is not None


def _reopen(
    conn: Connection, dialect: Dialect, chunks: Mapping[tuple[str, int], float | None]
) -> None:
    """Lines of these chunks went back to the queue (with a not-before time, or None): a taken
    chunk is ready again, and its lane counts it; a paused batch's is held instead."""
    c = t.chunks
    reopened: Counter[tuple[str, str]] = Counter()
    # A batch's pause is read once, after its first chunk's lock: a pause that had not
    # committed by then waits for this transaction (it locks every chunk of its batch).
    paused: dict[str, bool] = {}
    for (batch_id, chunk), not_before in sorted(chunks.items()):
        key = (c.c.batch_id == batch_id) & (c.c.chunk == chunk)
        query = select(c.c.state, c.c.not_before, c.c.model, c.c.org_id).where(key)
        row = conn.execute(dialect.for_update(query)).first()
        if row is None:
            continue  # the batch stopped running: its chunks are gone
        if row.state == ChunkState.TAKEN and batch_id not in paused:
            paused[batch_id] = _paused(conn, batch_id)
        if row.state == ChunkState.TAKEN and paused[batch_id]:
            conn.execute(
                update(c).where(key).values(state=ChunkState.PAUSED, not_before=not_before)
            )
        elif row.state == ChunkState.TAKEN:
            conn.execute(update(c).where(key).values(state=ChunkState.READY, not_before=not_before))
            reopened[(row.model, row.org_id)] += 1
        elif row.not_before is not None:
            # Ready already: the chunk may be picked from the sooner of the two times.
            soonest = None if not_before is None else min(row.not_before, not_before)
            conn.execute(update(c).where(key).values(not_before=soonest))
    for (model, org_id), n in sorted(reopened.items()):
        conn.execute(
            update(t.lanes)
            .where(t.lanes.c.model == model, t.lanes.c.org_id == org_id)
            .values(ready=t.lanes.c.ready + n)
        )
