"""What each model's queue asks of its fleet, read from stored state only (``demand_inputs``):
the batches still to be served, the planner's rate per replica, the workers' engine rows."""

from __future__ import annotations

from sqlalchemy import func, select

from backfill.adapters.db import tables as t
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.engine_health import report_from_row
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.scheduling.demand import DemandInputs, QueuedBatch

_b, _f, _r = t.batches, t.files, t.model_rates
# The lines admission counts ahead of a new batch: validating and in-progress batches (named
# statuses, so ix_batches_status_expires serves the read: running batches, not history).
_QUEUED = (
    select(
        _b.c.model,
        _b.c.total,
        (_b.c.total - _b.c.completed - _b.c.failed).label("remaining"),
        _b.c.output_token_bound,
        func.coalesce(_f.c.prompt_token_bound, 0).label("prompt_token_bound"),
        _b.c.created_at,
        _b.c.expires_at,
    )
    .join_from(_b, _f, _f.c.id == _b.c.input_file_id, isouter=True)
    .where(
        _b.c.status.in_([BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value]),
        _b.c.completed + _b.c.failed < _b.c.total,
    )
)
_RATES = select(_r.c.model, _r.c.rps_per_replica)
# Every worker's rows: the caller's time decides which still count.
_ENGINES = select(t.engine_health)


class DemandQueries(SqlBase):
    async def demand_inputs(self) -> DemandInputs:
        async with self.engine.connect() as conn:
            queued = (await conn.execute(_QUEUED)).all()
            rates = (await conn.execute(_RATES)).all()
            engines = (await conn.execute(_ENGINES)).all()
        return DemandInputs(
            queued=[
                QueuedBatch(
                    model=row.model,
                    remaining=int(row.remaining),
                    # The bound of the whole batch, scaled to the share of lines not finished.
                    tokens_bound=(int(row.prompt_token_bound) + int(row.output_token_bound))
                    * int(row.remaining)
                    // max(int(row.total), 1),
                    created_at=int(row.created_at),
                    expires_at=int(row.expires_at),
                )
                for row in queued
            ],
            per_replica={
                row.model: None if row.rps_per_replica is None else float(row.rps_per_replica)
                for row in rates
            },
            engines=[report_from_row(row) for row in engines],
        )
