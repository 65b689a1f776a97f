"""The planner: every few seconds it measures each model's throughput, projects every running
batch's finish at its fair share, marks the lanes that must go first to meet a deadline, and
keeps each batch's ``estimated_completion_at`` current (SPEC §4.8, §9.4).

Every worker runs it; a singleton lease lets one process at a time plan for everyone, so a
model's rate is measured once per interval, not once per worker.
"""

from __future__ import annotations

from typing import Protocol

from backfill.domain import ids
from backfill.domain.scheduling.planning import Plan, plan
from backfill.ports import Clock, OperationsStore, WorkQueue

# The singleton lease the planning process holds.
PLANNER = "planner"
# Passes the lease outlives: another process takes over only from a planner that stopped.
_LEASE_PASSES = 3


class PlannerStore(WorkQueue, OperationsStore, Protocol):
    """The lanes and batches the planner reads and marks, and the lease it plans under."""


class Planner:
    def __init__(
        self, store: PlannerStore, clock: Clock, *, interval_s: float, margin_fraction: float
    ) -> None:
        self._store = store
        self._clock = clock
        self.interval_s = interval_s
        self._margin_fraction = margin_fraction
        self.holder = ids.lease_token()

    async def plan(self) -> Plan | None:
        """One pass; the plan it stored (empty: nothing to store), or None while another
        process holds the lease.

        The lease is taken only for a plan that stores something: an idle worker then plans
        with reads alone, no write (and no ``fsync``) every few seconds. A plan made from
        reads just before the lease is as good as one made just after: the lease changes
        hands only once it has lapsed, and a plan's lane updates are relative to claims made
        since its reads.
        """
        now = self._clock.now()
        made = plan(await self._store.plan_inputs(), now, self._margin_fraction)
        if made.empty:
            return made
        until = now + _LEASE_PASSES * self.interval_s
        if not await self._store.take_singleton(PLANNER, self.holder, until, now):
            return None
        await self._store.apply_plan(made)
        return made
