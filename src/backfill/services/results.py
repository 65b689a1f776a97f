"""Reading a batch's results while it runs (SPEC §4.8): standard rows, a resumable cursor.

The batch keeps OpenAI's shape (``output_file_id`` stays null until it ends); this is a second
way to the same rows. Every row is served once over all pages, and all pages together hold
exactly the rows of the output and error files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from backfill.domain.lifecycle import TERMINAL
from backfill.domain.progress import MAX_POINTS, BatchProgress
from backfill.domain.records import BatchRecord, StoredResult
from backfill.domain.result_cursor import START, UNNUMBERED, ResultCursor
from backfill.errors import ContentUnreadable, Gone, InvalidInput, NotFound
from backfill.ports import BatchStore, FileStore, ResultPages, Sealer
from backfill.services.files import FileService
from backfill.services.result_rows import render

MAX_LIMIT = 10_000
DEFAULT_LIMIT = 1_000
# A page ends after the row that takes it past this many bytes (or at ``limit`` rows).
_PAGE_BYTES = 8 * 1024 * 1024
# Stored payloads held at once while a page is built (each up to a whole answer).
_CHUNK = 100


class ResultReadStore(BatchStore, FileStore, ResultPages, Protocol):
    """The roles a results reader uses."""


@dataclass(frozen=True, slots=True)
class ResultsPage:
    rows: list[bytes]
    """Standard output and error rows, each without its newline."""
    next_cursor: str
    """Where the next page starts: pass it as ``after``; it is valid even when ``rows`` is
    empty (then it is the cursor that was given)."""
    complete: bool
    """The batch is over and every row has been served: no page after this one has rows."""
    status: str


def parse_cursor(after: str | None) -> ResultCursor:
    if after is None:
        return START
    try:
        return ResultCursor.decode(after)
    except ValueError:
        raise InvalidInput(
            "'after' is not a cursor of this endpoint; pass the x-backfill-next-cursor header "
            "of the previous page as it was, or leave 'after' out to start from the first row.",
            code="invalid_value",
            param="after",
        ) from None


class ResultService:
    def __init__(self, store: ResultReadStore, sealer: Sealer, files: FileService) -> None:
        self._store = store
        self._sealer = sealer
        self._files = files

    async def page(
        self, org_id: str, batch_id: str, after: str | None, limit: int = DEFAULT_LIMIT
    ) -> ResultsPage:
        """The rows stored after ``after`` (None: from the first), at most ``limit``."""
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidInput(
                f"'limit' must be from 1 to {MAX_LIMIT} (it is {limit}).",
                code="invalid_value",
                param="limit",
            )
        cursor = parse_cursor(after)
        # The status is read before the rows: a batch already over stores no more numbered
        # rows, so finding it over here means the rows read next are all there will be.
        batch = await self._store.get_batch(org_id, batch_id)
        if batch is None:
            raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
        over = batch.status in TERMINAL
        if over:
            await refuse_removed(self._store, self._files, batch)
        rows: list[bytes] = []
        size = 0
        position = cursor
        complete = False
        # Read in chunks and stop at a byte budget, so a page of large rows (embeddings, long
        # answers) holds one chunk of stored payloads and about _PAGE_BYTES of rows at most.
        while len(rows) < limit and size < _PAGE_BYTES:
            if not position.numbered and not over:
                break  # the unnumbered lines are read once the batch is over
            want = min(limit - len(rows), _CHUNK)
            # One more than wanted says whether the part has more rows stored already.
            got = await self._store.results_after(batch.id, position, want + 1)
            for paged in got[:want]:
                row = self._render(batch, paged.result)
                rows.append(row)
                size += len(row) + 1
                position = paged.next
                if size >= _PAGE_BYTES:
                    break
            if size >= _PAGE_BYTES or len(got) > want:
                continue
            if not position.numbered:
                # A batch deleted while this page was read lost rows under it: not complete.
                if await self._store.get_batch(org_id, batch.id) is None:
                    raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
                complete = True
                break
            if not over:
                break  # caught up with a running batch
            # Every numbered row is read and no more will come: the lines closed without a
            # result follow, in this page while it has room.
            position = UNNUMBERED
        return ResultsPage(rows, position.encode(), complete, batch.status)

    async def progress(self, org_id: str, batch_id: str) -> BatchProgress:
        """The batch's results stored over time (``GET /v1/batches/{id}/progress``)."""
        found = await self._store.progress_history(org_id, batch_id, MAX_POINTS)
        if found is None:
            raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
        return found

    def _render(self, batch: BatchRecord, result: StoredResult) -> bytes:
        if result.payload is None and result.error_code is None:
            # Purged between the status read and the row read: a result file is going.
            raise _removed(batch, batch.output_file_id)
        try:
            return render(self._sealer, batch.id, result)
        except Exception as exc:
            raise ContentUnreadable(
                f"The stored result of line {result.idx + 1} of batch {batch.id} cannot be "
                "opened (damaged, or sealed under another master key)."
            ) from exc


async def refuse_removed(store: FileStore, files: FileService, batch: BatchRecord) -> None:
    """410 once the ended batch's stored results were removed with one of its result files
    (removing either purges them); a batch that failed before it ran has none."""
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is None:
            continue
        record = await store.get_file(batch.org_id, file_id)
        # Past its expiry it reads as removed before the janitor sweeps it, as downloads do.
        if record is None or await files.removed(record):
            raise _removed(batch, file_id)


def _removed(batch: BatchRecord, file_id: str | None) -> Gone:
    return Gone(
        f"Batch {batch.id} ended and its stored results were removed together with its result "
        f"file {file_id} (it expired or was deleted); its rows can no longer be read here. "
        "Download its output and error files while they are kept.",
        code="results_removed",
    )
