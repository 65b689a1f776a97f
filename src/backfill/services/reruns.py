"""Rerunning an ended batch's failed lines, and deleting an ended batch (SPEC §4.8).

A rerun is a new batch made by ``BatchService.create``, as ``POST /v1/batches`` makes one: its
own idempotency key, reservation, admission checks and completion window. Its input is a new
input file, uploaded through the ordinary validating upload from the rerun input the finalizer
kept beside the error file (``domain/reruns.py``), so it has a line index and counts against
the org's retained input like any upload. A ``failed`` batch (it never ran) reruns all of its
lines from its original input, while that is still stored.
"""

from __future__ import annotations

import logging

import msgspec

from backfill.domain import audit
from backfill.domain.batch_request import CreateBatchRequest
from backfill.domain.files import FilePurpose, FileRecord, FileStatus
from backfill.domain.lifecycle import TERMINAL, BatchStatus
from backfill.domain.records import BatchRecord
from backfill.domain.reruns import RetryBatchRequest, rerun_creation, rerun_key
from backfill.errors import Conflict, ContentUnreadable, InvalidInput, NotFound
from backfill.ports import Clock, EndedBatchStore
from backfill.services.batches import MAX_IDEMPOTENCY_KEY, BatchService
from backfill.services.files import FileService

log = logging.getLogger("backfill.reruns")


def _not_ended(batch: BatchRecord, doing: str) -> Conflict:
    return Conflict(
        f"Batch {batch.id} is {batch.status}; only a batch that has ended can be {doing}. "
        f"Wait for it to end, or cancel it first (POST /v1/batches/{batch.id}/cancel).",
        code="batch_not_finished",
    )


