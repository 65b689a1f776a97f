"""Engine health reports: each worker's rows, read by every process (docs/deployment.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, func, select, true

from backfill.adapters.db import tables as t
from backfill.adapters.db.dialect import Dialect
from backfill.adapters.db.engine import SqlBase
from backfill.domain.engine_health import EngineHold, EngineReport, EngineState, Hold
from backfill.domain.lifecycle import BatchStatus

# Rows of a worker that stopped reporting are ignored from their ``until`` on, and removed
# this much later: long enough to tell what a crashed worker last saw, short enough that
# workers restarted under new names do not pile up.
FORGET_AFTER_S = 24 * 3600.0

_KEY = ("worker", "engine")


def _values(report: EngineReport) -> dict[str, Any]:
    hold = report.hold
    return {
        "worker": report.worker,
        "engine": report.engine,
        "url": report.url,
        "models": list(report.models),
        "state": report.state.value,
        "last_error": report.last_error,
        "since": report.since,
        "checked_at": report.checked_at,
        "in_flight": report.in_flight,
        "max_concurrency": report.max_concurrency,
        "concurrency_limit": report.concurrency_limit,
        "mode": report.mode,
        "signal": report.signal,
        "pressure": report.pressure,
        "until": report.until,
        "priority": report.priority,
        "start_s": report.start_s,
        "hold": hold.hold.value if hold is not None else None,
        "hold_since": hold.since if hold is not None else None,
        "hold_until": hold.until if hold is not None else None,
        "hold_status": hold.status if hold is not None else None,
    }


def report_from_row(row: Any) -> EngineReport:
    """An ``engine_health`` row as the report it stores."""
    return EngineReport(
        worker=row.worker,
        engine=row.engine,
        url=row.url,
        models=tuple(row.models),
        state=EngineState(row.state),
        last_error=row.last_error,
        since=row.since,
        checked_at=row.checked_at,
        in_flight=row.in_flight,
        max_concurrency=row.max_concurrency,
        concurrency_limit=row.concurrency_limit,
        mode=row.mode,
        signal=row.signal,
        pressure=row.pressure,
        until=row.until,
        priority=row.priority,
        start_s=row.start_s,
        hold=(
            EngineHold(Hold(row.hold), row.hold_since or 0.0, row.hold_until, row.hold_status)
            if row.hold is not None
            else None
        ),
    )


def _store_reports(
    conn: Connection, dialect: Dialect, reports: Sequence[EngineReport], now: float
) -> None:
    h = t.engine_health
    for report in reports:
        values = _values(report)
        replace = [name for name in values if name not in _KEY]
        conn.execute(dialect.upsert(h, values, [h.c.worker, h.c.engine], replace, true()))
    conn.execute(delete(h).where(h.c.until < now - FORGET_AFTER_S))


class EngineHealthQueries(SqlBase):
    async def report_engines(self, reports: Sequence[EngineReport], now: float) -> None:
        # One trip on SQLite: every worker reports every few seconds, busy or not.
        await self.in_one_trip(
            "reporting engine health", _store_reports, self.dialect, reports, now
        )

    async def engine_reports(self, now: float) -> list[EngineReport]:
        h = t.engine_health
        query = select(h).where(h.c.until >= now).order_by(h.c.engine, h.c.worker)
        async with self.engine.connect() as conn:
            return [report_from_row(row) for row in await conn.execute(query)]

    async def forget_engines(self, worker: str, engine: str | None = None) -> None:
        h = t.engine_health
        query = delete(h).where(h.c.worker == worker)
        if engine is not None:
            query = query.where(h.c.engine == engine)
        async with self.writing("forgetting engine health") as conn:
            await conn.execute(query)

    async def running_batches_by_model(self) -> dict[str, int]:
        b = t.batches
        running = [BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value]
        # Named statuses, so ix_batches_status_expires serves the read (as ``gauges`` does).
        query = (
            select(b.c.model, func.count())
            .where(b.c.status.in_(running), b.c.completed + b.c.failed < b.c.total)
            .group_by(b.c.model)
        )
        async with self.engine.connect() as conn:
            return {model: int(count) for model, count in await conn.execute(query)}
