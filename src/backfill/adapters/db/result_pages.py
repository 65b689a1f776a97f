"""Pages of a batch's stored results, for readers while it runs (``domain/result_cursor.py``)."""

from __future__ import annotations

from sqlalchemy import select

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.domain.lifecycle import ItemState, Outcome
from backfill.domain.records import StoredResult
from backfill.domain.result_cursor import PagedResult, ResultCursor


class ResultPageQueries(SqlBase):
    async def results_after(
        self, batch_id: str, cursor: ResultCursor, limit: int
    ) -> list[PagedResult]:
        i = t.items
        columns = (i.c.idx, i.c.custom_id, i.c.outcome, i.c.result, i.c.error_code, i.c.done_seq)
        if cursor.numbered:
            # A number is committed only after every smaller one of its batch (they are handed
            # out under the batch row's lock), so reading past the cursor skips nothing.
            query = (
                select(*columns)
                .where(i.c.batch_id == batch_id, i.c.done_seq > cursor.position)
                .order_by(i.c.done_seq)
            )
        else:
            query = (
                select(*columns)
                .where(
                    i.c.batch_id == batch_id,
                    i.c.state == ItemState.DONE,
                    i.c.done_seq.is_(None),
                    i.c.idx >= cursor.position,
                )
                .order_by(i.c.idx)
            )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query.limit(limit))).all()
        return [
            PagedResult(
                StoredResult(r.idx, r.custom_id, r.outcome == Outcome.OK, r.result, r.error_code),
                ResultCursor(True, r.done_seq)
                if cursor.numbered
                else ResultCursor(False, r.idx + 1),
            )
            for r in rows
        ]
