"""Group commit of per-request results: one short transaction for many results."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from backfill.domain.records import ItemResult
from backfill.metrics import Metrics
from backfill.ports import WorkQueue

log = logging.getLogger("backfill.runner")


class ResultWriter:
    """Collects results and writes them together; ``put`` returns once its result is durable."""

    def __init__(
        self,
        store: WorkQueue,
        flush_s: float,
        metrics: Metrics,
        on_finished: Callable[[frozenset[str]], None] = lambda _batch_ids: None,
        running: Callable[[], int] | None = None,
    ) -> None:
        self._store = store
        # How many requests run now, those waiting in ``put`` included (None: not known). The
        # composition root sets it once the request runner, which counts them, is built.
        self.running = running
        # Told the batches a write finished, so their finalize starts at once.
        self._on_finished = on_finished
        # Labelled children resolved once: this runs for every stored result.
        self._ok = metrics.results.labels("ok")
        self._failed = metrics.results.labels("error")
        self._tokens_in = metrics.tokens.labels("input")
        self._tokens_out = metrics.tokens.labels("output")
        self._flush_s = flush_s
        self._pending: list[tuple[ItemResult, asyncio.Future[bool]]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="result-writer")

    async def put(self, result: ItemResult) -> bool:
        """Store ``result``; False when its lease was lost (someone else owns the item now)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((result, future))
        self._wakeup.set()
        return await future

    async def _run(self) -> None:
        while not self._stopping:
            await self._wakeup.wait()
            if self._stopping:
                break  # stop() writes what is pending
            # A short pause lets results that finish together share one commit. When every
            # request that runs waits on this commit (a batch's last, or an engine's only one),
            # none would join it: it goes at once.
            if self.running is None or self.running() > len(self._pending):
                await asyncio.sleep(self._flush_s)
            self._wakeup.clear()
            await self.flush()

    async def flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            await self._write(batch)
        except Exception as exc:  # a failed commit must not lose the waiters
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)

    async def _write(self, batch: list[tuple[ItemResult, asyncio.Future[bool]]]) -> None:
        accepted = await self._store.write_results([r for r, _ in batch])
        if accepted.finished:
            self._on_finished(accepted.finished)
        # The counters move once per write, not per result: each move takes a lock.
        ok_results = failed = tokens_in = tokens_out = 0
        for (result, future), ok in zip(batch, accepted, strict=True):
            future.set_result(ok)
            if not ok:
                continue
            if result.ok:
                ok_results += 1
                tokens_in += result.input_tokens
                tokens_out += result.output_tokens
            else:
                failed += 1
        for counter, amount in (
            (self._ok, ok_results),
            (self._failed, failed),
            (self._tokens_in, tokens_in),
            (self._tokens_out, tokens_out),
        ):
            if amount:
                counter.inc(amount)

    async def stop(self) -> None:
        # The loop ends after the write it is in; cancelling it could cut a statement short.
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        await self.flush()
