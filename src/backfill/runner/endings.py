"""How a request ends when it does not end at its engine's answer: its row sealed and stored,
or given up after failing repeatedly inside Backfill, or its line back in the queue after a
backoff."""

from __future__ import annotations

from backfill.domain.records import ClaimedItem, ItemResult, WorkBatch
from backfill.ports import Clock, Sealer
from backfill.runner.failures import WorkerFailures
from backfill.runner.group_commit import ResultWriter
from backfill.runner.leases import Leases
from backfill.runner.replies import Outcome, failed
from backfill.runner.slots import EngineSlot
from backfill.services.result_rows import result_context

REPEATED_FAILURE = (
    "This request failed repeatedly inside Backfill (not at the engine) and was given up so "
    "its batch could finish; submit it again."
)


class Endings:
    def __init__(
        self,
        results: ResultWriter,
        leases: Leases,
        failures: WorkerFailures,
        sealer: Sealer,
        clock: Clock,
        retry_max_s: float,
    ) -> None:
        self._results = results
        self._leases = leases
        self._failures = failures
        self._sealer = sealer
        self._clock = clock
        self._retry_max_s = retry_max_s

    async def back_to_queue(
        self, slot: EngineSlot, batch: WorkBatch, item: ClaimedItem, exc: Exception, *, own: bool
    ) -> None:
        """Storage or the database failed (or a bug): the request goes back to the queue, not
        before a backoff, so a lasting cause is not retried in a hot loop."""
        delay = self._failures.transient(batch.id, item.idx, exc, own=own)
        if delay is None:
            if await self._give_up(batch, item):
                return
            delay = self._retry_max_s
        await self._leases.release(batch.id, item.idx, self._clock.now() + delay)
        slot.wake_in(delay)

    async def _give_up(self, batch: WorkBatch, item: ClaimedItem) -> bool:
        """End a request that keeps failing inside Backfill with an error row, so its batch
        can finish; False when even that cannot be stored (it is released and retried)."""
        try:
            await self.put(batch, item, failed(item.custom_id, "internal_error", REPEATED_FAILURE))
        except Exception:
            return False
        return True

    async def put(self, batch: WorkBatch, item: ClaimedItem, outcome: Outcome) -> None:
        """Seal the request's row and store it durably (settling its charge)."""
        await self._results.put(
            ItemResult(
                batch_id=batch.id,
                idx=item.idx,
                lease_token=self._leases.token,
                ok=outcome.ok,
                payload=self._sealer.seal(outcome.row, result_context(batch.id, item.idx)),
                input_tokens=outcome.input_tokens,
                output_tokens=outcome.output_tokens,
                cached_tokens=outcome.cached_tokens,
                request_id=outcome.request_id,
                custom_id=item.custom_id,
                finished_at=self._clock.now(),
                billed=outcome.billed,
            )
        )
