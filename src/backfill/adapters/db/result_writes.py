"""Fenced result writes (results, receipts and the settlement of each batch in one transaction),
and the reads beside them: live leases, queue gauges, a batch's results for finalizing, ending
its unfinished lines, failing a batch."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Select,
    bindparam,
    delete,
    func,
    insert,
    literal_column,
    null,
    select,
    update,
)

from backfill.adapters.db import tables as t
from backfill.adapters.db.bulk import BulkInsert, DriverStatement
from backfill.adapters.db.claims import drop_chunks
from backfill.adapters.db.dialect import Dialect
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.outbox import enqueue_terminal
from backfill.adapters.db.rows import (
    RECEIPT_COLUMNS,
    TERMINAL,
    prices_of,
    receipt_row,
    release_reservation,
)
from backfill.domain.catalog import Billing
from backfill.domain.lifecycle import TIMESTAMP_OF, BatchStatus, ItemState, Outcome
from backfill.domain.records import ItemResult, Stored, StoredResult
from backfill.domain.settlement import BatchTerms, Settlement, settle

_RESULT_PAGE = 2000

# The result write's statements, built once (not per group commit), each with its bound values.
_b, _i, _o = t.batches, t.items, t.orgs
_BATCH_TERMS = (
    select(
        _b.c.id,
        _b.c.org_id,
        _b.c.billing,
        _b.c.model_config_id,
        _b.c.reserved,
        _b.c.price_input,
        _b.c.price_cached_input,
        _b.c.price_output,
        _b.c.results_seq,
    )
    .where(_b.c.id.in_(bindparam("ids", expanding=True)))
    # Rows are locked in the order they are returned; without ORDER BY that is scan order,
    # which changes as the rows are updated.
    .order_by(_b.c.id)
)
_HELD = (
    select(_i.c.idx, _i.c.lease_token)
    .where(
        _i.c.batch_id == bindparam("batch"),
        _i.c.idx.in_(bindparam("idxs", expanding=True)),
        _i.c.state == ItemState.LEASED,
    )
    .order_by(_i.c.idx)
)
# A finalize's read of every line of a batch, a page at a time in index order.
_RESULTS_AFTER = (
    select(
        _i.c.idx,
        _i.c.custom_id,
        _i.c.outcome,
        _i.c.result,
        _i.c.error_code,
        _i.c.offset,
        _i.c.length,
    )
    .where(_i.c.batch_id == bindparam("batch"), _i.c.idx > bindparam("last"))
    .order_by(_i.c.idx)
    .limit(_RESULT_PAGE)
)
STORE_RESULT = (
    update(_i)
    .where(_i.c.batch_id == bindparam("b_batch"), _i.c.idx == bindparam("b_idx"))
    .values(
        # Constants in the SQL itself: the driver's rows carry only what varies.
        state=literal_column(str(int(ItemState.DONE))),
        outcome=bindparam("b_outcome"),
        result=bindparam("b_result"),
        done_seq=bindparam("b_seq"),
        done_at=bindparam("b_at"),
        input_tokens=bindparam("b_in"),
        output_tokens=bindparam("b_out"),
        lease_token=null(),
        lease_until=null(),
    )
)
# A result per request on the hot path: its rows go to the driver as tuples.
_STORE_RESULTS = DriverStatement(
    STORE_RESULT, ["b_outcome", "b_result", "b_in", "b_out", "b_seq", "b_at", "b_batch", "b_idx"]
)
_OK, _ERROR = int(Outcome.OK), int(Outcome.ERROR)
COUNT_RESULTS = (
    update(_b)
    .where(_b.c.id == bindparam("batch"))
    .values(
        completed=_b.c.completed + bindparam("d_completed"),
        failed=_b.c.failed + bindparam("d_failed"),
        input_tokens=_b.c.input_tokens + bindparam("d_input"),
        output_tokens=_b.c.output_tokens + bindparam("d_output"),
        cached_tokens=_b.c.cached_tokens + bindparam("d_cached"),
        charged=_b.c.charged + bindparam("d_charged"),
        reserved=_b.c.reserved - bindparam("d_released"),
        results_seq=_b.c.results_seq + bindparam("d_numbered"),
    )
    .returning(_b.c.status, _b.c.total, _b.c.completed, _b.c.failed)
)
_INSERT_RECEIPTS = BulkInsert(insert(t.receipts), RECEIPT_COLUMNS)
_CHARGE_ORG = (
    update(_o)
    .where(_o.c.id == bindparam("org"))
    .values(
        balance=_o.c.balance - bindparam("d_charged"),
        reserved=_o.c.reserved - bindparam("d_released"),
    )
)


@functools.cache
def batch_terms(dialect: Dialect) -> Select[Any]:
    """The written batches' terms, their rows locked (PostgreSQL), built once per dialect."""
    return dialect.for_update(_BATCH_TERMS)


@functools.cache
def locked_leases(dialect: Dialect) -> Select[Any]:
    """One batch's leased items among ``idxs``, their rows locked, built once per dialect."""
    return dialect.for_update(_HELD)


