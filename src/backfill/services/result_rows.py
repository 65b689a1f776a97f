"""A stored result as its row of the output or error file (SPEC §6).

The finalizer writes these rows into the files and the results endpoint serves them while the
batch runs: both build them here, so a row read early is byte for byte the row of the file.
"""

from __future__ import annotations

import hashlib

from backfill.domain.records import StoredResult
from backfill.domain.results import ERROR_MESSAGES, error_row
from backfill.ports import Sealer


def result_context(batch_id: str, idx: int) -> bytes:
    """What a request's sealed result is bound to: it opens only as that line's result."""
    return f"{batch_id}/{idx}".encode()


def _unrun_row_id(batch_id: str, idx: int) -> str:
    # Derived, not random: a line closed without a result is rendered each time it is read,
    # and every reading (a page, the error file) must show the same row.
    return "batch_req_" + hashlib.sha256(f"{batch_id}/{idx}".encode()).hexdigest()[:24]


def render(sealer: Sealer, batch_id: str, result: StoredResult) -> bytes:
    """The row of ``result`` (without its newline); raises what ``sealer.open`` raises."""
    if result.payload is not None:
        return sealer.open(result.payload, result_context(batch_id, result.idx))
    code = result.error_code or "engine_unavailable"
    return error_row(
        result.custom_id,
        code,
        ERROR_MESSAGES.get(code, code),
        row_id=_unrun_row_id(batch_id, result.idx),
    )
