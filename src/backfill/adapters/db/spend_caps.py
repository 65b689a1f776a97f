"""Spend caps (domain/spend_caps.py): the caps, and what each window holds.

A window's use is one statement over ``spend``: a settled row's amount, or for a running
batch its row's charged and reserved columns read in the same snapshot, so a batch ending
while the statement runs is counted once, either way.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, case, delete, false, insert, select, true, update
from sqlalchemy.ext.asyncio import AsyncConnection

from backfill.adapters.db import tables as t
from backfill.adapters.db.dialect import Dialect
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.sums import joined, sum_halves
from backfill.domain.spend_caps import DAY_S, CapScope, CapUse, Period, SpendCap, window

_s, _b, _c = t.spend, t.batches, t.spend_caps
# A running batch's part is read from its row; a settled one's is the spend row's amount.
_OPEN = and_(_b.c.id == _s.c.id, _s.c.settled == false())
_CHARGED = sum_halves(case((_s.c.settled == true(), _s.c.amount), else_=_b.c.charged))
_RESERVED = sum_halves(case((_s.c.settled == true(), 0), else_=_b.c.reserved))
_USE = select(*_CHARGED, *_RESERVED).select_from(_s.outerjoin(_b, _OPEN))
_PERIODS = list(Period)


def cap_of(row: Any) -> SpendCap:
    return SpendCap(
        scope=CapScope(row.scope),
        scope_id=row.scope_id,
        org_id=row.org_id,
        period=Period(row.period),
        limit=int(row.amount),
        updated_at=int(row.updated_at),
    )


def _order(cap: SpendCap) -> tuple[bool, str, int]:
    """The org's caps first, then its keys' by id; each by period, day to total."""
    return cap.scope == CapScope.KEY, cap.scope_id, _PERIODS.index(cap.period)


async def use_of(conn: AsyncConnection, cap: SpendCap, now: float) -> CapUse:
    """What the window of ``cap`` that holds ``now`` was charged and still holds reserved."""
    span = window(cap.period, now)
    owner = _s.c.org_id if cap.scope == CapScope.ORG else _s.c.api_key_id
    where = [owner == cap.scope_id, _s.c.created_at >= span.start]
    if span.resets_at is not None:
        where.append(_s.c.created_at < span.resets_at)
    row = (await conn.execute(_USE.where(*where))).one()
    return CapUse(cap, span, joined(row[0], row[1]), joined(row[2], row[3]))


async def caps_in_force(
    conn: AsyncConnection, org_id: str, key_id: str | None, now: float
) -> tuple[CapUse, ...]:
    """The caps of the org and of the key ``key_id`` with what their windows hold (none read
    when there is no cap, the common case: one lookup on the caps' primary key)."""
    owners = [org_id] if key_id is None else [org_id, key_id]
    return tuple(await _uses(conn, [_c.c.scope_id.in_(owners), _c.c.org_id == org_id], now))


async def _uses(conn: AsyncConnection, where: list[Any], now: float) -> list[CapUse]:
    """The caps ``where`` selects, in ``_order``, each with what its window holds."""
    rows = await conn.execute(select(_c).where(*where))
    caps = sorted((cap_of(row) for row in rows), key=_order)
    return [await use_of(conn, cap, now) for cap in caps]


async def open_spend(
    conn: AsyncConnection, batch_id: str, org_id: str, key_id: str | None, created_at: int
) -> None:
    """A new batch's row: it counts in its creation's windows, read from the batch until it
    ends."""
    await conn.execute(
        insert(_s).values(
            id=batch_id,
            org_id=org_id,
            api_key_id=key_id,
            created_at=created_at,
            amount=0,
            settled=False,
        )
    )


async def settle_spend(conn: AsyncConnection, batch_id: str, charged: int) -> None:
    """At a batch's end its row keeps what it was charged: the batch row may be deleted."""
    await conn.execute(update(_s).where(_s.c.id == batch_id).values(amount=charged, settled=True))


async def add_gpu_spend(
    conn: AsyncConnection, dialect: Dialect, org_id: str, amount: int, charged_at: float
) -> None:
    """Add a GPU-time charge to its org's row for the UTC day it was charged: one row per org
    and day, not per span (a deployment charges every few seconds), and exact for every window
    since each is whole UTC days. The org's only: a span serves all its batches in flight."""
    day = int(charged_at // DAY_S)
    row_id = f"gpu_{org_id}_{day}"
    await conn.execute(
        dialect.insert_ignoring(_s).values(
            id=row_id,
            org_id=org_id,
            api_key_id=None,
            created_at=day * DAY_S,
            amount=0,
            settled=True,
        )
    )
    await conn.execute(update(_s).where(_s.c.id == row_id).values(amount=_s.c.amount + amount))


class SpendCapQueries(SqlBase):
    async def put_spend_cap(self, cap: SpendCap, now: float) -> CapUse:
        values = {
            "scope_id": cap.scope_id,
            "period": cap.period.value,
            "scope": cap.scope.value,
            "org_id": cap.org_id,
            "amount": cap.limit,
            "updated_at": cap.updated_at,
        }
        stmt = self.dialect.upsert(
            _c,
            values,
            key=[_c.c.scope_id, _c.c.period],
            replace=["amount", "updated_at"],
            where=true(),
        )
        async with self.writing() as conn:
            await conn.execute(stmt)
            return await use_of(conn, cap, now)

    async def delete_spend_cap(self, scope_id: str, period: Period) -> bool:
        async with self.writing() as conn:
            removed = await conn.execute(
                delete(_c).where(_c.c.scope_id == scope_id, _c.c.period == period.value)
            )
        return bool(removed.rowcount)

    async def spend_cap_uses(self, org_id: str, now: float) -> list[CapUse]:
        """The org's caps, its own and its keys', each with what its window holds now."""
        async with self.engine.connect() as conn:
            return await _uses(conn, [_c.c.org_id == org_id], now)
