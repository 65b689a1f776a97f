"""Which result numbers a progress curve reads, and the curve made of their times."""

from __future__ import annotations

from itertools import pairwise

import pytest

from backfill.domain.progress import MAX_POINTS, ProgressPoint, curve, sampled_seqs


def test_a_short_batch_reads_every_number() -> None:
    assert sampled_seqs(0) == []
    assert sampled_seqs(1) == [1]
    assert sampled_seqs(5, max_points=5) == [1, 2, 3, 4, 5]
    assert sampled_seqs(MAX_POINTS) == list(range(1, MAX_POINTS + 1))


@pytest.mark.parametrize("last", [MAX_POINTS + 1, 121, 239, 240, 1000, 12_345, 10**7])
def test_a_long_batch_reads_evenly_spaced_numbers_with_both_ends(last: int) -> None:
    seqs = sampled_seqs(last)
    assert len(seqs) == MAX_POINTS
    assert seqs[0] == 1
    assert seqs[-1] == last
    steps = [b - a for a, b in pairwise(seqs)]
    assert min(steps) >= 1
    # Evenly spaced: the steps differ by one at most.
    assert max(steps) - min(steps) <= 1


def test_a_curve_needs_two_points_at_least() -> None:
    with pytest.raises(ValueError):
        sampled_seqs(10, max_points=1)
    assert sampled_seqs(10, max_points=2) == [1, 10]


def test_the_curve_is_the_times_of_the_numbers() -> None:
    times: dict[int, float | None] = {1: 100.0, 2: 100.0, 3: 105.5, 4: 130.0}
    assert curve([1, 2, 3, 4], times) == (
        ProgressPoint(100.0, 1),
        ProgressPoint(100.0, 2),
        ProgressPoint(105.5, 3),
        ProgressPoint(130.0, 4),
    )
    assert curve([], {}) == ()


def test_a_clock_behind_another_never_draws_time_backwards() -> None:
    times: dict[int, float | None] = {1: 100.0, 2: 99.5, 3: 101.0}
    assert [p.at for p in curve([1, 2, 3], times)] == [100.0, 100.0, 101.0]


def test_a_result_without_a_time_or_missing_gives_no_curve() -> None:
    assert curve([1, 2, 3], {1: None, 2: 5.0, 3: 6.0}) == ()
    assert curve([1, 2, 3], {1: 4.0, 2: None, 3: 6.0}) == ()
    assert curve([1, 2, 3], {1: 4.0, 3: 6.0}) == ()
