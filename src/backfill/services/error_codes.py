"""How many of a batch's lines failed, by error code, counted from its stored results.

The codes live inside the sealed rows (an engine's HTTP error keeps its status and body), so
the failed rows are opened and read. Only failed rows: the store picks them by their clear
``outcome``, so a batch of a million successes costs no decryption at all. Up to a bound: a
summary for a person, never an unbounded read on each look.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from backfill.domain.lifecycle import TERMINAL
from backfill.domain.records import BatchRecord, StoredResult
from backfill.errors import NotFound
from backfill.ports import BatchStore, FileStore, OverviewStore, Sealer
from backfill.services.files import FileService
from backfill.services.result_rows import render
from backfill.services.results import refuse_removed

MAX_FAILED_ROWS = 100_000
# Failed rows read (and held) per query: error rows are small (a code and a message, or an
# engine's error body).
_CHUNK = 1_000


class ErrorCodeStore(BatchStore, FileStore, OverviewStore, Protocol):
    """The roles an error-code count uses."""


@dataclass(frozen=True, slots=True)
class ErrorCodes:
    counts: dict[str, int]
    """Error code → lines; an engine's HTTP error counts as ``http_<status>``."""
    read: int
    """Failed rows read (successful rows are never read)."""
    truncated: bool
    """The bound was reached while more failed rows were stored."""
    complete: bool
    """The batch is over and every failed row was read: these are the final counts."""


def error_code(row: Any) -> str | None:
    """The row's error code, or None for a successful row. A row's ``error`` decides: one
    with an answer kept beside its error (``output_schema_mismatch``, an answer that did not
    match its line's schema) counts by its error's code."""
    if not isinstance(row, dict):
        return "unreadable_row"
    error = row.get("error")
    if isinstance(error, dict):
        return str(error.get("code") or "error")
    response = row.get("response")
    status = response.get("status_code") if isinstance(response, dict) else None
    if status == 200:
        return None
    return f"http_{status}" if isinstance(status, int) else "error"


class ErrorCodeService:
    def __init__(self, store: ErrorCodeStore, sealer: Sealer, files: FileService) -> None:
        self._store = store
        self._sealer = sealer
        self._files = files

    async def count(
        self, org_id: str, batch_id: str, max_rows: int = MAX_FAILED_ROWS
    ) -> ErrorCodes:
        """The failed lines of the org's batch by code, from at most ``max_rows`` failed rows.
        NotFound and Gone as ``GET /v1/batches/{id}/results`` answers them."""
        # The status is read before the rows: a batch already over stores no more rows, so
        # finding it over here means the rows read next are all there will be.
        batch = await self._store.get_batch(org_id, batch_id)
        if batch is None:
            raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
        over = batch.status in TERMINAL
        if over:
            await refuse_removed(self._store, self._files, batch)
        counts: Counter[str] = Counter()
        read = 0
        after = -1
        while True:
            # One row past the bound says whether the bound cut the count short.
            want = min(_CHUNK, max_rows - read + 1)
            rows = await self._store.failed_results(org_id, batch.id, after, want)
            truncated = read + len(rows) > max_rows
            for result in rows[: max_rows - read]:
                counts[await self._code(batch, result)] += 1
            read = min(read + len(rows), max_rows)
            if rows:
                after = rows[-1].idx
            if truncated:
                return ErrorCodes(dict(counts.most_common()), read, True, False)
            if len(rows) < want:
                # A batch deleted while it was read lost rows under the count.
                if over and await self._store.get_batch(org_id, batch.id) is None:
                    raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
                return ErrorCodes(dict(counts.most_common()), read, False, over)

    async def _code(self, batch: BatchRecord, result: StoredResult) -> str:
        if result.payload is None and result.error_code is None:
            # Purged since the status was read: a result file is going (410, as results say).
            await refuse_removed(self._store, self._files, batch)
            return "unreadable_row"
        try:
            row = orjson.loads(render(self._sealer, batch.id, result))
        except Exception:
            # Damaged, or sealed under another key: counted, so one row cannot hide the rest.
            return "unreadable_row"
        return error_code(row) or "error"
