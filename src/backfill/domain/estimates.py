"""What a batch would cost and when it would finish, before it is submitted (docs/api.md,
"Estimating a batch").

Pure: the batch service builds the batch and its admission terms exactly as creation would,
the store reads what admission reads (without its lock, writing nothing) and the organization's
recent answers of the model; these functions turn that into an ``Estimate``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from backfill.domain.money import Prices, token_charge
from backfill.domain.records import BatchRecord
from backfill.errors import BackfillError

SAMPLE_RESULTS = 1_000
"""The answers an expected output length is measured over, at least (whole batches are read,
so the sample may hold more)."""
SAMPLE_BATCHES = 100
"""The newest batches read for that sample, at most: an estimate never walks an org's
history."""


class OutputBasis(StrEnum):
    """Where the expected output tokens come from."""

    MEASURED = "measured"
    """The mean answer length of the org's recent answers of the model."""
    MAX_TOKENS = "max_tokens"
    """No answer was measured yet: every line is taken at its ``max_tokens``."""


@dataclass(frozen=True, slots=True)
class AnswerSample:
    """Successful answers of a model, counted with their output tokens."""

    results: int = 0
    output_tokens: int = 0

    @property
    def mean(self) -> float | None:
        """Output tokens per answer; None without an answer."""
        return self.output_tokens / self.results if self.results > 0 else None


def sample_of(batches: Iterable[tuple[int, int]], wanted: int = SAMPLE_RESULTS) -> AnswerSample:
    """The sample of ``batches`` (each ``(answers, output tokens)``, newest first), taken whole
    until it holds at least ``wanted`` answers: a batch's counters hold only sums, so the
    newest answers are those of the newest batches."""
    results = tokens = 0
    for answers, output in batches:
        if answers <= 0:
            continue
        results += answers
        tokens += output
        if results >= wanted:
            break
    return AnswerSample(results, tokens)


def expected_output_tokens(sample: AnswerSample, lines: int, bound: int) -> int:
    """The mean answer length times the lines, rounded up, never above ``bound`` (the lines'
    ``max_tokens`` summed: no answer is longer than its line allows); ``bound`` itself without
    a sample."""
    if sample.results <= 0:
        return bound
    return min(bound, -(-sample.output_tokens * lines // sample.results))


@dataclass(frozen=True, slots=True)
class Expected:
    """What the batch is expected to use, and to cost at its prices."""

    input_tokens: int
    output_tokens: int
    cost: int | None
    """Picodollars; None for a batch billed by GPU time."""
    sample: AnswerSample

    @property
    def basis(self) -> OutputBasis:
        return OutputBasis.MEASURED if self.sample.results > 0 else OutputBasis.MAX_TOKENS


def expected(
    prices: Prices | None,
    prompt_token_bound: int,
    max_output_tokens: int,
    lines: int,
    sample: AnswerSample,
) -> Expected:
    """Input tokens as validation counted them (its bound: the same count the worst case
    reserves for, since an upload is not tokenized), output tokens from ``sample``; priced as
    requests without cached input."""
    output = expected_output_tokens(sample, lines, max_output_tokens)
    cost = None if prices is None else token_charge(prices, prompt_token_bound, 0, output)
    return Expected(prompt_token_bound, output, cost, sample)


def completion_at(
    now: float, lines: int, ahead: int, rps: float | None, start_delay_s: float = 0.0
) -> int | None:
    """When ``lines`` would be done behind the ``ahead`` lines already accepted for the model,
    at its measured ``rps``, once its engine answers (``start_delay_s``): the same sum that
    deadline admission compares with the window, rounded up to a whole second. None while the
    model's rate is not measured."""
    if not rps or rps <= 0:
        return None
    return math.ceil(now + start_delay_s + (ahead + lines) / rps)


@dataclass(frozen=True, slots=True)
class Estimate:
    """The answer to ``POST /v1/batches/estimate``."""

    batch: BatchRecord
    """The batch creation would make now (not stored)."""
    prompt_token_bound: int
    reserve: int
    """Picodollars creation would reserve: the worst case of a catalog batch, 0 otherwise."""
    expected: Expected
    refusal: BackfillError | None
    """What creation would refuse the batch with now (None: it would be accepted)."""
    available: int
    """The org's available credit (balance less open reservations), picodollars."""
    completion_at: int | None
