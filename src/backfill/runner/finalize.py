"""Build a batch's output and error files from stored results and publish them (SPEC §9.7).

Every worker sees every batch that is ready to finalize; the batch's finalize lease makes one of
them do it. Each attempt writes its blobs under keys derived from its lease token, so an attempt
that lost its lease never touches what another published, and the next holder can find and
remove what an abandoned attempt left.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable

from opentelemetry import trace
from opentelemetry.trace import StatusCode

from backfill.domain import ids
from backfill.domain.files import FileRecord, content_key, output_record
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord
from backfill.domain.reruns import rerun_key
from backfill.domain.streams import read_ahead
from backfill.ports import BlobStore, BlobWriter, Clock, ResultStore, Sealer
from backfill.runner.rerun_input import RerunInput
from backfill.runner.spans import tracer
from backfill.services.result_rows import render

log = logging.getLogger("backfill.finalize")

_FLUSH_BYTES = 1024 * 1024
_KINDS = ("output", "error")


def result_file_id(batch_id: str, kind: str, attempt: str) -> str:
    """The file id of one attempt's ``kind`` file: derived, so the attempt's token alone finds
    its blobs again, and distinct per attempt, so no two attempts write the same key."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}:{attempt}".encode()).hexdigest()[:24]


class LeaseLost(Exception):
    """Another finalizer took over the batch: this attempt must not publish."""


class _Lease:
    """Renews a held finalize lease every third of its length until stopped."""

    def __init__(
        self,
        store: ResultStore,
        clock: Clock,
        batch_id: str,
        token: str,
        lease_s: float,
        until: float,
    ) -> None:
        self._store = store
        self._clock = clock
        self._batch_id = batch_id
        self._token = token
        self._lease_s = lease_s
        self._until = until
        self.lost = False

    def check(self) -> None:
        if self.lost:
            raise LeaseLost(self._batch_id)

    async def keep(self) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            until = self._clock.now() + self._lease_s
            try:
                held = await self._store.renew_finalize(self._batch_id, self._token, until)
            except Exception as exc:
                # A database hiccup: the lease is still ours until it runs out; try again.
                log.warning("could not renew the finalize lease of %s: %r", self._batch_id, exc)
                held = self._clock.now() < self._until
                until = self._until
            if not held:
                self.lost = True
                return
            self._until = until


