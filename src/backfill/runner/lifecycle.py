"""Driving batches to their terminal state: requeue lapsed leases, then for each batch that
needs a decision start it (validating take-over), wait for its cancel, expire it, or finalize
it. Finalizes run in the background, one per batch here (and one across workers: the finalize
lease), so a big one does not hold up the others' cancels and deadlines."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord
from backfill.ports import BatchStore, Clock, WorkQueue
from backfill.runner.dispatch import Dispatcher
from backfill.runner.finalize import Finalizer
from backfill.runner.request import RequestRunner
from backfill.runner.validating import ValidatingTakeover

log = logging.getLogger("backfill.runner")

# A finalize that failed (storage, the database) is tried again after this long.
REFINALIZE_S = 5.0


class Lifecycle:
    def __init__(
        self,
        batches: BatchStore,
        queue: WorkQueue,
        finalizer: Finalizer,
        validating: ValidatingTakeover,
        dispatcher: Dispatcher,
        requests: RequestRunner,
        clock: Clock,
        on_ended: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_ended`` is told when a finalize here ended a batch (its notifications are due)."""
        self._on_ended = on_ended
        self._batches = batches
        self._queue = queue
        self._finalizer = finalizer
        self._validating = validating
        self._dispatcher = dispatcher
        self._requests = requests
        self._clock = clock
        # Finalizes (and expiries) running now, by batch, and when (by the machine's monotonic
        # time) one that failed may be tried again.
        self._finalizing: dict[str, asyncio.Task[None]] = {}
        self._finalize_after: dict[str, float] = {}

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """What runs in the background now: finalizes and validating take-overs."""
        return [*self._validating.tasks, *self._finalizing.values()]

    async def once(self) -> bool:
        """One pass over the batches that need a decision; whether it found any (or lapsed
        leases to requeue)."""
        now = self._clock.now()
        requeued = await self._queue.requeue_expired(now)
        if requeued:
            self._dispatcher.wake()
        batches = await self._batches.lifecycle_batches(now)
        for batch in batches:
            status = batch.status
            if status == BatchStatus.VALIDATING:
                self._validating.see(batch, now)
                continue
            if batch.id in self._finalizing or self._clock.monotonic() < self._finalize_after.get(
                batch.id, 0.0
            ):
                continue
            expired = status != BatchStatus.FINALIZING and now >= batch.expires_at
            if status == BatchStatus.CANCELLING or expired:
                self._dispatcher.stop_starting(batch.id)
            if expired:
                await self._requests.abandon(batch.id)
                self._finalize(batch, status, BatchStatus.EXPIRED, closing="batch_expired")
            elif status == BatchStatus.CANCELLING:
                # A cancel waits for the requests that run (here or in another worker), not
                # for those still fetching images: none of them reached an engine.
                await self._requests.stop_fetching(batch.id)
                if not self._requests.busy(batch.id) and not await self._queue.live_leases(
                    batch.id, now
                ):
                    self._finalize(batch, status, BatchStatus.CANCELLED, closing="batch_cancelled")
            elif status == BatchStatus.FINALIZING:
                self._finalize(batch, status, BatchStatus.COMPLETED)
        return bool(requeued or batches)

    def _finalize(
        self,
        batch: BatchRecord,
        status: BatchStatus,
        terminal: BatchStatus,
        closing: str | None = None,
    ) -> None:
        async def close() -> None:
            if closing is not None:
                await self._queue.close_unfinished(batch.id, closing)

        async def run() -> None:
            try:
                await self._finalizer.finalize(batch, status, terminal, before=close)
            except Exception:
                log.exception("finalizing %s failed; trying again in %ss", batch.id, REFINALIZE_S)
                self._finalize_after[batch.id] = self._clock.monotonic() + REFINALIZE_S
            else:
                self._finalize_after.pop(batch.id, None)
                self._on_ended()

        task = asyncio.create_task(run(), name=f"finalize-{batch.id}")
        self._finalizing[batch.id] = task
        task.add_done_callback(lambda _: self._finalizing.pop(batch.id, None))
