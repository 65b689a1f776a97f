"""Running one claimed request: read its line, try its engine, seal and store its outcome, or
give its lease back; its engine slot is freed the moment the engine is done with it. A request
whose line holds remote images fetches them first, in the fetch pool, holding no slot."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from backfill.domain.catalog import Billing, CatalogModel
from backfill.domain.input_format import request_body
from backfill.domain.media import MediaLimits, may_hold_remote_images
from backfill.domain.records import ClaimedItem
from backfill.ports import Catalog, Clock, MediaFetcher, Sealer
from backfill.runner.attempts import Attempts
from backfill.runner.endings import Endings
from backfill.runner.failures import WorkerFailures, is_permanent
from backfill.runner.fetch_pool import FetchPool
from backfill.runner.gpu_meter import GpuMeter
from backfill.runner.group_commit import ResultWriter
from backfill.runner.inputs import Queued
from backfill.runner.leases import Leases
from backfill.runner.media import with_inline_images
from backfill.runner.replies import Outcome, failed
from backfill.runner.running import RunningRequests
from backfill.runner.slots import EngineSlot

# All of one line's images are fetched within this long, unless the worker is told otherwise.
FETCH_TOTAL_S = 60.0


class RequestRunner(RunningRequests):
    """Starts each request its slot hands over as a task, and each request the dispatcher
    sends to fetch its images first, and knows which run now, by batch: the lease renewal
    holds exactly those, cancel waits for them (or stops those still fetching), expiry
    abandons them."""

    def __init__(
        self,
        *,
        attempts: Attempts,
        results: ResultWriter,
        leases: Leases,
        failures: WorkerFailures,
        sealer: Sealer,
        meter: GpuMeter,
        catalog: Catalog,
        clock: Clock,
        retry_max_s: float,
        media: MediaFetcher | None = None,
        media_line_bytes: int = MediaLimits().line_bytes,
        fetches: FetchPool | None = None,
        fetch_total_s: float = FETCH_TOTAL_S,
    ) -> None:
        """``fetches``: where ``fetch_first`` fetches images (without it, they are fetched
        on the slot); ``fetch_total_s``: the most one line's images may take together."""
        self._media = media
        self._media_line_bytes = media_line_bytes
        self._fetches = fetches
        self._fetch_total_s = fetch_total_s
        self._attempts = attempts
        self._leases = leases
        self._failures = failures
        self._meter = meter
        self._catalog = catalog
        self._endings = Endings(results, leases, failures, sealer, clock, retry_max_s)
        self._deployments: dict[str, CatalogModel | None] = {}
        super().__init__()

    def start(self, slot: EngineSlot, queued: Queued) -> None:
        """Run ``queued`` on ``slot``, which already counts it in flight."""
        self._track(queued, asyncio.create_task(self._run(slot, queued)))

    def fetch_first(
        self,
        slot: EngineSlot,
        queued: Queued,
        body: dict[str, Any],
        then: Callable[[Queued], None],
    ) -> bool:
        """Fetch the remote images of ``queued`` (its line, decoded: ``body``) in the fetch
        pool, holding no engine slot; then hand it on, images inline, to ``then`` (which
        queues it for ``slot``), or store its error row when an image cannot be fetched.
        False when the pool is full: the caller gives the lease back."""
        pool = self._fetches
        if pool is None or not pool.admit():
            return False
        task = asyncio.create_task(self._fetch(pool, slot, queued, body, then))

        def ended(task: asyncio.Task[None]) -> None:
            # Here, not in the task: one cancelled before it ran must leave and release too.
            pool.leave()
            if task.cancelled():
                # The batch was cancelled or expired, or the worker stops: the line goes back
                # to the queue now, not when its lease runs out (a line whose row was stored
                # is not leased any more, and stays as it is).
                self._leases.release_soon([queued])

        task.add_done_callback(ended)
        self._track(queued, task, fetching=True)
        return True

    async def abandon(self, batch_id: str) -> None:
        """Cancel the batch's running requests and wait until they are gone."""
        self._failures.forget(batch_id)
        tasks = list(self._running.get(batch_id, ()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def stop_fetching(self, batch_id: str) -> None:
        """Cancel the batch's requests that still fetch images (it is being cancelled, and
        none of them reached an engine): their leases are given back, so the cancel need not
        wait for slow image hosts."""
        tasks = [task for task in self._running.get(batch_id, ()) if task in self._fetching]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._leases.settle()

    async def _deployment(self, model: str) -> CatalogModel | None:
        """The private deployment a GPU-time batch runs on, read from the catalog once."""
        if model not in self._deployments:
            self._deployments[model] = await self._catalog.find(model)
        return self._deployments[model]

    async def _run(self, slot: EngineSlot, queued: Queued) -> None:
        batch, item = queued.batch, queued.item
        freed = False
        metered: CatalogModel | None = None

        def free() -> None:
            nonlocal freed
            if not freed:
                freed = True
                slot.done()

        # Whether a failure can be this request's own doing: not before its input is read.
        own = queued.body is not None
        try:
            # The deployment is read from the catalog inside the guarded path: a database
            # error there must give the slot and the lease back like any other failure.
            deployment = None
            if batch.billing == Billing.GPU_TIME:
                deployment = await self._deployment(batch.model)
            ready: dict[str, Any] | Outcome
            if queued.body is not None:
                ready = queued.body
            else:
                try:
                    raw = await queued.input.line(item)
                except Exception as exc:
                    if not is_permanent(exc):
                        raise
                    # The input is gone, damaged or sealed under another key: retrying cannot
                    # help, so the request ends with an error row and the batch can finish.
                    self._failures.permanent(batch.id, item.idx, exc)
                    ready = failed(item.custom_id, "input_unavailable")
                else:
                    own = True
                    ready = await self._prepared(item, raw)
            if isinstance(ready, Outcome):
                outcome: Outcome | None = ready
            else:
                # GPU time counts from here: fetching images keeps the engine idle.
                if deployment is not None:
                    metered = deployment
                    self._meter.begin(metered, batch.org_id)
                outcome = await self._attempts.run(slot, batch, item, ready)
            free()
            if outcome is None:  # the engine went away: back to the queue, no attempt counted
                await self._leases.release(batch.id, item.idx, None)
                return
            await self._endings.put(batch, item, outcome)
            self._failures.succeeded(batch.id, item.idx)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            free()
            await self._endings.back_to_queue(slot, batch, item, exc, own=own)
        finally:
            free()
            if metered is not None:
                self._meter.end(metered.id)

    async def _fetch(
        self,
        pool: FetchPool,
        slot: EngineSlot,
        queued: Queued,
        body: dict[str, Any],
        then: Callable[[Queued], None],
    ) -> None:
        """``fetch_first``'s task: a fetch place, the images, then the slot's queue."""
        batch, item = queued.batch, queued.item
        try:
            async with pool.place:
                ready = await with_inline_images(
                    self._media,
                    item.custom_id,
                    body,
                    self._media_line_bytes,
                    total_s=self._fetch_total_s,
                )
            if isinstance(ready, Outcome):
                # Its error row, stored without ever taking an engine slot.
                await self._endings.put(batch, item, ready)
                self._failures.succeeded(batch.id, item.idx)
            else:
                then(dataclasses.replace(queued, body=ready))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._endings.back_to_queue(slot, batch, item, exc, own=True)

    async def _prepared(self, item: ClaimedItem, raw: bytes) -> dict[str, Any] | Outcome:
        """The body to send: the line's, with its remote images inline; or the error row its
        request ends with when an image cannot be fetched. Where the dispatcher hands lines
        with remote images to ``fetch_first``, only a line it could not read comes here
        undecoded, and reading it fails here again (one read serves a claim)."""
        body = request_body(raw)
        if not may_hold_remote_images(raw):
            return body
        return await with_inline_images(
            self._media, item.custom_id, body, self._media_line_bytes, total_s=self._fetch_total_s
        )