def _terms_of(row: Any) -> BatchTerms:
    return BatchTerms(
        id=row.id,
        org_id=row.org_id,
        model_config_id=row.model_config_id,
        billing=Billing(row.billing),
        prices=prices_of(row),
        reserved=row.reserved,
    )


def _apply(conn: Connection, batch_id: str, settlement: Settlement, numbered: int) -> bool:
    """Add a write's counts to its batch's row (locked since the write's first select), and
    move the batch to ``finalizing`` when they complete it. The org row is left to the
    caller, which updates each org once, in id order, after every batch. True when the write
    finished the batch.

    ``numbered``: how many ``done_seq`` numbers the write handed out; the row's
    ``results_seq`` moves past them in this same update (no statement of its own)."""
    if not settlement.counted and not numbered:
        return False
    b = t.batches
    row = (
        conn.execute(
            COUNT_RESULTS,
            {
                "batch": batch_id,
                "d_completed": settlement.completed,
                "d_failed": settlement.failed,
                "d_input": settlement.input_tokens,
                "d_output": settlement.output_tokens,
                "d_cached": settlement.cached_tokens,
                "d_charged": settlement.charged,
                "d_released": settlement.released,
                "d_numbered": numbered,
            },
        )
    ).one()
    if row.status == BatchStatus.IN_PROGRESS and row.completed + row.failed >= row.total:
        # The last result ends the run in the same transaction, so nobody has to scan
        # running batches for finished ones. A batch already cancelling is left as it is:
        # the cancel decides how it ends.
        conn.execute(
            update(b)
            .where(b.c.id == batch_id, b.c.status == BatchStatus.IN_PROGRESS)
            .values(
                status=BatchStatus.FINALIZING,
                **{TIMESTAMP_OF[BatchStatus.FINALIZING]: int(settlement.finished_at)},
            )
        )
        # Nothing of it is claimable any more (every line is done): its chunks go.
        drop_chunks(conn, batch_id)
        return True
    return False


def _store_results(conn: Connection, dialect: Dialect, results: Sequence[ItemResult]) -> Stored:
    """A group commit's transaction (``ResultWriteQueries.write_results``)."""
    # Every group commit takes its row locks in one global order (batches by id, their
    # items by idx, receipts, orgs by id), so concurrent groups that share batches or orgs
    # queue behind each other instead of deadlocking: a rolled-back group would cost the
    # whole group's compute again.
    batch_ids = sorted({r.batch_id for r in results})
    rows = conn.execute(batch_terms(dialect), {"ids": batch_ids}).all()
    terms = [_terms_of(row) for row in rows]
    # The last number handed out per batch, read under the batch row's lock (SQLite:
    # the one writer), so numbers commit in order and a reader never skips one.
    last_seq = {row.id: row.results_seq for row in rows}
    held = _held_leases(conn, dialect, results)
    flags = []
    for r in results:
        key = (r.batch_id, r.idx, r.lease_token)
        flags.append(key in held)
        held.discard(key)  # a second result for the same item in one write loses
    accepted = sorted(
        (r for r, ok in zip(results, flags, strict=True) if ok),
        key=lambda r: (r.batch_id, r.idx),
    )
    numbered: dict[str, int] = {}
    seqs = []
    # A batch's results of one write are stored together, after the last of them ended:
    # they share its time, so a batch's times never go down along its numbers.
    stored_at: dict[str, float] = {}
    for r in accepted:
        numbered[r.batch_id] = numbered.get(r.batch_id, 0) + 1
        seqs.append(last_seq[r.batch_id] + numbered[r.batch_id])
        stored_at[r.batch_id] = max(stored_at.get(r.batch_id, 0.0), r.finished_at)
    if accepted:
        # The leases were just checked (and locked on PostgreSQL) in this transaction,
        # so one executemany stores them all.
        _STORE_RESULTS.run_in(
            conn,
            [
                (
                    _OK if r.ok else _ERROR,
                    r.payload,
                    r.input_tokens,
                    r.output_tokens,
                    seq,
                    stored_at[r.batch_id],
                    r.batch_id,
                    r.idx,
                )
                for r, seq in zip(accepted, seqs, strict=True)
            ],
        )
    by_batch: dict[str, list[ItemResult]] = {}
    for r in accepted:
        by_batch.setdefault(r.batch_id, []).append(r)
    settled = [(batch, settle(batch, by_batch.get(batch.id, ()))) for batch in terms]
    _INSERT_RECEIPTS.run_in(conn, [receipt_row(r) for _, done in settled for r in done.receipts])
    owed: dict[str, tuple[int, int]] = {}
    finished: set[str] = set()
    for batch, settlement in settled:
        if _apply(conn, batch.id, settlement, numbered.get(batch.id, 0)):
            finished.add(batch.id)
        if settlement.charged:
            charged, released = owed.get(batch.org_id, (0, 0))
            owed[batch.org_id] = (
                charged + settlement.charged,
                released + settlement.released,
            )
    # One update per org, the hottest rows of all, taken last and held shortest.
    for org_id in sorted(owed):
        charged, released = owed[org_id]
        conn.execute(_CHARGE_ORG, {"org": org_id, "d_charged": charged, "d_released": released})
    return Stored(flags, frozenset(finished))


