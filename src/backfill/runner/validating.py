"""Batches left ``validating``: started by the worker when their creation stalled, expired when
their window ended first.

The process that creates a batch enqueues its lines; if it dies or storage fails for longer
than its retries, nobody else would, and the batch would hold its credit for ever. The worker
takes such a batch over after a grace period, in the background: enqueueing a large file must not
hold up the other batches' lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord
from backfill.ports import Clock, WorkQueue
from backfill.runner.finalize import Finalizer
from backfill.services.batches import BatchStarter

log = logging.getLogger("backfill.runner")


class ValidatingTakeover:
    def __init__(
        self,
        store: WorkQueue,
        starter: BatchStarter,
        finalizer: Finalizer,
        *,
        grace_s: float,
        retry_base_s: float,
        retry_max_s: float,
        on_started: Callable[[str], None],
        clock: Clock,
    ) -> None:
        self._clock = clock
        self._store = store
        self._starter = starter
        self._finalizer = finalizer
        self._grace_s = grace_s
        self._retry_base_s = retry_base_s
        self._retry_max_s = retry_max_s
        self._on_started = on_started
        # Batches being started or expired now, and when to try again (by the machine's
        # monotonic time) with the delay used last, for those that failed.
        self._running: dict[str, asyncio.Task[None]] = {}
        self._after: dict[str, tuple[float, float]] = {}

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._running.values())

    def see(self, batch: BatchRecord, now: float) -> None:
        """Called by the lifecycle for each ``validating`` batch."""
        expired = now >= batch.expires_at
        if batch.id in self._running:
            return
        if not expired and now - batch.created_at < self._grace_s:
            return  # the process that created it is most likely enqueueing it right now
        not_before, _ = self._after.get(batch.id, (float("-inf"), 0.0))
        if self._clock.monotonic() < not_before:
            return
        task = asyncio.create_task(self._start_or_expire(batch, expired))
        self._running[batch.id] = task
        task.add_done_callback(lambda _: self._running.pop(batch.id, None))

    async def _start_or_expire(self, batch: BatchRecord, expired: bool) -> None:
        try:
            if expired:
                # SPEC §4.6: every request of an expired batch gets its batch_expired row, so
                # the lines are queued first (as the creation would have) and then closed.
                if await self._starter.queue(batch):

                    async def close() -> None:
                        await self._store.close_unfinished(batch.id, "batch_expired")

                    await self._finalizer.finalize(
                        batch, BatchStatus.VALIDATING, BatchStatus.EXPIRED, before=close
                    )
            elif await self._starter.start(batch):
                log.info("started %s, which its creation had left validating", batch.id)
                self._on_started(batch.id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _, last = self._after.get(batch.id, (0.0, 0.0))
            delay = min(max(2 * last, self._retry_base_s), self._retry_max_s)
            self._after[batch.id] = (self._clock.monotonic() + delay, delay)
            if not last:
                log.warning(
                    "could not %s %s yet; trying again with backoff",
                    "expire" if expired else "start",
                    batch.id,
                    exc_info=exc,
                )
            return
        self._after.pop(batch.id, None)
