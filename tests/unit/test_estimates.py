"""The estimate's arithmetic (domain/estimates.py): the answer sample, the expected tokens and
cost, and the completion time behind the queue."""

from __future__ import annotations

import pytest

from backfill.domain.estimates import (
    AnswerSample,
    OutputBasis,
    completion_at,
    expected,
    expected_output_tokens,
    sample_of,
)
from backfill.domain.money import Prices, token_charge, worst_case

PRICES = Prices(input=100_000, cached_input=50_000, output=400_000)


def test_the_sample_takes_whole_batches_newest_first_until_it_has_enough() -> None:
    # 600 + 500 answers reach 1,000: the third batch is not read.
    sample = sample_of([(600, 6_000), (0, 0), (500, 10_000), (900, 1)], wanted=1_000)
    assert sample == AnswerSample(results=1_100, output_tokens=16_000)
    assert sample.mean == pytest.approx(16_000 / 1_100)


def test_no_batch_is_no_sample() -> None:
    assert sample_of([]) == AnswerSample(0, 0)
    assert sample_of([(0, 0)]).mean is None


def test_expected_output_is_the_mean_times_the_lines_rounded_up_and_capped() -> None:
    sample = AnswerSample(results=3, output_tokens=10)  # 3.33 tokens an answer
    assert expected_output_tokens(sample, lines=3, bound=1_000) == 10
    assert expected_output_tokens(sample, lines=4, bound=1_000) == 14  # 13.33, up
    # Never more than the lines' max_tokens allow.
    assert expected_output_tokens(sample, lines=4, bound=12) == 12
    # Without a sample, every line at its max_tokens.
    assert expected_output_tokens(AnswerSample(), lines=4, bound=64) == 64


def test_expected_cost_prices_the_validation_bound_and_the_measured_answers() -> None:
    found = expected(PRICES, 900, 640, 40, AnswerSample(results=1_000, output_tokens=4_000))
    assert (found.input_tokens, found.output_tokens) == (900, 160)
    assert found.cost == 900 * PRICES.input + 160 * PRICES.output
    assert found.cost == token_charge(PRICES, 900, 0, 160)
    assert found.basis is OutputBasis.MEASURED
    # Below the worst case, which reserves every line's max_tokens.
    assert found.cost < worst_case(PRICES, 900, 640)


def test_without_a_sample_the_expected_cost_is_the_worst_case_of_equal_prices() -> None:
    same = Prices(input=100_000, cached_input=100_000, output=400_000)
    found = expected(same, 900, 640, 40, AnswerSample())
    assert found.basis is OutputBasis.MAX_TOKENS
    assert found.cost == worst_case(same, 900, 640)


def test_gpu_time_has_no_expected_cost() -> None:
    found = expected(None, 900, 640, 40, AnswerSample(10, 50))
    assert found.cost is None
    assert found.output_tokens == 200


def test_completion_is_behind_the_queue_at_the_measured_rate() -> None:
    # 300 lines ahead and 100 of its own at 4 per second: 100 s, after a 20 s engine start.
    assert completion_at(1_000.0, 100, 300, 4.0, 20.0) == 1_120
    assert completion_at(1_000.0, 1, 0, 3.0) == 1_001  # 0.33 s, rounded up
    assert completion_at(1_000.0, 100, 300, None) is None
    assert completion_at(1_000.0, 100, 300, 0.0) is None
