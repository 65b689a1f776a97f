"""Which error code a result row counts under (``services/error_codes.py``)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from backfill.domain.results import error_row, http_error_row, success_row
from backfill.services.error_codes import error_code


@pytest.mark.parametrize(
    ("row", "code"),
    [
        (success_row("a", 200, {"choices": []}, "req_1"), None),
        (http_error_row("b", 400, {"error": {"message": "bad"}}), "http_400"),
        (http_error_row("c", 503, "overloaded"), "http_503"),
        (error_row("d", "batch_expired", "too late"), "batch_expired"),
        (error_row("e", "request_timeout", "slow"), "request_timeout"),
    ],
)
def test_rows_count_under_their_code(row: bytes, code: str | None) -> None:
    assert error_code(orjson.loads(row)) == code


@pytest.mark.parametrize(
    ("row", "code"),
    [
        ([], "unreadable_row"),
        ({"error": {"code": ""}}, "error"),
        ({"error": None, "response": None}, "error"),
        ({"error": None, "response": {"status_code": "200"}}, "error"),
    ],
)
def test_odd_rows_still_count_as_failures(row: Any, code: str) -> None:
    assert error_code(row) == code
