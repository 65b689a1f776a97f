"""The HTTP edge's limits refuse values that would break it: a zero timeout makes the
connection watchdog spin, a zero size or connection cap refuses every request."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from backfill.settings import Settings


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("header_timeout_s", 0, "greater than 0"),
        ("body_idle_timeout_s", 0, "greater than 0"),
        ("body_idle_timeout_s", -1.5, "greater than 0"),
        ("max_header_bytes", 0, "greater than or equal to 1"),
        ("max_json_body_bytes", 0, "greater than or equal to 1"),
        ("max_connections", 0, "greater than or equal to 1"),
    ],
)
def test_edge_limits_out_of_range_are_refused(field: str, value: float, says: str) -> None:
    values: dict[str, Any] = {field: value}
    with pytest.raises(ValidationError) as refused:
        Settings(**values)
    (error,) = refused.value.errors()
    assert error["loc"] == (field,)
    assert says in error["msg"]


def test_edge_limits_from_the_environment_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_HEADER_TIMEOUT_S", "0")
    with pytest.raises(ValidationError, match="header_timeout_s"):
        Settings()


def test_smallest_edge_limits_are_accepted() -> None:
    settings = Settings(
        header_timeout_s=0.01,
        body_idle_timeout_s=0.01,
        max_header_bytes=1,
        max_json_body_bytes=1,
        max_connections=1,
    )
    assert settings.http.max_connections == 1
