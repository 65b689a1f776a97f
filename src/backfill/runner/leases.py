"""The work-queue leases one worker holds: given back, retried when the database refused,
and renewed while their requests run or wait in a backlog."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from backfill.domain import ids
from backfill.ports import Clock, WorkQueue
from backfill.runner.inputs import Queued


class Leases:
    def __init__(self, queue: WorkQueue, clock: Clock, lease_s: float) -> None:
        self._queue = queue
        self._clock = clock
        self.lease_s = lease_s
        self.token = ids.lease_token()
        # Leases whose release failed (the database was down): retried by the next renewal.
        self._unreleased: dict[tuple[str, int], float | None] = {}
        self._releasing: set[asyncio.Task[None]] = set()

    def until(self) -> float:
        """When a lease taken or renewed now runs out."""
        return self._clock.now() + self.lease_s

    async def release(self, batch_id: str, idx: int, not_before: float | None) -> None:
        """Give a lease back; when the database refuses, the next renewal tries again."""
        try:
            await self._queue.release(batch_id, idx, self.token, not_before)
        except Exception:
            self._unreleased[(batch_id, idx)] = not_before

    def release_soon(self, dropped: Iterable[Queued], not_before: float | None = None) -> None:
        """Give back the leases of requests taken out of a backlog, without waiting."""
        for queued in dropped:
            task = asyncio.create_task(self.release(queued.batch.id, queued.item.idx, not_before))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def settle(self) -> None:
        """Wait for the releases ``release_soon`` started."""
        await asyncio.gather(*self._releasing, return_exceptions=True)

    async def release_all(self) -> None:
        """Take back every lease of the database: only for a worker alone on it."""
        await self._queue.release_all_leases()

    async def renew(self, held: Mapping[str, set[int]]) -> None:
        """Renew the leases of ``held`` (batch id → item indexes), and only those: a lease
        whose task ended without a result or a release runs out, so cancel and other workers
        never wait on it."""
        # Releases the database refused before; one that fails again waits for the next beat
        # and does not keep the live leases below from being renewed.
        pending, self._unreleased = self._unreleased, {}
        for (batch_id, idx), not_before in pending.items():
            await self.release(batch_id, idx, not_before)
        if held:
            await self._queue.renew_leases(self.token, self.until(), held)
