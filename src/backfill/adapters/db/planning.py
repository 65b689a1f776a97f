"""What the planner reads (lanes, running batches, measured rates, the replicas up) and writes
back (lane urgency and shares, model rates, batch estimates), and the dispatch shares /metrics
shows."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from backfill.adapters.db import tables as t
from backfill.adapters.db.batch_controls import rescue
from backfill.adapters.db.engine import SqlBase
from backfill.adapters.db.engine_health import report_from_row
from backfill.domain.lifecycle import BatchStatus, ItemState
from backfill.domain.records import DispatchShare
from backfill.domain.scheduling.claim_model import has_claimable_work
from backfill.domain.scheduling.planning import (
    LaneLoad,
    ModelRate,
    Plan,
    PlanInputs,
    RunningBatch,
)
from backfill.domain.waiting import LaneWait, WaitCode

_ln, _o, _b, _m, _i = t.lanes, t.orgs, t.batches, t.models, t.items
# The planner's reads, built once. A lane counts as having work only when a claim could take
# it (claim_model.has_claimable_work, applied to these columns as the rows are read).
_LANES = (
    select(
        _ln.c.model,
        _ln.c.org_id,
        _ln.c.served,
        _ln.c.served_mark,
        _ln.c.ready,
        _ln.c.metered,
        _o.c.balance,
        _o.c.weight,
        _ln.c.urgent_by,
        _ln.c.share,
        _ln.c.vtime,
        _ln.c.waiting_code,
        _ln.c.waiting_since,
        _ln.c.waiting_detail,
        _m.c.gpu_count,
        _m.c.microusd_per_gpu_second,
    )
    .join_from(_ln, _o, _o.c.id == _ln.c.org_id)
    # A private deployment's price, for what a lane held for credit needs.
    .outerjoin(_m, _m.c.id == _ln.c.model)
)
_RATES = select(t.model_rates)
_RUNNING = (
    select(
        _b.c.id,
        _b.c.model,
        _b.c.org_id,
        _o.c.weight,
        (_b.c.total - _b.c.completed - _b.c.failed).label("remaining"),
        _b.c.created_at,
        _b.c.expires_at,
        _b.c.estimated_completion_at,
        _b.c.priority,
        _b.c.urgent,
        _b.c.paused_at,
    )
    .join_from(_b, _o, _o.c.id == _b.c.org_id)
    .where(_b.c.status == BatchStatus.IN_PROGRESS)
)


# Every worker's engine rows, those of workers that stopped reporting included: the plan,
# made at its own time, leaves out rows whose ``until`` has passed. A few rows per worker.
_ENGINES = select(t.engine_health)
# Which of some batches have lines leased: ``ix_items_claim`` (batch_id, state) reads only
# those lines, one range per batch.
_LEASED = (
    select(_i.c.batch_id)
    .where(_i.c.batch_id.in_(bindparam("ids", expanding=True)), _i.c.state == ItemState.LEASED)
    .distinct()
)
# Batch ids per statement: well under every database's limit on bound values.
_LEASED_PER_QUERY = 500


def _shared(running: Sequence[Any]) -> list[str]:
    """The running batches of models that more than one org has running batches for: only
    their lanes can wait on fair share, so only their leases are read."""
    orgs: dict[str, set[str]] = defaultdict(set)
    for row in running:
        orgs[row.model].add(row.org_id)
    return sorted(row.id for row in running if len(orgs[row.model]) > 1)


def _leased(conn: Connection, ids: list[str]) -> frozenset[str]:
    found: set[str] = set()
    for start in range(0, len(ids), _LEASED_PER_QUERY):
        part = ids[start : start + _LEASED_PER_QUERY]
        found.update(conn.execute(_LEASED, {"ids": part}).scalars())
    return frozenset(found)


def _inputs(
    conn: Connection,
) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any], Sequence[Any], frozenset[str]]:
    running = conn.execute(_RUNNING).all()
    return (
        conn.execute(_LANES).all(),
        conn.execute(_RATES).all(),
        running,
        conn.execute(_ENGINES).all(),
        _leased(conn, _shared(running)),
    )


def wait_from_row(code: str | None, since: int | None, detail: Any) -> LaneWait | None:
    """A lane's stored wait (its ``waiting_*`` columns); None when it has none."""
    if code is None:
        return None
    # The facts are the dataclass's own fields: a key an older row lacks takes its default.
    return LaneWait(WaitCode(code), int(since or 0), **(detail or {}))


# A wait's own columns; the rest of its fields go in ``waiting_detail``.
_KEYS = frozenset({"code", "since"})


def _wait_values(wait: LaneWait | None) -> dict[str, Any]:
    if wait is None:
        return {"l_wait": None, "l_wait_since": None, "l_wait_detail": None}
    detail = {f.name: getattr(wait, f.name) for f in fields(wait) if f.name not in _KEYS}
    return {"l_wait": wait.code.value, "l_wait_since": wait.since, "l_wait_detail": detail}


