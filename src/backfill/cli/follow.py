"""Writes a batch's rows to the results and errors files while it runs, safe to kill.

Rows come from ``GET /v1/batches/{id}/results`` page by page. After each page both files are
flushed to disk, then the cursor is saved together with both files' lengths (one atomic
replace of the state file). A run that is killed at any moment resumes by cutting both files
back to the saved lengths and reading on from the saved cursor: no row is written twice and
none is lost.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx
import orjson

# The statuses that mean "read the published files instead": a server without the endpoint
# (404) or a batch whose stored rows were removed (410).
UNAVAILABLE = (404, 410)
PAGE_ROWS = 1000

Fetch = Callable[[str, dict[str, Any]], httpx.Response]
"""GET ``path`` with ``params``; retries passing faults and returns any other answer."""


def is_output(row: bytes) -> bool:
    """Whether a standard row belongs in the output file (a 200 answer) or the error file:
    the finalizer's split, read from the row itself."""
    parsed = orjson.loads(row)
    response = parsed.get("response") or {}
    return parsed.get("error") is None and response.get("status_code") == 200


class ResultFollower:
    def __init__(
        self,
        fetch: Fetch,
        batch_id: str,
        out: Path,
        errors: Path,
        saved: dict[str, Any] | None,
        save: Callable[[dict[str, Any]], None],
    ) -> None:
        """``saved``: what ``save`` was last given for this batch (None: nothing yet)."""
        self._fetch = fetch
        self._batch_id = batch_id
        self._out = out
        self._errors = errors
        self._save = save
        self.rows = 0
        self.complete = False
        self._cursor: str | None = None
        self._files: dict[bool, IO[bytes]] = {}
        self._resume(saved or {})

    def _resume(self, saved: dict[str, Any]) -> None:
        lengths = (saved.get("out_bytes", 0), saved.get("errors_bytes", 0))
        same_files = saved.get("out") == str(self._out) and saved.get("errors") == str(self._errors)
        intact = same_files and all(
            path.exists() and path.stat().st_size >= length
            for path, length in zip((self._out, self._errors), lengths, strict=True)
        )
        if not intact:
            # Files moved, shortened or never written: start both over from the first row.
            lengths, saved = (0, 0), {}
        self._cursor = saved.get("cursor")
        self.complete = bool(saved.get("complete"))
        self.rows = int(saved.get("rows", 0))
        # Whatever follows the saved lengths was written after the last saved cursor: it is
        # read again, so it goes.
        for ok, path, length in ((True, self._out, lengths[0]), (False, self._errors, lengths[1])):
            fh = path.open("ab")
            fh.truncate(length)
            fh.seek(0, os.SEEK_END)
            self._files[ok] = fh

    def catch_up(self) -> bool:
        """Append every row stored so far; False when the endpoint cannot serve this batch
        (then the published files are the way to the results)."""
        while not self.complete:
            response = self._fetch(
                f"/batches/{self._batch_id}/results",
                {"limit": PAGE_ROWS} | ({"after": self._cursor} if self._cursor else {}),
            )
            if response.status_code in UNAVAILABLE:
                return False
            rows = response.content.splitlines()
            for row in rows:
                self._files[is_output(row)].write(row + b"\n")
            self._cursor = response.headers["x-backfill-next-cursor"]
            self.complete = response.headers.get("x-backfill-complete") == "true"
            self.rows += len(rows)
            self._commit()
            if not rows:
                break
        return True

    def _commit(self) -> None:
        # The rows reach the disk before the cursor that says they were written.
        for fh in self._files.values():
            fh.flush()
            os.fsync(fh.fileno())
        self._save(
            {
                "cursor": self._cursor,
                "out": str(self._out),
                "errors": str(self._errors),
                "out_bytes": self._files[True].tell(),
                "errors_bytes": self._files[False].tell(),
                "rows": self.rows,
                "complete": self.complete,
            }
        )

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
