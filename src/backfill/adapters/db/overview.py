"""Read models for the dashboard: an org by id and its credit, its ledger entries, its
batches' charges, a batch's failed lines, orgs with their credit, the queue by model
(``OverviewStore``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, case, func, literal_column, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.rows import org_of
from backfill.adapters.db.sums import joined, sum_halves
from backfill.domain import ids
from backfill.domain.catalog import Billing
from backfill.domain.lifecycle import TERMINAL, BatchStatus, Outcome
from backfill.domain.overview import (
    BatchCharges,
    EntryKind,
    LedgerEntry,
    ModelQueue,
    OrgAccount,
    OrgCredit,
)
from backfill.domain.records import Org, Page, StoredResult
from backfill.errors import InvalidInput

# Named statuses rather than NOT IN, so ix_batches_status_expires serves the read.
_UNFINISHED = [status.value for status in BatchStatus if status.value not in TERMINAL]
CREDIT_PREFIX = "cr_"
# Ledger positions are nanoseconds: a batch's is its listing key ``seq``, a credit's the start
# of the second it was added in.
_NS = 1_000_000_000


def _bad_after(after: str, what: str) -> InvalidInput:
    # The same answer for another org's id as for one that never existed.
    return InvalidInput(
        f"'after' must be the id of {what} from an earlier page; "
        f"{after[: ids.MAX_ID_CHARS]!r} is not one.",
        code="invalid_value",
        param="after",
    )


def _older(position: Any, id_column: Any, anchor: tuple[int, str]) -> Any:
    """Rows after ``anchor`` in the ledger's newest-first ``(position, id)`` order."""
    at, anchor_id = anchor
    # The first term bounds the index range; the second breaks a tie by id.
    return and_(position <= at, or_(position < at, id_column < anchor_id))


