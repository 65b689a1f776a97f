"""The rows of output and error files (SPEC §6)."""

from __future__ import annotations

from typing import Any

import orjson

from backfill.domain import ids
from backfill.domain.output_schema import OUTPUT_SCHEMA_MISMATCH


def success_row(custom_id: str, status_code: int, body: Any, request_id: str) -> bytes:
    return _row(
        custom_id,
        {"status_code": status_code, "request_id": request_id, "body": body},
        None,
    )


def http_error_row(custom_id: str, status_code: int, body: Any) -> bytes:
    """An engine's own HTTP error: kept in ``response``, with ``error: null`` as OpenAI does."""
    return success_row(custom_id, status_code, body, ids.request_id())


def mismatch_row(custom_id: str, body: Any, request_id: str, message: str) -> bytes:
    """An answer that is not what its line asked for (``domain/output_schema.py``): the
    engine's answer kept in ``response`` as a success row keeps it (``request_id`` names its
    receipt: it is charged), and ``error`` says why it counts as failed."""
    return _row(
        custom_id,
        {"status_code": 200, "request_id": request_id, "body": body},
        {"code": OUTPUT_SCHEMA_MISMATCH, "message": message},
    )


def error_row(custom_id: str, code: str, message: str, *, row_id: str | None = None) -> bytes:
    """``row_id``: the row's ``id`` when it must come out the same each time it is built."""
    return _row(custom_id, None, {"code": code, "message": message}, row_id)


def _row(
    custom_id: str,
    response: dict[str, Any] | None,
    error: dict[str, str] | None,
    row_id: str | None = None,
) -> bytes:
    return orjson.dumps(
        {
            "id": row_id or ids.batch_request_id(),
            "custom_id": custom_id,
            "response": response,
            "error": error,
        }
    )


ERROR_MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request ran.",
    "batch_expired": "The batch's completion window ended before this request finished.",
    "request_timeout": "The engine did not answer in time, after every retry.",
    "engine_unavailable": "No engine could serve this request before the window ended.",
    "input_unavailable": "The stored input of this request could not be read (it is missing, "
    "damaged or sealed under another master key); upload the file again and submit a new batch.",
}