def _lane_load(row: Any) -> LaneLoad:
    claimable = has_claimable_work(int(row.ready), bool(row.metered), int(row.balance))
    return LaneLoad(
        model=row.model,
        org_id=row.org_id,
        served=int(row.served),
        served_mark=int(row.served_mark),
        ready=claimable,
        urgent_by=int(row.urgent_by),
        share=float(row.share),
        vtime=float(row.vtime),
        weight=int(row.weight),
        # Lines ready that no claim may take: the credit gate holds them.
        gated=int(row.ready) > 0 and not claimable,
        balance=int(row.balance),
        gpu_count=int(row.gpu_count or 0),
        gpu_price=int(row.microusd_per_gpu_second or 0),
        wait=wait_from_row(row.waiting_code, row.waiting_since, row.waiting_detail),
    )


class PlanningQueries(SqlBase):
    async def plan_inputs(self) -> PlanInputs:
        # One trip on SQLite: every worker's planner reads these every few seconds, busy or not.
        lanes, rates, running, engines, leased = await self.in_one_trip(
            "reading the planner's inputs", _inputs
        )
        return PlanInputs(
            lanes=[_lane_load(row) for row in lanes],
            rates=[
                ModelRate(
                    row.model,
                    row.rps,
                    row.observed_at,
                    int(row.served),
                    bool(row.busy),
                    int(row.replicas),
                    row.rps_per_replica,
                )
                for row in rates
            ],
            running=[
                RunningBatch(
                    id=row.id,
                    model=row.model,
                    org_id=row.org_id,
                    weight=int(row.weight),
                    remaining=max(0, int(row.remaining)),
                    created_at=int(row.created_at),
                    expires_at=int(row.expires_at),
                    estimate=row.estimated_completion_at,
                    priority=int(row.priority),
                    urgent=bool(row.urgent),
                    paused=row.paused_at is not None,
                )
                for row in running
            ],
            engines=[report_from_row(row) for row in engines],
            leased=leased,
        )

    async def apply_plan(self, plan: Plan) -> None:
        b, ln, r = t.batches, t.lanes, t.model_rates
        async with self.writing("storing a plan") as conn:
            # Batches, then lanes, each in key order: the lock order of claims.py.
            if plan.estimates:
                await conn.execute(
                    update(b)
                    .where(b.c.id == bindparam("b_id"), b.c.status == BatchStatus.IN_PROGRESS)
                    .values(estimated_completion_at=bindparam("b_eta")),
                    [{"b_id": k, "b_eta": v} for k, v in sorted(plan.estimates.items())],
                )
            # Batches and their chunks (before lanes): what the plan rescues, or no longer must.
            await rescue(conn, plan.urgent, plan.calm)
            if plan.lanes:
                await conn.execute(
                    update(ln)
                    .where(ln.c.model == bindparam("l_model"), ln.c.org_id == bindparam("l_org"))
                    .values(
                        served_mark=bindparam("l_mark"),
                        share=bindparam("l_share"),
                        urgent_by=bindparam("l_urgent"),
                        # Relative: claims made since the plan read the lane still count.
                        vtime=ln.c.vtime - bindparam("l_forgiven"),
                        waiting_code=bindparam("l_wait"),
                        waiting_since=bindparam("l_wait_since"),
                        waiting_detail=bindparam("l_wait_detail"),
                    ),
                    [
                        {
                            "l_model": lane.model,
                            "l_org": lane.org_id,
                            "l_mark": lane.served_mark,
                            "l_share": lane.share,
                            "l_urgent": lane.urgent_by,
                            "l_forgiven": lane.forgiven,
                            **_wait_values(lane.wait),
                        }
                        for lane in sorted(plan.lanes, key=lambda x: (x.model, x.org_id))
                    ],
                )
            for rate in plan.rates:
                # A plan made earlier (by a planner that lost its lease) never overwrites a
                # later measurement.
                await conn.execute(
                    self.dialect.upsert(
                        r,
                        {
                            "model": rate.model,
                            "rps": rate.rps,
                            "observed_at": rate.observed_at,
                            "served": rate.served,
                            "busy": rate.busy,
                            "replicas": rate.replicas,
                            "rps_per_replica": rate.per_replica,
                        },
                        key=[r.c.model],
                        replace=[
                            "rps",
                            "observed_at",
                            "served",
                            "busy",
                            "replicas",
                            "rps_per_replica",
                        ],
                        where=r.c.observed_at < rate.observed_at,
                    )
                )

    async def lane_waits(self) -> dict[tuple[str, str], LaneWait]:
        ln = t.lanes
        # A lane per (model, org): a small table, read whole for the few rows with a wait.
        query = select(
            ln.c.model,
            ln.c.org_id,
            ln.c.served,
            ln.c.waiting_code,
            ln.c.waiting_since,
            ln.c.waiting_detail,
        ).where(ln.c.waiting_code.is_not(None))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        waits: dict[tuple[str, str], LaneWait] = {}
        for row in rows:
            wait = wait_from_row(row.waiting_code, row.waiting_since, row.waiting_detail)
            # A lane claimed from since its wait was found moves: the wait is over.
            if wait is not None and wait.holds(int(row.served)):
                waits[(row.model, row.org_id)] = wait
        return waits

    async def dispatch_shares(self) -> list[DispatchShare]:
        ln, o = t.lanes, t.orgs
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(ln.c.model, o.c.name, ln.c.share)
                    .join_from(ln, o, o.c.id == ln.c.org_id)
                    .where(ln.c.share > 0)
                    .order_by(ln.c.model, o.c.name)
                )
            ).all()
        return [DispatchShare(row.model, row.name, float(row.share)) for row in rows]