class OverviewQueries(SqlBase):
    async def org_by_id(self, org_id: str) -> Org | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(t.orgs).where(t.orgs.c.id == org_id))).first()
        return org_of(row) if row else None

    async def org_account(self, org_id: str) -> OrgAccount | None:
        o, c = t.orgs, t.credits
        high, low = sum_halves(c.c.amount)
        # One statement, so the balance and the credits come from one snapshot: a credit that
        # commits meanwhile is in both or in neither. The receipts are never read.
        credits = [
            select(half).where(c.c.org_id == o.c.id).scalar_subquery() for half in (high, low)
        ]
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(
                        o, credits[0].label("credits_high"), credits[1].label("credits_low")
                    ).where(o.c.id == org_id)
                )
            ).first()
        if row is None:
            return None
        return OrgAccount(
            org_of(row),
            credits=joined(row.credits_high, row.credits_low),
            balance=int(row.balance),
            reserved=int(row.reserved),
        )

    async def ledger_entries(self, org_id: str, after: str | None, limit: int) -> Page[LedgerEntry]:
        c, b = t.credits, t.batches
        # Credits are few per org (an administrator adds each), read through ix_credits_org.
        credits = select(c.c.id, c.c.amount, c.c.note, c.c.created_at).where(c.c.org_id == org_id)
        # Batches are walked newest first along ix_batches_org_seq, so a page reads about as
        # many rows as it shows instead of sorting every batch of the org. GPU-time batches
        # are charged per deployment span, not per batch: their spans are in the totals and
        # at GET /v1/receipts/{id}, not listed here.
        batches = select(
            b.c.id, b.c.seq, b.c.charged, b.c.reserved, b.c.created_at, b.c.status, b.c.model
        ).where(
            b.c.org_id == org_id,
            b.c.billing == Billing.CATALOG.value,
            or_(b.c.charged > 0, b.c.reserved > 0),
        )
        async with self.engine.connect() as conn:
            if after:
                anchor = await self._entry_anchor(conn, org_id, after)
                credits = credits.where(_older(c.c.created_at * _NS, c.c.id, anchor))
                batches = batches.where(_older(b.c.seq, b.c.id, anchor))
            credit_rows = (
                await conn.execute(
                    credits.order_by(c.c.created_at.desc(), c.c.id.desc()).limit(limit + 1)
                )
            ).all()
            batch_rows = (
                await conn.execute(batches.order_by(b.c.seq.desc(), b.c.id.desc()).limit(limit + 1))
            ).all()
        positioned = [
            (
                (int(r.created_at) * _NS, r.id),
                LedgerEntry(r.id, EntryKind.CREDIT, int(r.amount), r.created_at, note=r.note),
            )
            for r in credit_rows
        ] + [
            (
                (int(r.seq), r.id),
                LedgerEntry(
                    r.id,
                    EntryKind.BATCH,
                    int(r.charged),
                    r.created_at,
                    reserved=int(r.reserved),
                    status=r.status,
                    model=r.model,
                ),
            )
            for r in batch_rows
        ]
        positioned.sort(key=lambda pair: pair[0], reverse=True)
        entries = [entry for _, entry in positioned]
        return Page(items=entries[:limit], has_more=len(entries) > limit)

    async def _entry_anchor(
        self, conn: AsyncConnection, org_id: str, after: str
    ) -> tuple[int, str]:
        """The ledger position of the org's entry ``after``: an id of another org's entry is
        refused as an unknown one is."""
        if ids.plausible(after):
            if after.startswith(CREDIT_PREFIX):
                c = t.credits
                created = (
                    await conn.execute(
                        select(c.c.created_at).where(c.c.id == after, c.c.org_id == org_id)
                    )
                ).scalar()
                position = None if created is None else int(created) * _NS
            else:
                b = t.batches
                seq = (
                    await conn.execute(select(b.c.seq).where(b.c.id == after, b.c.org_id == org_id))
                ).scalar()
                position = None if seq is None else int(seq)
            if position is not None:
                return position, after
        raise _bad_after(after, "a ledger entry of this organization")

    async def batch_charges(self, org_id: str, batch_ids: Sequence[str]) -> list[BatchCharges]:
        if not batch_ids:
            return []
        b = t.batches
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(b.c.id, b.c.status, b.c.billing, b.c.charged, b.c.reserved).where(
                        b.c.org_id == org_id, b.c.id.in_(list(batch_ids))
                    )
                )
            ).all()
        return [
            BatchCharges(
                r.id, BatchStatus(r.status), Billing(r.billing), int(r.charged), int(r.reserved)
            )
            for r in rows
        ]

    async def failed_results(
        self, org_id: str, batch_id: str, after_idx: int, limit: int
    ) -> list[StoredResult]:
        i, b = t.items, t.batches
        # Along the partial index ix_items_failed (batch_id, idx) WHERE outcome = 2: only
        # failed lines are read. The outcome is a literal so both databases match the index's
        # condition (a bound value would not).
        query = (
            select(i.c.idx, i.c.custom_id, i.c.result, i.c.error_code)
            .select_from(i.join(b, b.c.id == i.c.batch_id))
            .where(
                b.c.id == batch_id,
                b.c.org_id == org_id,
                i.c.batch_id == batch_id,
                i.c.outcome == literal_column(str(Outcome.ERROR)),
                i.c.idx > after_idx,
            )
            .order_by(i.c.idx)
            .limit(limit)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [StoredResult(r.idx, r.custom_id, False, r.result, r.error_code) for r in rows]

    async def org_credits(self, after: str | None, limit: int) -> Page[OrgCredit]:
        o = t.orgs
        query = select(
            o.c.id,
            o.c.name,
            o.c.created_at,
            o.c.weight,
            o.c.max_priority,
            o.c.balance,
            o.c.reserved,
        )
        async with self.engine.connect() as conn:
            if after:
                created = (
                    (await conn.execute(select(o.c.created_at).where(o.c.id == after))).scalar()
                    if ids.plausible(after)
                    else None
                )
                if created is None:
                    raise _bad_after(after, "an organization")
                query = query.where(
                    or_(o.c.created_at > created, and_(o.c.created_at == created, o.c.id > after))
                )
            rows = (
                await conn.execute(query.order_by(o.c.created_at, o.c.id).limit(limit + 1))
            ).all()
        return Page(
            items=[OrgCredit(org_of(r), int(r.balance), int(r.reserved)) for r in rows[:limit]],
            has_more=len(rows) > limit,
        )

    async def queue_by_model(self) -> list[ModelQueue]:
        b, r = t.batches, t.model_rates
        running = case((b.c.status == BatchStatus.IN_PROGRESS.value, 1), else_=0)
        async with self.engine.connect() as conn:
            # O(unfinished batches): the batch counters are exact, so no count over items.
            rows = (
                await conn.execute(
                    select(
                        b.c.model,
                        func.count(),
                        func.coalesce(func.sum(running), 0),
                        func.coalesce(func.sum(b.c.total - b.c.completed - b.c.failed), 0),
                    )
                    .where(b.c.status.in_(_UNFINISHED))
                    .group_by(b.c.model)
                    .order_by(b.c.model)
                )
            ).all()
            models = [row[0] for row in rows]
            rates = {
                row.model: row.rps
                for row in (
                    await conn.execute(select(r.c.model, r.c.rps).where(r.c.model.in_(models)))
                ).all()
            }
        return [
            ModelQueue(
                model=row[0],
                batches=int(row[1]),
                in_progress=int(row[2]),
                remaining=int(row[3]),
                requests_per_s=None if rates.get(row[0]) is None else float(rates[row[0]]),
            )
            for row in rows
        ]
