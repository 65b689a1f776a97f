"""The worker loop: claim, dispatch, retry, and drive batches to their terminal state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from backfill.domain import ids
from backfill.domain.catalog import Billing, CatalogModel
from backfill.domain.input_format import request_body
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord, ClaimedItem, ItemResult, WorkBatch
from backfill.domain.results import ERROR_MESSAGES, error_row, http_error_row, success_row
from backfill.metrics import Metrics
from backfill.ports import (
    BlobStore,
    Catalog,
    Clock,
    EngineTimeout,
    EngineUnreachable,
    Sealer,
    Store,
)
from backfill.runner.engines import EnginePool, EngineSlot, Queued
from backfill.runner.failures import WorkerFailures, is_permanent
from backfill.runner.finalize import Finalizer, result_context
from backfill.runner.gpu_meter import GpuMeter
from backfill.runner.inputs import ClaimInput
from backfill.runner.replies import json_or_text, usage_of
from backfill.runner.results import ResultWriter
from backfill.runner.retry import backoff_s, is_transient
from backfill.runner.validating import ValidatingTakeover
from backfill.services.batches import BatchStarter
from backfill.services.files import FileService
from backfill.services.retention import Janitor

log = logging.getLogger("backfill.runner")

REPEATED_FAILURE = (
    "This request failed repeatedly inside Backfill (not at the engine) and was given up so "
    "its batch could finish; submit it again."
)


# A finalize that failed (storage, the database) is tried again after this long.
_REFINALIZE_S = 5.0


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    lease_s: float = 60.0
    max_attempts: int = 5
    retry_base_s: float = 0.5
    retry_max_s: float = 30.0
    poll_interval_s: float = 0.05
    result_flush_s: float = 0.02
    lifecycle_interval_s: float = 0.2
    gpu_time_flush_s: float = 1.0
    janitor_interval_s: float = 60.0
    output_ttl_s: int = 7 * 24 * 3600
    dispatch_gather_s: float = 0.005
    # Only a worker that is alone on its database may take back every lease at start.
    sole_worker: bool = False
    # A batch still ``validating`` this long after its creation is started by the lifecycle:
    # the process that created it met a fault and may be gone (or serve the API only).
    validating_grace_s: float = 30.0
    validating_retry_max_s: float = 60.0


@dataclass(slots=True)
class _Outcome:
    ok: bool
    row: bytes
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    request_id: str | None = None


class Worker:
    def __init__(
        self,
        store: Store,
        blobs: BlobStore,
        sealer: Sealer,
        files: FileService,
        pool: EnginePool,
        freed: asyncio.Event,
        clock: Clock,
        config: WorkerConfig,
        catalog: Catalog,
        metrics: Metrics | None = None,
    ) -> None:
        self._store = store
        self._catalog = catalog
        self._metrics = metrics or Metrics()
        self._meter = GpuMeter(clock)
        self._janitor = Janitor(store, files, clock)
        self._blobs = blobs
        self._sealer = sealer
        self._pool = pool
        self._freed = freed
        self._clock = clock
        self._config = config
        self._token = ids.lease_token()
        self._results = ResultWriter(store, config.result_flush_s, self._metrics)
        self._finalizer = Finalizer(store, blobs, sealer, clock, config.output_ttl_s)
        self._tasks: dict[str, set[asyncio.Task[None]]] = defaultdict(set)
        # Items whose task runs now, by batch: the heartbeat renews these leases and no others.
        self._running: dict[str, set[int]] = defaultdict(set)
        # Leases whose release failed (the database was down): retried by the heartbeat.
        self._unreleased: dict[tuple[str, int], float | None] = {}
        self._failures = WorkerFailures(
            config.retry_base_s, config.retry_max_s, give_up_after=config.max_attempts
        )
        self._loops: list[asyncio.Task[None]] = []
        self._rng = random.Random()
        self._background: set[asyncio.Task[None]] = set()
        # Finalizes (and expiries) running now, by batch: off the lifecycle loop, so a big one
        # does not hold up the others' cancels and deadlines.
        self._finalizing: dict[str, asyncio.Task[None]] = {}
        self._finalize_after: dict[str, float] = {}
        self._stopping = asyncio.Event()
        # Orgs whose GPU-time batches wait for credit (SPEC §7.4).
        self._paused_orgs: set[str] = set()
        self._deployments: dict[str, CatalogModel | None] = {}
        self._validating = ValidatingTakeover(
            store,
            BatchStarter(store, files, clock),
            self._finalizer,
            grace_s=config.validating_grace_s,
            retry_base_s=config.retry_base_s,
            retry_max_s=config.validating_retry_max_s,
            on_started=self.note_created,
        )

    async def start(self) -> None:
        if self._config.sole_worker:
            await self._store.release_all_leases()
        self._results.start()
        self._pool.start()
        for name, loop in (
            ("dispatch", self._dispatch_loop),
            ("lifecycle", self._lifecycle_loop),
            ("leases", self._lease_loop),
        ):
            self._loops.append(asyncio.create_task(self._guard(name, loop), name=name))

    async def stop(self) -> None:
        # Loops finish the statement they are in: a statement cut short by cancellation can
        # leave SQLite locked for the next process on the same data directory.
        self._stopping.set()
        self._freed.set()
        busy = [*self._loops, *self._validating.tasks, *self._finalizing.values()]
        _, late = await asyncio.wait(busy, timeout=10) if busy else (set(), set())
        for task in late:
            task.cancel()
        running = [t for tasks in self._tasks.values() for t in tasks]
        for task in running:
            task.cancel()
        await asyncio.gather(*busy, *running, return_exceptions=True)
        for slot in self._pool.slots:
            self._drop_backlog(slot, lambda _batch: True)
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._results.stop()
        await self.charge_gpu_time()
        await self._pool.stop()

    def observe(self) -> None:
        """Refresh the gauges the worker alone knows (scraped with /metrics)."""
        for slot in self._pool.slots:
            self._metrics.in_flight.labels(slot.engine.name).set(slot.in_flight)

    def engine_status(self) -> list[dict[str, Any]]:
        return [
            {
                "id": slot.engine.name,
                "healthy": slot.healthy,
                "in_flight": slot.in_flight,
                "max_concurrency": slot.engine.max_concurrency,
            }
            for slot in self._pool.slots
        ]

    async def charge_gpu_time(self) -> None:
        charged = set()
        for receipt in self._meter.take():
            await self._store.charge_gpu_time(receipt)
            charged.add(receipt.org_id)
        if charged:
            balances = await self._store.balances(sorted(charged))
            self._paused_orgs |= {org for org, balance in balances.items() if balance <= 0}

    async def _guard(self, name: str, loop: Any) -> None:
        """Keep a loop alive through unexpected errors (the database may blip)."""
        while not self._stopping.is_set():
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker %s loop failed; restarting it", name)
                await self._pause(1.0)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the worker stops."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    # ---- dispatch -------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while not self._stopping.is_set():
            self._freed.clear()
            if await self.dispatch_once():
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), self._config.poll_interval_s * 4)
            if self._freed.is_set():
                # Let slots that free up together be refilled by one claim, not one each.
                await asyncio.sleep(self._config.dispatch_gather_s)

    async def dispatch_once(self) -> int:
        """Claim for each engine that wants work. The claim chooses what runs next (fair
        across orgs, earliest deadline first), so the worker never lists batches.

        A few more items than free slots are claimed into the slot's backlog, so a request that
        ends is followed at once by the next, without waiting for a claim round trip.
        """
        if self._paused_orgs:
            # Credit added since lets a paused org run again (claims already skip an org
            # without credit; this set drops what was claimed before its credit ran out).
            balances = await self._store.balances(sorted(self._paused_orgs))
            self._paused_orgs = {org for org, balance in balances.items() if balance <= 0}
        claimed = 0
        for slot in self._pool.slots:
            if slot.wanted < slot.claim_threshold:
                continue
            now = self._clock.now()
            claims = await self._store.claim(
                slot.engine.models, slot.wanted, self._token, now + self._config.lease_s, now
            )
            for claim in claims:
                read = ClaimInput(self._blobs, claim)
                slot.backlog.extend(Queued(claim.batch, item, read) for item in claim.items)
                claimed += len(claim.items)
            self._start_backlog(slot)
        return claimed

    def _start_backlog(self, slot: EngineSlot) -> None:
        if self._paused_orgs:
            self._drop_backlog(slot, self._is_paused)
        while slot.free > 0 and slot.backlog:
            queued = slot.backlog.popleft()
            slot.in_flight += 1
            self._spawn(slot, queued)

    def _is_paused(self, batch: WorkBatch) -> bool:
        return batch.billing == Billing.GPU_TIME and batch.org_id in self._paused_orgs

    def _drop_backlog(self, slot: EngineSlot, stop: Callable[[WorkBatch], bool]) -> None:
        """Give back claimed, unstarted items of batches that must not start more work."""
        keep: deque[Queued] = deque()
        for queued in slot.backlog:
            if stop(queued.batch):
                release = self._release(queued.batch.id, queued.item.idx, None)
                task = asyncio.create_task(release)
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                keep.append(queued)
        slot.backlog = keep

    def note_created(self, _batch_id: str) -> None:
        """Called when a batch is created in this process: look for work now."""
        self._freed.set()

    def stop_starting(self, batch_id: str) -> None:
        """Called when a batch is cancelled in this process: nothing of it starts any more."""
        for slot in self._pool.slots:
            self._drop_backlog(slot, lambda other: other.id == batch_id)

    def _spawn(self, slot: EngineSlot, queued: Queued) -> None:
        batch, item = queued.batch, queued.item
        task = asyncio.create_task(self._run_item(slot, queued))
        tasks = self._tasks[batch.id]
        tasks.add(task)
        running = self._running[batch.id]
        running.add(item.idx)

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            running.discard(item.idx)
            if not running and self._running.get(batch.id) is running:
                del self._running[batch.id]

        task.add_done_callback(done)

    async def _deployment(self, model: str) -> CatalogModel | None:
        """The private deployment a GPU-time batch runs on, read from the catalog once."""
        if model not in self._deployments:
            self._deployments[model] = await self._catalog.find(model)
        return self._deployments[model]

    async def _run_item(self, slot: EngineSlot, queued: Queued) -> None:
        batch, item = queued.batch, queued.item
        released = False
        metered: CatalogModel | None = None

        def release_slot() -> None:
            nonlocal released
            if not released:
                released = True
                self._pool.release(slot)

        # Whether a failure can be this request's own doing: not before its input is read.
        own = False
        try:
            # The deployment is read from the catalog inside the guarded path: a database
            # error there must give the slot and the lease back like any other failure.
            if batch.billing == Billing.GPU_TIME:
                metered = await self._deployment(batch.model)
                if metered is not None:
                    self._meter.begin(metered, batch.org_id)
            try:
                raw = await queued.input.line(item)
            except Exception as exc:
                if not is_permanent(exc):
                    raise
                # The input is gone, damaged or sealed under another key: retrying cannot
                # help, so the request ends with an error row and the batch can finish.
                self._failures.permanent(batch.id, item.idx, exc)
                outcome: _Outcome | None = _Outcome(
                    False,
                    error_row(
                        item.custom_id, "input_unavailable", ERROR_MESSAGES["input_unavailable"]
                    ),
                )
            else:
                own = True
                outcome = await self._attempts(slot, batch, item, request_body(raw))
            release_slot()
            self._start_backlog(slot)
            if outcome is None:  # the engine went away: back to the queue, no attempt counted
                await self._release(batch.id, item.idx, None)
                return
            await self._put_outcome(batch, item, outcome)
            self._failures.succeeded(batch.id, item.idx)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Storage or the database failed (or a bug): the request goes back to the queue,
            # not before a backoff, so a lasting cause is not retried in a hot loop.
            release_slot()
            self._start_backlog(slot)
            delay = self._failures.transient(batch.id, item.idx, exc, own=own)
            if delay is None:
                if await self._give_up(batch, item):
                    return
                delay = self._config.retry_max_s
            await self._release(batch.id, item.idx, self._clock.now() + delay)
        finally:
            release_slot()
            if metered is not None:
                self._meter.end(metered.id)

    async def _give_up(self, batch: WorkBatch, item: ClaimedItem) -> bool:
        """End a request that keeps failing inside Backfill with an error row, so its batch
        can finish; False when even that cannot be stored (it is released and retried)."""
        row = error_row(item.custom_id, "internal_error", REPEATED_FAILURE)
        try:
            await self._put_outcome(batch, item, _Outcome(False, row))
        except Exception:
            return False
        return True

    async def _put_outcome(self, batch: WorkBatch, item: ClaimedItem, outcome: _Outcome) -> None:
        """Seal the request's row and store it durably (settling its charge)."""
        await self._results.put(
            ItemResult(
                batch_id=batch.id,
                idx=item.idx,
                lease_token=self._token,
                ok=outcome.ok,
                payload=self._sealer.seal(outcome.row, result_context(batch.id, item.idx)),
                input_tokens=outcome.input_tokens,
                output_tokens=outcome.output_tokens,
                cached_tokens=outcome.cached_tokens,
                request_id=outcome.request_id,
                custom_id=item.custom_id,
            )
        )

    async def _release(self, batch_id: str, idx: int, not_before: float | None) -> None:
        """Give a lease back; when the database refuses, the heartbeat tries again."""
        try:
            await self._store.release(batch_id, idx, self._token, not_before)
        except Exception:
            self._unreleased[(batch_id, idx)] = not_before

    async def _attempts(
        self, slot: EngineSlot, batch: WorkBatch, item: ClaimedItem, body: dict[str, Any]
    ) -> _Outcome | None:
        engine = slot.engine
        attempt = 0
        while True:
            attempt += 1
            retry_after: float | None = None
            started = time.monotonic()
            reason = "timeout"
            try:
                reply = await engine.send(batch.endpoint, batch.model, body)
            except EngineTimeout:
                final = _Outcome(
                    False,
                    error_row(item.custom_id, "request_timeout", ERROR_MESSAGES["request_timeout"]),
                )
            except EngineUnreachable:
                reason = "unreachable"
                if not await self._pool.check(slot):
                    return None
                final = _Outcome(
                    False,
                    error_row(
                        item.custom_id, "engine_unavailable", ERROR_MESSAGES["engine_unavailable"]
                    ),
                )
            else:
                self._metrics.latency.labels(engine.name).observe(time.monotonic() - started)
                reason = str(reply.status)
                if reply.status == 200:
                    return self._success(batch, item, reply.body)
                final = _Outcome(
                    False, http_error_row(item.custom_id, reply.status, json_or_text(reply.body))
                )
                if not is_transient(reply.status):
                    return final
                retry_after = reply.retry_after_s
            delay = backoff_s(
                attempt, self._config.retry_base_s, self._config.retry_max_s, retry_after, self._rng
            )
            if attempt >= self._config.max_attempts or (
                self._clock.now() + delay >= batch.expires_at
            ):
                return final
            self._metrics.retries.labels(engine.name, reason).inc()
            await asyncio.sleep(delay)

    def _success(self, batch: WorkBatch, item: ClaimedItem, raw: bytes) -> _Outcome:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _Outcome(
                False,
                http_error_row(
                    item.custom_id,
                    502,
                    {
                        "error": {
                            "message": "The engine answered 200 with a body that is not JSON.",
                            "type": "engine_error",
                        }
                    },
                ),
            )
        usage = usage_of(body)
        if isinstance(body, dict):
            body["model"] = batch.model
        request_id = ids.request_id()
        return _Outcome(
            True,
            success_row(item.custom_id, 200, body, request_id),
            input_tokens=usage[0],
            output_tokens=usage[1],
            cached_tokens=usage[2],
            request_id=request_id,
        )

    # ---- leases ---------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        while not self._stopping.is_set():
            await self._pause(self._config.lease_s / 3)
            await self.heartbeat()

    async def heartbeat(self) -> None:
        """Renew the leases this worker works on, and only those: a lease whose task ended
        without a result or a release runs out, so cancel and other workers never wait on it."""
        # Releases the database refused before; one that fails again waits for the next beat
        # and does not keep the live leases below from being renewed.
        pending, self._unreleased = self._unreleased, {}
        for (batch_id, idx), not_before in pending.items():
            await self._release(batch_id, idx, not_before)
        held: dict[str, set[int]] = defaultdict(set)
        for batch_id, running in self._running.items():
            held[batch_id] |= running
        for slot in self._pool.slots:
            for queued in slot.backlog:
                held[queued.batch.id].add(queued.item.idx)
        if held:
            await self._store.renew_leases(
                self._token, self._clock.now() + self._config.lease_s, held
            )

    # ---- lifecycle ------------------------------------------------------------------

    async def _lifecycle_loop(self) -> None:
        last_charge = last_sweep = self._clock.now()
        while not self._stopping.is_set():
            await self.lifecycle_once()
            self._failures.summarise()
            now = self._clock.now()
            if now - last_charge >= self._config.gpu_time_flush_s:
                last_charge = now
                await self.charge_gpu_time()
            if now - last_sweep >= self._config.janitor_interval_s:
                last_sweep = now
                await self._store.finish_drained(int(now))
                await self._janitor.sweep()
            await self._pause(self._config.lifecycle_interval_s)

    async def lifecycle_once(self) -> None:
        """One pass over the batches that need a decision; the finalizes it starts run in the
        background (one per batch here, and one across workers: the finalize lease)."""
        now = self._clock.now()
        await self._store.requeue_expired(now)
        for batch in await self._store.lifecycle_batches(now):
            status = BatchStatus(batch.status)
            if status == BatchStatus.VALIDATING:
                self._validating.see(batch, now)
                continue
            if batch.id in self._finalizing or time.monotonic() < self._finalize_after.get(
                batch.id, 0.0
            ):
                continue
            expired = status != BatchStatus.FINALIZING and now >= batch.expires_at
            if status == BatchStatus.CANCELLING or expired:
                self.stop_starting(batch.id)
            if expired:
                await self._abandon(batch.id)
                self._finalize(batch, status, BatchStatus.EXPIRED, closing="batch_expired")
            elif status == BatchStatus.CANCELLING:
                if not self._tasks.get(batch.id) and not await self._store.live_leases(
                    batch.id, now
                ):
                    self._finalize(batch, status, BatchStatus.CANCELLED, closing="batch_cancelled")
            elif status == BatchStatus.FINALIZING:
                self._finalize(batch, status, BatchStatus.COMPLETED)

    def _finalize(
        self,
        batch: BatchRecord,
        status: BatchStatus,
        terminal: BatchStatus,
        closing: str | None = None,
    ) -> None:
        async def close() -> None:
            if closing is not None:
                await self._store.close_unfinished(batch.id, closing)

        async def run() -> None:
            try:
                await self._finalizer.finalize(batch, status, terminal, before=close)
            except Exception:
                log.exception("finalizing %s failed; trying again in %ss", batch.id, _REFINALIZE_S)
                self._finalize_after[batch.id] = time.monotonic() + _REFINALIZE_S
            else:
                self._finalize_after.pop(batch.id, None)

        task = asyncio.create_task(run(), name=f"finalize-{batch.id}")
        self._finalizing[batch.id] = task
        task.add_done_callback(lambda _: self._finalizing.pop(batch.id, None))

    async def _abandon(self, batch_id: str) -> None:
        self._failures.forget(batch_id)
        tasks = list(self._tasks.pop(batch_id, ()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
