"""Completion-window durations: ``<int>(ms|s|m|h)`` (SPEC §4.1)."""

from __future__ import annotations

import pytest

from backfill.domain.durations import format_seconds, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("24h", 86400),
        ("168h", 168 * 3600),
        ("90m", 5400),
        ("1s", 1),
        ("3600s", 3600),
        ("1500ms", 1.5),
        ("1ms", 0.001),
        ("7d", 7 * 86400),
        ("1000000000s", 1_000_000_000),
    ],
)
def test_parse_duration_accepts_whole_numbers_with_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_parse_duration_ignores_surrounding_whitespace() -> None:
    assert parse_duration(" 24h ") == 86400


@pytest.mark.parametrize(
    "text",
    [
        "",
        "h",
        "24",
        "0h",
        "0s",
        "024h",
        "-1h",
        "+1h",
        "1.5h",
        "24 h",
        "24H",
        "24hours",
        "1w",
        "1h30m",
        "ms",
        "12345678901s",
    ],
)
def test_parse_duration_rejects_other_forms_naming_the_accepted_one(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration") as info:
        parse_duration(text)
    assert repr(text) in str(info.value)
    assert "24h" in str(info.value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (86400, "1d"),
        (7 * 86400, "7d"),
        (3600, "1h"),
        (25 * 3600, "25h"),
        (5400, "90m"),
        (60, "1m"),
        (61, "61s"),
        (1, "1s"),
        (1.5, "1500ms"),
        (0.001, "1ms"),
    ],
)
def test_format_seconds_uses_the_largest_exact_unit(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text


@pytest.mark.parametrize("millis", [1, 999, 1000, 1500, 60_000, 90_000, 3_600_000, 86_400_000])
def test_format_then_parse_round_trips(millis: int) -> None:
    seconds = millis / 1000
    assert parse_duration(format_seconds(seconds)) == pytest.approx(seconds)
