"""Tokens/s and ETA of ``backfill batch run``'s progress line, from successive batch objects."""

from __future__ import annotations

from typing import Any

import pytest

from backfill.cli.rates import (
    Sample,
    Throughput,
    format_eta,
    format_rate,
    sample_of,
    seconds_left,
    smooth,
)


def batch(
    completed: int, failed: int = 0, output: int = 0, total_tokens: int = 0
) -> dict[str, Any]:
    return {
        "request_counts": {"total": 100, "completed": completed, "failed": failed},
        "usage": {
            "input_tokens": total_tokens - output,
            "output_tokens": output,
            "total_tokens": total_tokens,
        },
    }


def test_a_sample_counts_ended_lines_and_output_tokens() -> None:
    assert sample_of(batch(7, 2, output=90, total_tokens=150), 3.0) == Sample(3.0, 9, 90)


def test_a_batch_without_output_tokens_counts_its_total_tokens() -> None:
    # Embeddings generate nothing: their speed is the input they read.
    assert sample_of(batch(4, output=0, total_tokens=400), 0.0).tokens == 400


def test_a_batch_object_without_usage_counts_nothing() -> None:
    assert sample_of({"request_counts": {"total": 3}}, 1.0) == Sample(1.0, 0, 0)


def test_smoothing_starts_at_the_first_sample_and_halves_per_half_life() -> None:
    assert smooth(None, 8.0, 1.0, 10.0) == 8.0
    assert smooth(0.0, 10.0, 10.0, 10.0) == pytest.approx(5.0)
    assert smooth(0.0, 10.0, 20.0, 10.0) == pytest.approx(7.5)


def test_a_steady_batch_gives_its_rate() -> None:
    meter = Throughput()
    for second in range(6):
        meter.observe(Sample(float(second), 3 * second, 120 * second))
    assert meter.lines_per_s == pytest.approx(3.0)
    assert meter.tokens_per_s == pytest.approx(120.0)


def test_no_rate_before_two_samples() -> None:
    meter = Throughput()
    meter.observe(Sample(0.0, 5, 50))
    assert meter.lines_per_s is None
    assert meter.tokens_per_s is None


def test_irregular_polls_give_the_same_rate_as_regular_ones() -> None:
    regular, irregular = Throughput(), Throughput()
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        regular.observe(Sample(t, int(10 * t), int(100 * t)))
    for t in (0.0, 0.5, 3.0, 4.0):
        irregular.observe(Sample(t, int(10 * t), int(100 * t)))
    assert regular.tokens_per_s == pytest.approx(100.0)
    assert irregular.tokens_per_s == pytest.approx(100.0)


def test_one_slow_poll_moves_the_rate_only_part_of_the_way() -> None:
    meter = Throughput(half_life_s=10.0)
    for second in range(5):
        meter.observe(Sample(float(second), 10 * second, 0))
    meter.observe(Sample(5.0, 40, 0))  # nothing ended in the last second
    assert meter.lines_per_s is not None
    assert 5.0 < meter.lines_per_s < 10.0


def test_counts_that_go_back_reset_the_rates() -> None:
    meter = Throughput()
    meter.observe(Sample(0.0, 10, 100))
    meter.observe(Sample(1.0, 20, 200))
    meter.observe(Sample(2.0, 0, 0))
    assert meter.tokens_per_s is None
    meter.observe(Sample(3.0, 5, 50))
    assert meter.tokens_per_s == pytest.approx(50.0)


def test_a_repeated_timestamp_is_ignored() -> None:
    meter = Throughput()
    meter.observe(Sample(1.0, 0, 0))
    meter.observe(Sample(1.0, 10, 10))
    assert meter.lines_per_s is None


def test_the_servers_estimate_comes_first() -> None:
    left = seconds_left(
        remaining_lines=50, lines_per_s=1.0, estimated_completion_at=1_000_030, now=1_000_000.0
    )
    assert left == pytest.approx(30.0)


def test_without_an_estimate_the_lines_left_at_the_measured_rate() -> None:
    left = seconds_left(remaining_lines=50, lines_per_s=2.0, estimated_completion_at=None, now=0.0)
    assert left == pytest.approx(25.0)


def test_an_estimate_already_past_gives_way_to_the_rate() -> None:
    left = seconds_left(
        remaining_lines=50, lines_per_s=5.0, estimated_completion_at=999_990, now=1_000_000.0
    )
    assert left == pytest.approx(10.0)


def test_nothing_to_go_on_is_no_eta() -> None:
    assert (
        seconds_left(remaining_lines=5, lines_per_s=None, estimated_completion_at=None, now=0)
        is None
    )
    assert (
        seconds_left(remaining_lines=5, lines_per_s=0.0, estimated_completion_at=None, now=0)
        is None
    )


def test_no_lines_left_is_no_time_left() -> None:
    assert (
        seconds_left(remaining_lines=0, lines_per_s=None, estimated_completion_at=None, now=0)
        == 0.0
    )


@pytest.mark.parametrize(
    ("rate", "text"),
    [
        (None, "- tok/s"),
        (0.0, "0.0 tok/s"),
        (3.26, "3.3 tok/s"),
        (42.4, "42 tok/s"),
        (1234.0, "1.2k tok/s"),
        (56_789.0, "57k tok/s"),
    ],
)
def test_rates_read_at_a_glance(rate: float | None, text: str) -> None:
    assert format_rate(rate) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "ETA -"),
        (0.0, "ETA 0s"),
        (42.4, "ETA 42s"),
        (200.0, "ETA 3m20s"),
        (3 * 3600 + 5 * 60 + 9, "ETA 3h05m"),
        (2 * 86_400 + 4 * 3600, "ETA 2d04h"),
    ],
)
def test_etas_read_at_a_glance(seconds: float | None, text: str) -> None:
    assert format_eta(seconds) == text