class Finalizer:
    def __init__(
        self,
        store: ResultStore,
        blobs: BlobStore,
        sealer: Sealer,
        clock: Clock,
        output_ttl_s: int,
        lease_s: float,
    ) -> None:
        self._store = store
        self._blobs = blobs
        self._sealer = sealer
        self._clock = clock
        self._output_ttl_s = output_ttl_s
        self._lease_s = lease_s
        # Names this finalizer's attempts in the batch row and in their blob keys.
        self.token = ids.lease_token()
        # Batches this finalizer is working on: the token is the same for all its attempts, so
        # the lease alone would let two of its own calls finalize one batch at once.
        self._busy: set[str] = set()

    async def finalize(
        self,
        batch: BatchRecord,
        expected: BatchStatus,
        terminal: BatchStatus,
        *,
        before: Callable[[], Awaitable[object]] | None = None,
    ) -> bool:
        """Build and publish ``batch``'s files and move it from ``expected`` to ``terminal``.

        False at once when another finalizer holds the batch's lease (or it left
        ``expected``); ``before`` runs once the lease is held, before anything is read.
        """
        if batch.id in self._busy:
            return False
        self._busy.add(batch.id)
        try:
            return await self._attempt(batch, expected, terminal, before)
        finally:
            self._busy.discard(batch.id)

    async def _attempt(
        self,
        batch: BatchRecord,
        expected: BatchStatus,
        terminal: BatchStatus,
        before: Callable[[], Awaitable[object]] | None,
    ) -> bool:
        now = self._clock.now()
        until = now + self._lease_s
        taken = await self._store.take_finalize(batch.id, [expected], self.token, until, now)
        if not taken.taken:
            return False
        # A span only for the worker that holds the lease: every worker asks for every batch.
        with tracer.start_as_current_span(
            "batch.finalize", record_exception=False, set_status_on_exception=False
        ) as span:
            recording = span.is_recording()
            if recording:
                span.set_attributes(
                    {
                        "backfill.batch_id": batch.id,
                        "backfill.status": terminal.value,
                        "backfill.took_over": taken.previous not in (None, self.token),
                    }
                )
            try:
                published = await self._held(
                    batch, expected, terminal, before, taken.previous, until
                )
            except BaseException as exc:
                if recording:
                    span.set_status(StatusCode.ERROR, type(exc).__name__)
                raise
            if recording:
                span.set_attribute("backfill.published", published)
            return published

    async def _held(
        self,
        batch: BatchRecord,
        expected: BatchStatus,
        terminal: BatchStatus,
        before: Callable[[], Awaitable[object]] | None,
        previous: str | None,
        until: float,
    ) -> bool:
        """The attempt once its lease is held: write the files, publish them."""
        if previous is not None and previous != self.token:
            log.info("finalizing %s, taking over from an attempt whose lease ran out", batch.id)
            await self._discard(batch.id, previous)
        lease = _Lease(self._store, self._clock, batch.id, self.token, self._lease_s, until)
        keeper = asyncio.create_task(lease.keep())
        # Until publish is sent this attempt's blobs are nobody's: remove them if it stops.
        # Once it is sent they may be published (a lost reply), so they are left alone.
        unpublished = True
        try:
            if before is not None:
                await before()
            out_id = result_file_id(batch.id, "output", self.token)
            err_id = result_file_id(batch.id, "error", self.token)
            out_size, err_size = await self._write(batch, out_id, err_id, lease)
            if (span := trace.get_current_span()).is_recording():
                span.set_attributes(
                    {"backfill.output_bytes": out_size, "backfill.error_bytes": err_size}
                )
            lease.check()
            now_s = int(self._clock.now())
            unpublished = False
            published = await self._store.publish(
                batch.id,
                expected,
                terminal,
                now_s,
                self._record(batch, out_id, "output", out_size, now_s),
                self._record(batch, err_id, "error", err_size, now_s),
                token=self.token,
            )
            unpublished = not published
            return published
        except LeaseLost:
            log.warning("lost the finalize lease of %s to another worker; not publishing", batch.id)
            return False
        finally:
            keeper.cancel()
            # wait() neither raises the keeper's cancellation nor swallows one of this task.
            await asyncio.wait([keeper])
            if unpublished:
                await self._discard(batch.id, self.token)
                with contextlib.suppress(Exception):
                    # Others may start over at once instead of waiting for the lease to end.
                    await self._store.release_finalize(batch.id, self.token)

    async def _write(
        self, batch: BatchRecord, out_id: str, err_id: str, lease: _Lease
    ) -> tuple[int, int]:
        out = await self._blobs.writer(content_key(out_id))
        err = await self._blobs.writer(content_key(err_id))
        buffers = {True: bytearray(), False: bytearray()}
        writers: dict[bool, BlobWriter] = {True: out, False: err}
        # The failed lines' requests, kept for a rerun: the input goes soon after publish.
        rerun = RerunInput(self._blobs, content_key(batch.input_file_id), rerun_key(err_id))
        try:
            pages = read_ahead(self._store.iter_results(batch.id))
            async with contextlib.aclosing(pages):
                async for page in pages:
                    lease.check()
                    await rerun.add([(r.offset, r.length) for r in page if not r.ok])
                    for r in page:
                        buf = buffers[r.ok]
                        buf += render(self._sealer, batch.id, r)
                        buf += b"\n"
                        if len(buf) >= _FLUSH_BYTES:
                            await writers[r.ok].write(bytes(buf))
                            buf.clear()
            for ok, buf in buffers.items():
                if buf:
                    await writers[ok].write(bytes(buf))
            lease.check()
            sizes = await out.commit(), await err.commit()
            await rerun.commit()
            return sizes
        except BaseException:
            await out.abort()
            await err.abort()
            await rerun.abort()
            raise

    async def _discard(self, batch_id: str, attempt: str) -> None:
        """Remove an unpublished attempt's blobs; best effort (the files were never visible)."""
        error_id = result_file_id(batch_id, "error", attempt)
        keys = [content_key(result_file_id(batch_id, kind, attempt)) for kind in _KINDS]
        for key in [*keys, rerun_key(error_id)]:
            try:
                await self._blobs.delete(key)
            except Exception:
                log.warning("could not remove a blob of an abandoned finalize of %s", batch_id)

    def _record(
        self, batch: BatchRecord, file_id: str, kind: str, size: int, now: int
    ) -> FileRecord:
        ttl = batch.output_expires_after_s or self._output_ttl_s
        return output_record(file_id, batch.id, batch.org_id, kind, size, now, ttl)
