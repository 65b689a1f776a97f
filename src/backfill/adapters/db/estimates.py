"""What an estimate reads: admission's own snapshot, without its lock and without a write, and
the org's recent answers of a model."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import select

from backfill.adapters.db import tables as t
from backfill.adapters.db.batches import BatchQueries
from backfill.domain.admission import AdmissionSnapshot
from backfill.domain.estimates import SAMPLE_BATCHES, AnswerSample, sample_of
from backfill.domain.records import Admission, BatchRecord

_b = t.batches


class EstimateQueries(BatchQueries):
    async def admission_snapshot(
        self, batch: BatchRecord, admission: Admission
    ) -> AdmissionSnapshot:
        """What ``create_batch`` reads to decide ``batch``, read the same way now. The model's
        backlog is read even where deadline admission is off: the estimate's completion time
        needs it, and ``check`` looks at it only when ``admission`` says so. Read on the API's
        read connections: an estimate never queues behind the workers' writes, nor they behind
        it."""
        async with self.reads.connect() as conn:
            return await self._admission_snapshot(
                conn, batch, replace(admission, deadline_aware=True)
            )

    async def answer_sample(self, org_id: str, model: str) -> AnswerSample:
        """The org's newest batches of ``model`` that were answered, from their counters (one
        row a batch, along the org's listing index): never a walk over result rows."""
        query = (
            select(_b.c.completed, _b.c.output_tokens)
            .where(_b.c.org_id == org_id, _b.c.model == model, _b.c.completed > 0)
            .order_by(_b.c.seq.desc())
            .limit(SAMPLE_BATCHES)
        )
        async with self.reads.connect() as conn:
            rows = (await conn.execute(query)).all()
        return sample_of((int(r.completed), int(r.output_tokens)) for r in rows)