def _held_leases(
    conn: Connection, dialect: Dialect, results: Sequence[ItemResult]
) -> set[tuple[str, int, str]]:
    """Which of these results' items are still leased with the token they carry; on
    PostgreSQL their rows are locked, batch by batch in id order and by idx within one."""
    held: set[tuple[str, int, str]] = set()
    by_batch: dict[str, set[int]] = {}
    for r in results:
        by_batch.setdefault(r.batch_id, set()).add(r.idx)
    query = locked_leases(dialect)
    for batch_id in sorted(by_batch):
        params = {"batch": batch_id, "idxs": sorted(by_batch[batch_id])}
        for row in conn.execute(query, params).all():
            held.add((batch_id, row.idx, row.lease_token))
    return held


class ResultWriteQueries(SqlBase):
    # ---- work queue -------------------------------------------------------------------

    async def write_results(self, results: Sequence[ItemResult]) -> Stored:
        return await self.in_one_trip("storing results", _store_results, self.dialect, results)

    async def live_leases(self, batch_id: str, now: float) -> int:
        i = t.items
        async with self.engine.connect() as conn:
            return int(
                (
                    await conn.execute(
                        select(func.count())
                        .select_from(i)
                        .where(
                            i.c.batch_id == batch_id,
                            i.c.state == ItemState.LEASED,
                            i.c.lease_until >= now,
                        )
                    )
                ).scalar_one()
            )

    async def gauges(self) -> tuple[dict[str, int], int]:
        b = t.batches
        # Named statuses rather than NOT IN, so ix_batches_status_expires serves the read.
        unfinished = [status.value for status in BatchStatus if status.value not in TERMINAL]
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(b.c.status, func.count()).group_by(b.c.status))).all()
            # The batch counters move in the result transaction, so they are exact: the depth is
            # O(unfinished batches), never a count over items, whose long snapshot would hold
            # back vacuum of the whole queue.
            depth = (
                await conn.execute(
                    select(
                        func.coalesce(func.sum(b.c.total - b.c.completed - b.c.failed), 0)
                    ).where(b.c.status.in_(unfinished))
                )
            ).scalar_one()
        return {status: int(count) for status, count in rows}, int(depth)

    async def ping(self) -> None:
        async with self.engine.connect() as conn:
            await conn.execute(select(1))

    async def close_unfinished(self, batch_id: str, error_code: str) -> int:
        i = t.items
        async with self.engine.begin() as conn:
            # The batch row first: the lock order every writer keeps (see claims.py).
            await self.dialect.lock(conn, select(t.batches.c.id).where(t.batches.c.id == batch_id))
            res = await conn.execute(
                update(i)
                .where(i.c.batch_id == batch_id, i.c.state != ItemState.DONE)
                .values(
                    state=ItemState.DONE,
                    outcome=Outcome.ERROR,
                    error_code=error_code,
                    lease_token=None,
                    lease_until=None,
                )
            )
            closed = int(res.rowcount)
            await conn.run_sync(drop_chunks, batch_id)
            if closed:
                await conn.execute(
                    update(t.batches)
                    .where(t.batches.c.id == batch_id)
                    .values(failed=t.batches.c.failed + closed)
                )
        return closed

    async def iter_results(self, batch_id: str) -> AsyncIterator[list[StoredResult]]:
        last = -1
        while True:
            # On the read connections: a finalize reads every line of a batch, and the single
            # writer stays free for the claims and results of the others meanwhile. Every
            # result it reads was committed before the batch could be finalized.
            async with self.reads.connect() as conn:
                rows = (await conn.execute(_RESULTS_AFTER, {"batch": batch_id, "last": last})).all()
            if not rows:
                return
            last = rows[-1].idx
            # Unpacked as tuples: a finalize reads every line of the batch, and a row's
            # attribute access costs more than the rest of its reading.
            ok = Outcome.OK
            yield [
                StoredResult(idx, cid, outcome == ok, result, code, offset, length)
                for idx, cid, outcome, result, code, offset, length in rows
            ]

    async def fail_batch(
        self, batch_id: str, expected_status: str, now: int, errors: list[dict[str, Any]]
    ) -> bool:
        """A batch that could not start ends ``failed`` with ``errors``; nothing stays reserved
        and its queue items, if any were written, are removed."""
        async with self.engine.begin() as conn:
            res = await conn.execute(
                update(t.batches)
                .where(t.batches.c.id == batch_id, t.batches.c.status == expected_status)
                .values(status=BatchStatus.FAILED, failed_at=now, errors=errors)
            )
            if not res.rowcount:
                return False
            await conn.execute(delete(t.items).where(t.items.c.batch_id == batch_id))
            await conn.run_sync(drop_chunks, batch_id)
            await release_reservation(conn, batch_id)
            await enqueue_terminal(conn, batch_id, now)
        return True
