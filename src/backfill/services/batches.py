"""Batches API use cases: create, read, list, cancel (SPEC §4)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from backfill.domain import audit, batchrouter, ids
from backfill.domain.batch_request import CreateBatchRequest
from backfill.domain.chunks import chunked
from backfill.domain.durations import parse_duration
from backfill.domain.files import (
    FilePurpose,
    accepted_input_expiry,
    content_key,
    index_key,
)
from backfill.domain.lifecycle import TERMINAL, BatchStatus
from backfill.domain.money import worst_case
from backfill.domain.priority import check_priority
from backfill.domain.records import Admission, BatchRecord, Page
from backfill.domain.streams import read_ahead
from backfill.errors import BackfillError, Conflict, ContentUnreadable, InvalidInput, NotFound
from backfill.ports import BatchStore, Catalog, Clock
from backfill.services.engine_health import EngineHealth
from backfill.services.files import FileService

log = logging.getLogger("backfill.batches")

MAX_IDEMPOTENCY_KEY = 256
# A batch of more lines than this answers its creation ``validating`` and is queued in the
# background, moving to ``in_progress`` once every line is in: queueing a million lines takes
# seconds, and an answer that waits for it would make the client's timeout (or a proxy's)
# depend on the file's size. Smaller batches, the size hosted batch APIs allow, answer
# ``in_progress``.
ANSWER_EARLY_LINES = 50_000
# A creation interrupted by a passing storage or database fault is retried this often at most.
ENQUEUE_RETRY_MAX_S = 60.0


@dataclass(frozen=True, slots=True)
class OrgLimits:
    """Per-organization admission limits (SPEC §7.6)."""

    max_unfinished_batches: int = 4
    max_retained_input_bytes: int = 1024**3


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidInput:
    return InvalidInput(message, code=code, param=param)


def _unreadable(file_id: str, exc: BackfillError) -> ContentUnreadable:
    return ContentUnreadable(
        f"The input file {file_id} can no longer be read ({exc.message}); upload it again "
        "and create a new batch.",
        code="input_unavailable",
        param="input_file_id",
    )


class BatchStarter:
    """Turns a committed ``validating`` batch into queue items, then ``in_progress``. The API
    uses it at creation; the worker's lifecycle uses it for a batch nobody is starting (its
    creation met a fault and the process retrying it may be gone) and to expire one whose
    window ended before it started."""

    def __init__(self, store: BatchStore, files: FileService, clock: Clock) -> None:
        self._store = store
        self._files = files
        self._clock = clock
        # Batches this process is queueing now. The API's creation and the worker's takeover
        # share one starter, so a large file still being queued is not queued twice here.
        self._queuing: set[str] = set()
        self._stopping = False

    def stop(self) -> None:
        """Queueing in flight ends after the page it is storing, rather than being cancelled
        within its statement (which can strand a pooled connection or leave SQLite locked);
        its batch stays ``validating`` for the next start to finish."""
        self._stopping = True

    async def queue(self, batch: BatchRecord) -> bool:
        """One queue item per input line, safe to run again; False once the batch is no longer
        ``validating``, its input cannot be read at all (it is failed then), or this process
        is queueing it already. A passing storage or database fault is raised."""
        if batch.id in self._queuing or self._stopping:
            return False
        self._queuing.add(batch.id)
        try:
            return await self._queue(batch)
        finally:
            self._queuing.discard(batch.id)

    async def _queue(self, batch: BatchRecord) -> bool:
        try:
            pages = read_ahead(chunked(self._files.lines(batch.input_file_id)))
            async with contextlib.aclosing(pages):
                async for chunks in pages:
                    if self._stopping or not await self._store.add_items(batch.id, chunks):
                        return False
        except (ContentUnreadable, NotFound) as exc:
            await self.fail(batch, _unreadable(batch.input_file_id, exc))
            return False
        return True

    async def start(self, batch: BatchRecord) -> bool:
        """Queue the batch and move it to ``in_progress``; True when this call started it."""
        if not await self.queue(batch):
            return False
        return await self._store.transition(
            batch.id, [BatchStatus.VALIDATING], BatchStatus.IN_PROGRESS, int(self._clock.now())
        )

    async def fail(self, batch: BatchRecord, exc: BackfillError) -> None:
        log.warning("batch %s failed before it started: %s", batch.id, exc.message)
        error = {"code": exc.code, "message": exc.message, "param": exc.param, "line": None}
        await self._store.fail_batch(
            batch.id, BatchStatus.VALIDATING, int(self._clock.now()), [error]
        )


class BatchEvents(Protocol):
    """What an in-process worker wants to hear at once, rather than at its next poll."""

    def note_created(self, batch_id: str) -> None:
        """A batch started: look for work now."""
        ...

    def stop_starting(self, batch_id: str) -> None:
        """A batch is cancelling: start nothing more of it."""
        ...


class BatchService:
    def __init__(
        self,
        store: BatchStore,
        files: FileService,
        catalog: Catalog,
        clock: Clock,
        *,
        min_window_s: float,
        max_window_s: float,
        idempotency_required: bool = False,
        limits: OrgLimits | None = None,
        starter: BatchStarter | None = None,
        events: BatchEvents | None = None,
        deadline_admission: bool = True,
        webhook_refusal: Callable[[str], str | None] | None = None,
        health: EngineHealth | None = None,
    ) -> None:
        self._store = store
        self._files = files
        self._catalog = catalog
        self._clock = clock
        self._min_window_s = min_window_s
        self._max_window_s = max_window_s
        self._idempotency_required = idempotency_required
        self._limits = limits or OrgLimits()
        self._events = events
        self._deadline_admission = deadline_admission
        # Why a URL may not receive webhooks (None: it may); without one, none may.
        self._webhook_refusal = webhook_refusal
        # Sets a batch's ``waiting_on`` when something keeps it from moving (None: never).
        self._health = health
        # Creations that met a passing fault after the batch row was committed, by batch id.
        self._retries: dict[str, asyncio.Task[None]] = {}
        # Large batches being queued after their creation answered, by batch id.
        self._queuing: dict[str, asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()
        self.enqueue_retry_base_s = 1.0
        self.answer_early_lines = ANSWER_EARLY_LINES
        self._starter = starter or BatchStarter(store, files, clock)

    async def create(
        self,
        org_id: str,
        request: CreateBatchRequest,
        idempotency_key: str | None,
        request_hash: str,
        *,
        retry_of: str | None = None,
        api_key_id: str | None = None,
    ) -> tuple[BatchRecord, bool]:
        """Create a batch; returns it and whether it was new (False on an idempotent replay).
        ``request_hash`` tells a replay of the same submission from a reuse of its key;
        ``retry_of`` names the batch whose failed lines this one reruns; ``api_key_id`` the
        key that creates it (its spend caps apply)."""
        if idempotency_key is not None:
            if not 1 <= len(idempotency_key.encode()) <= MAX_IDEMPOTENCY_KEY:
                raise _bad(
                    f"'Idempotency-Key' must be 1 to {MAX_IDEMPOTENCY_KEY} bytes.",
                    "Idempotency-Key",
                )
            existing = await self._store.batch_by_idempotency_key(org_id, idempotency_key)
            if existing is not None:
                audit.note_target(existing.id)
                return self._replay(existing, request_hash), False
        elif self._idempotency_required:
            raise _bad(
                "This server requires an 'Idempotency-Key' header on batch creation; send a "
                "unique key per submission and reuse it when retrying.",
                "Idempotency-Key",
                code="missing_required_parameter",
            )
        batch, admission = await self._new_batch(
            org_id, request, idempotency_key, request_hash, api_key_id
        )
        batch.retry_of = retry_of
        # Nothing is committed (nor credit reserved) for input that cannot be read now.
        await self._check_readable(batch.input_file_id)
        try:
            await self._store.create_batch(batch, admission)
        except Conflict:
            if idempotency_key is None:
                raise
            existing = await self._store.batch_by_idempotency_key(org_id, idempotency_key)
            if existing is None:
                raise
            return self._replay(existing, request_hash), False
        await self._start(batch)
        return await self.get(org_id, batch.id), True

    async def _check_readable(self, file_id: str) -> None:
        """Open the input and its line index (headers and key check), before anything is
        committed; a retryable StorageError passes through as it is."""
        blobs = self._files.blobs
        try:
            await blobs.size(content_key(file_id))
            await blobs.size(index_key(file_id))
        except (ContentUnreadable, NotFound) as exc:
            raise _unreadable(file_id, exc) from None

    async def _start(self, batch: BatchRecord) -> None:
        """Enqueue a committed batch, a large one in the background (``ANSWER_EARLY_LINES``)."""
        if batch.total <= self.answer_early_lines:
            await self._enqueue(batch)
        elif batch.id not in self._queuing:
            task = asyncio.create_task(self._enqueue(batch), name=f"queue-{batch.id}")
            self._queuing[batch.id] = task
            task.add_done_callback(lambda _: self._queuing.pop(batch.id, None))

    async def _enqueue(self, batch: BatchRecord) -> None:
        """A permanent cause fails the batch (its credit goes back); a passing one leaves it
        ``validating`` and tries again in the background (and a worker's lifecycle takes it
        over should this process go away)."""
        try:
            started = await self._starter.start(batch)
        except Exception as exc:
            log.warning(
                "could not enqueue %s yet; retrying in the background", batch.id, exc_info=exc
            )
            self._retry_later(batch)
            return
        if started:
            self._started(batch.id)

    def _started(self, batch_id: str) -> None:
        if self._events is not None:
            self._events.note_created(batch_id)

    def _retry_later(self, batch: BatchRecord) -> None:
        if batch.id in self._retries or self._stopping.is_set():
            return
        task = asyncio.create_task(self._retry(batch), name=f"enqueue-{batch.id}")
        self._retries[batch.id] = task
        task.add_done_callback(lambda _: self._retries.pop(batch.id, None))

    async def _retry(self, batch: BatchRecord) -> None:
        """Until the batch starts, ends otherwise, or its window is over (the worker's
        lifecycle expires it then). Every step may meet the fault that brought it here, the
        status read included, so each round is guarded as a whole."""
        delay = self.enqueue_retry_base_s
        while self._clock.now() < batch.expires_at:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            delay = min(delay * 2, ENQUEUE_RETRY_MAX_S)
            try:
                current = await self._store.get_batch(None, batch.id)
                if current is None or current.status != BatchStatus.VALIDATING:
                    return  # cancelled or failed meanwhile, or started elsewhere
                if await self._starter.start(batch):
                    self._started(batch.id)
                return
            except Exception:
                # The first failure was logged with its traceback by _enqueue.
                log.debug("enqueue of %s failed again", batch.id, exc_info=True)

    async def stop(self) -> None:
        """Stop queueing and retrying: what is left stays ``validating``, and is resumed at the
        next start (``resume_interrupted``) or by a worker's lifecycle."""
        self._stopping.set()
        self._starter.stop()
        tasks = [*self._queuing.values(), *self._retries.values()]
        if tasks:
            await asyncio.wait(tasks)

    async def resume_interrupted(self) -> None:
        """Finish creations a crash interrupted between the batch row and its items."""
        for batch in await self._store.batches_in([BatchStatus.VALIDATING]):
            await self._start(batch)

    def _replay(self, existing: BatchRecord, request_hash: str) -> BatchRecord:
        if existing.request_hash != request_hash:
            raise Conflict(
                "This Idempotency-Key was already used for a different batch submission; use "
                "a new key for new work, or resend the original request unchanged.",
                code="idempotency_key_reused",
            )
        return existing

    async def _new_batch(
        self,
        org_id: str,
        request: CreateBatchRequest,
        idempotency_key: str | None,
        request_hash: str,
        api_key_id: str | None,
    ) -> tuple[BatchRecord, Admission]:
        file_id = request.input_file_id
        endpoint = request.endpoint
        window_text = request.completion_window
        try:
            window = parse_duration(window_text)
        except ValueError as exc:
            raise _bad(f"'completion_window': {exc}.", "completion_window") from None
        if not self._min_window_s <= window <= self._max_window_s:
            raise _bad(
                f"'completion_window' must be from {self._min_window_s / 3600:g}h to "
                f"{self._max_window_s / 3600:g}h (it is {window_text!r}).",
                "completion_window",
            )
        self._check_webhook_url(request.webhook_url)
        # An expired or deleted file is refused saying so (FileService.get).
        file = await self._files.get(org_id, file_id, param="input_file_id")
        if file.purpose != FilePurpose.BATCH:
            raise _bad(
                f"File {file_id} has purpose {file.purpose!r}; use a 'batch' file.", "input_file_id"
            )
        if file.endpoint != endpoint:
            raise _bad(
                f"'endpoint' is {endpoint!r} but the lines of {file_id} use {file.endpoint!r}.",
                "endpoint",
            )
        model = await self._catalog.find(file.model or "", org_id)
        if model is None or not model.batch:
            raise _bad(
                f"Model {file.model!r} is no longer available for batch.",
                "input_file_id",
                code="model_not_found",
            )
        now = self._clock.now()
        expiry = request.output_expires_after
        prices = None if model.private else model.prices
        terms = batchrouter.BatchTerms(
            created_at=int(now),
            window_end=int(now + window),
            revision=model.model_config_id,
            prices=prices,
            input_format=file.input_format,
        )
        try:
            # The BatchRouter deadline only ever shortens the window, so expiry, deadline
            # admission and the scheduler's urgency all follow it through expires_at.
            expires_at = batchrouter.expires_at(request.metadata, terms)
        except batchrouter.BatchRouterRefusal as exc:
            raise _bad(exc.message, exc.param, exc.code) from None
        reserve = (
            worst_case(prices, file.prompt_token_bound, file.max_output_tokens) if prices else 0
        )
        admission = Admission(
            reserve=reserve,
            require_positive_balance=model.private,
            max_unfinished=self._limits.max_unfinished_batches,
            max_retained_input_bytes=self._limits.max_retained_input_bytes,
            throughput_tokens_per_s=model.throughput_tokens_per_s,
            deadline_aware=self._deadline_admission,
            # Accepted input lives until its batch ends, and at most a day past its deadline.
            input_expires_at=accepted_input_expiry(expires_at),
            api_key_id=api_key_id,
        )
        batch_id = ids.batch_id()
        # The audit log's target, when a key's request makes the batch (domain/audit.py).
        audit.note_target(batch_id)
        return BatchRecord(
            id=batch_id,
            org_id=org_id,
            endpoint=endpoint,
            model=model.id,
            model_config_id=model.model_config_id,
            input_file_id=file_id,
            completion_window=window_text,
            status=BatchStatus.VALIDATING,
            created_at=terms.created_at,
            expires_at=expires_at,
            total=file.lines,
            metadata=request.metadata,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            billing=model.billing,
            price_input=prices.input if prices else None,
            price_cached_input=prices.cached_input if prices else None,
            price_output=prices.output if prices else None,
            output_token_bound=file.max_output_tokens,
            output_expires_after_s=expiry.seconds if expiry else None,
            webhook_url=request.webhook_url,
            priority=await self.checked_priority(org_id, request.priority),
            output_validation=request.output_validation,
        ), admission

    async def checked_priority(self, org_id: str, priority: object) -> int:
        """``priority`` if it is one the org's cap allows (every org may lower its own
        batches), or a 400 that says what is."""
        raising = isinstance(priority, int) and not isinstance(priority, bool) and priority > 0
        return check_priority(priority, await self._store.max_priority(org_id) if raising else 0)

    def _check_webhook_url(self, url: str | None) -> None:
        if url is None:
            return
        reason = (
            "this server sends no webhooks"
            if self._webhook_refusal is None
            else self._webhook_refusal(url)
        )
        if reason is not None:
            raise _bad(
                f"'webhook_url' must be an HTTPS URL on a public host: {reason}.", "webhook_url"
            )

    async def get(self, org_id: str, batch_id: str) -> BatchRecord:
        return await self.annotated(await self.found(org_id, batch_id))

    async def found(self, org_id: str, batch_id: str) -> BatchRecord:
        """The org's batch as stored, without what its engines and lanes say of it (404 when
        the org has none by that id)."""
        batch = await self._store.get_batch(org_id, batch_id)
        if batch is None:
            raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
        return batch

    async def annotated(self, batch: BatchRecord) -> BatchRecord:
        """The batch with why it waits, as every read of it shows."""
        return batch if self._health is None else await self._health.annotate(batch)

    async def list(self, org_id: str, after: str | None, limit: int) -> Page[BatchRecord]:
        if not 1 <= limit <= 100:
            raise _bad(f"'limit' must be from 1 to 100 (it is {limit}).", "limit")
        page = await self._store.list_batches(org_id, after, limit)
        return page if self._health is None else await self._health.annotate_page(page)

    async def cancel(self, org_id: str, batch_id: str) -> BatchRecord:
        batch = await self.get(org_id, batch_id)
        if batch.status in TERMINAL or batch.status == BatchStatus.CANCELLING:
            return batch
        await self._store.transition(
            batch_id,
            [BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS],
            BatchStatus.CANCELLING,
            int(self._clock.now()),
        )
        if self._events is not None:
            self._events.stop_starting(batch_id)
        return await self.get(org_id, batch_id)

    async def proposal(
        self, org_id: str, request: CreateBatchRequest, api_key_id: str | None = None
    ) -> tuple[BatchRecord, Admission]:
        """The batch and the admission terms ``create`` would hand the store for ``request``
        now, after the same checks (window, webhook, file, model, deadline, priority, readable
        input), with nothing written: what an estimate decides on (services/estimates.py)."""
        batch, admission = await self._new_batch(org_id, request, None, "", api_key_id)
        await self._check_readable(batch.input_file_id)
        return batch, admission
