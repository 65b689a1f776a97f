"""A batch's progress over time, from the times its results were stored (``domain/progress.py``)."""

from __future__ import annotations

from sqlalchemy import select

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.domain.progress import BatchProgress, curve, sampled_seqs


class ProgressQueries(SqlBase):
    async def progress_history(
        self, org_id: str, batch_id: str, max_points: int
    ) -> BatchProgress | None:
        b = t.batches
        i = t.items
        async with self.engine.connect() as conn:
            batch = (
                await conn.execute(
                    select(b.c.total, b.c.results_seq).where(
                        b.c.id == batch_id, b.c.org_id == org_id
                    )
                )
            ).first()
            if batch is None:
                return None
            # ``results_seq`` moves in the transaction that stores its results, so every
            # number up to the one read here is committed: none of those read next is missing.
            seqs = sampled_seqs(int(batch.results_seq), max_points)
            if not seqs:
                return BatchProgress(int(batch.total), ())
            # A few numbers looked up on ix_items_results, however many lines the batch has.
            # ``IS NOT NULL`` restates the partial index's condition so that every planner
            # sees it applies.
            rows = (
                await conn.execute(
                    select(i.c.done_seq, i.c.done_at).where(
                        i.c.batch_id == batch_id,
                        i.c.done_seq.is_not(None),
                        i.c.done_seq.in_(seqs),
                    )
                )
            ).all()
        times = {int(row.done_seq): row.done_at for row in rows}
        return BatchProgress(int(batch.total), curve(seqs, times))