class RerunService:
    def __init__(
        self,
        store: EndedBatchStore,
        batches: BatchService,
        files: FileService,
        clock: Clock,
    ) -> None:
        self._store = store
        self._batches = batches
        self._files = files
        self._clock = clock

    async def retry(
        self,
        org_id: str,
        batch_id: str,
        request: RetryBatchRequest,
        idempotency_key: str | None,
        request_hash: str,
        api_key_id: str | None = None,
    ) -> tuple[BatchRecord, bool]:
        """A new batch of ``batch_id``'s failed, expired and cancelled lines; and whether it
        is new (False on an idempotent replay, which uploads nothing). ``api_key_id``: the key
        that asks (its spend caps apply)."""
        if idempotency_key is not None:
            replayed = await self._replay(org_id, idempotency_key, request_hash)
            if replayed is not None:
                return replayed, False
        original = await self._batches.get(org_id, batch_id)
        if original.status not in TERMINAL:
            raise _not_ended(original, "rerun")
        uploaded: FileRecord | None = None
        if original.status == BatchStatus.FAILED:
            input_file_id = await self._original_input(original)
        else:
            # The input file prepares the rerun: its audit row commits with the new batch.
            with audit.aside():
                uploaded = await self._upload_rerun_input(original)
            input_file_id = uploaded.id
        body = rerun_creation(original, request, input_file_id, expanded=uploaded is not None)
        try:
            batch, new = await self._batches.create(
                org_id,
                msgspec.convert(body, CreateBatchRequest),
                idempotency_key,
                request_hash,
                retry_of=original.id,
                api_key_id=api_key_id,
            )
        except BaseException:
            if uploaded is not None:
                await self._discard(uploaded)
            raise
        if uploaded is not None and batch.input_file_id != uploaded.id:
            # A concurrent request with the same key made the rerun first: this upload is
            # nobody's input.
            await self._discard(uploaded)
        return batch, new

    async def delete(self, org_id: str, batch_id: str) -> str:
        """Delete an ended batch: its result files and rerun input (blobs, and file rows
        marked ``deleted``), its queue items and notifications; its receipts stay."""
        batch = await self._batches.get(org_id, batch_id)
        if batch.status not in TERMINAL:
            raise _not_ended(batch, "deleted")
        file_ids = await self._store.delete_batch(org_id, batch_id, int(self._clock.now()))
        if file_ids is None:
            # Deleted (or, impossibly, restarted) between the read and the delete.
            raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
        for file_id in file_ids:
            record = await self._files.store.get_file(org_id, file_id)
            if record is not None and record.status != FileStatus.DELETED:
                # A failure here leaves the file expired: the janitor removes it.
                await self._files.remove(record)
        return batch_id

    async def _replay(self, org_id: str, key: str, request_hash: str) -> BatchRecord | None:
        """The batch an earlier retry with ``key`` made, looked up before anything is
        uploaded; ``BatchService.create`` checks again, atomically, at creation."""
        if not 1 <= len(key.encode()) <= MAX_IDEMPOTENCY_KEY:
            raise InvalidInput(
                f"'Idempotency-Key' must be 1 to {MAX_IDEMPOTENCY_KEY} bytes.",
                code="invalid_value",
                param="Idempotency-Key",
            )
        existing = await self._store.batch_by_idempotency_key(org_id, key)
        if existing is None:
            return None
        if existing.request_hash != request_hash:
            raise Conflict(
                "This Idempotency-Key was already used for a different submission; use a new "
                "key for new work, or resend the original request unchanged.",
                code="idempotency_key_reused",
            )
        return existing

    async def _original_input(self, original: BatchRecord) -> str:
        if await self._files.find(original.org_id, original.input_file_id) is None:
            raise Conflict(
                f"Batch {original.id} failed before it ran, and its input file "
                f"{original.input_file_id} is no longer stored; upload the file again and "
                "create a new batch.",
                code="rerun_input_unavailable",
            )
        return original.input_file_id

    async def _upload_rerun_input(self, original: BatchRecord) -> FileRecord:
        if not original.failed or original.error_file_id is None:
            raise Conflict(
                f"Batch {original.id} has no failed, expired or cancelled requests: every "
                "request succeeded, so there is nothing to rerun.",
                code="nothing_to_rerun",
            )
        gone = Conflict(
            f"The requests of batch {original.id}'s failed lines are not stored: they are kept "
            f"as long as its error file {original.error_file_id}, which has expired or was "
            "deleted, or they could not be read from its input when it ended. Upload them "
            "again as a new file (`backfill batch run` writes them to FILE.retry.jsonl).",
            code="rerun_input_unavailable",
        )
        errors = await self._files.find(original.org_id, original.error_file_id)
        # Absent is normal (a batch that ended before reruns existed, or whose input could not
        # be read then): asked first, so it is not reported as damaged storage.
        if errors is None or not await self._files.blobs.exists(rerun_key(errors.id)):
            raise gone
        upload = await self._files.begin_upload(original.org_id)
        try:
            async for chunk in self._files.blobs.stream(rerun_key(errors.id)):
                await upload.feed(chunk)
            record = await upload.finish(FilePurpose.BATCH, None)
        except (ContentUnreadable, NotFound):
            await upload.abort()
            raise gone from None
        except InvalidInput as exc:
            await upload.abort()
            # The lines passed when they were uploaded; what changed since is the catalog.
            raise Conflict(
                f"The failed lines of batch {original.id} no longer pass validation "
                f"({exc.message}); fix them and upload them as a new file.",
                code="rerun_input_invalid",
            ) from None
        except BaseException:
            await upload.abort()
            raise
        if record.model != original.model:
            # The lines name their model by an alias that now means another model: a rerun
            # runs the lines that failed, on the model they failed on, or not at all.
            await self._discard(record)
            raise Conflict(
                f"The failed lines of batch {original.id} ran on model {original.model!r}, but "
                f"the name they use now means model {record.model!r} (an alias moved since); "
                "upload them as a new file to run them on that model.",
                code="rerun_input_invalid",
            )
        return record

    async def _discard(self, record: FileRecord) -> None:
        """Remove an uploaded rerun input no batch uses; best effort (it expires anyway)."""
        try:
            await self._files.remove(record)
        except Exception:
            log.warning("could not remove the unused rerun input %s; it expires", record.id)
