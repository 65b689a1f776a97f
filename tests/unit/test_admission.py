"""Admission of a new batch, decided on a snapshot without a database: each refusal, its
message and Retry-After, and the boundaries (exactly at a limit is accepted)."""

from __future__ import annotations

import pytest

from backfill.domain.admission import (
    AdmissionSnapshot,
    check,
    check_retained,
    check_worst_case,
    output_tokens_left,
)
from backfill.domain.catalog import Billing
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.money import MAX_BALANCE, PICO_PER_USD
from backfill.domain.records import Admission, BatchRecord
from backfill.errors import PaymentRequired, RateLimited

USD = PICO_PER_USD
WINDOW = 3600
RATE = 100  # output tokens per second: 360,000 fit in the window


def batch(bound: int = 1000) -> BatchRecord:
    return BatchRecord(
        id="batch_1",
        org_id="org_1",
        endpoint="/v1/chat/completions",
        model="m-1",
        model_config_id="cfg",
        input_file_id="file-1",
        completion_window="1h",
        status=BatchStatus.VALIDATING,
        created_at=1_000,
        expires_at=1_000 + WINDOW,
        total=10,
        billing=Billing.CATALOG,
        output_token_bound=bound,
    )


def admission(
    reserve: int = 0,
    *,
    private: bool = False,
    max_unfinished: int = 5,
    max_retained: int = 1000,
    rate: int | None = None,
) -> Admission:
    return Admission(
        reserve=reserve,
        require_positive_balance=private,
        max_unfinished=max_unfinished,
        max_retained_input_bytes=max_retained,
        throughput_tokens_per_s=rate,
    )


def snapshot(
    balance: int = 10 * USD,
    reserved: int = 0,
    unfinished: int = 0,
    retained: int = 0,
    queued: int = 0,
) -> AdmissionSnapshot:
    return AdmissionSnapshot(balance, reserved, unfinished, retained, queued)


# ---- credit -----------------------------------------------------------------------------


def test_a_reservation_exactly_covered_by_the_available_credit_is_accepted() -> None:
    check(snapshot(balance=5 * USD, reserved=3 * USD), batch(), admission(2 * USD))


def test_a_reservation_beyond_the_available_credit_is_refused_with_both_amounts() -> None:
    with pytest.raises(PaymentRequired) as refused:
        check(snapshot(balance=5 * USD, reserved=3 * USD + 1), batch(), admission(2 * USD))
    assert refused.value.message == (
        "This batch needs 2 USD of credit for its worst case but 1.999999999999 USD is "
        "available; add credit or submit fewer requests. Nothing was queued and the input "
        "file can be used again."
    )
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        402,
        "insufficient_credit",
        None,
    )


def test_a_negative_available_credit_refuses_even_a_free_batch() -> None:
    with pytest.raises(PaymentRequired, match=r"needs 0 USD .* but -0\.5 USD is available"):
        check(snapshot(balance=USD // 2, reserved=USD), batch(), admission(0))


@pytest.mark.parametrize("balance", [0, -USD])
def test_a_private_deployment_needs_a_positive_balance(balance: int) -> None:
    with pytest.raises(PaymentRequired) as refused:
        check(snapshot(balance=balance), batch(), admission(private=True))
    assert refused.value.message == (
        f"Batches on a private deployment need a positive balance (it is {balance // USD} "
        "USD); add credit and retry."
    )


def test_a_private_deployment_with_any_positive_balance_is_accepted() -> None:
    check(snapshot(balance=1), batch(), admission(private=True))


def test_a_worst_case_no_balance_could_hold_is_refused_before_any_read() -> None:
    check_worst_case(MAX_BALANCE)
    with pytest.raises(PaymentRequired) as refused:
        check_worst_case(MAX_BALANCE + 1)
    assert refused.value.message == (
        "This batch needs 9000000.000000000001 USD of credit for its worst case, more than "
        "any balance may hold (9000000 USD); split the file or lower max_tokens."
    )


# ---- the org's limits -------------------------------------------------------------------


def test_one_below_the_unfinished_limit_is_accepted() -> None:
    check(snapshot(unfinished=4), batch(), admission(max_unfinished=5))


def test_the_unfinished_limit_refuses_at_once_without_a_wait_it_cannot_know() -> None:
    with pytest.raises(RateLimited) as refused:
        check(snapshot(unfinished=5), batch(), admission(max_unfinished=5))
    assert refused.value.message == (
        "This organization already has 5 unfinished batches (the limit is 5); wait for one "
        "to finish or cancel one, then retry."
    )
    # Room comes back when a batch ends, maybe hours later: clients are told at once.
    assert (refused.value.code, refused.value.retry_after_s, refused.value.retryable) == (
        "too_many_unfinished_batches",
        None,
        False,
    )


def test_retained_input_exactly_at_the_limit_is_accepted() -> None:
    check(snapshot(retained=1000), batch(), admission(max_retained=1000))


def test_retained_input_over_the_limit_is_refused_without_a_retry() -> None:
    with pytest.raises(RateLimited) as refused:
        check(snapshot(retained=1001), batch(), admission(max_retained=1000))
    assert refused.value.message == (
        "This organization keeps 1001 bytes of input files; the limit is 1000 bytes. Delete "
        "input files you no longer need (DELETE /v1/files/{id}) and retry."
    )
    assert (refused.value.code, refused.value.retry_after_s, refused.value.retryable) == (
        "retained_input_limit",
        None,
        False,
    )


def test_an_upload_is_refused_when_it_would_take_the_org_past_the_limit() -> None:
    check_retained(600, 400, 1000)
    with pytest.raises(RateLimited, match="keeps 600 bytes of input files and this file adds 401"):
        check_retained(600, 401, 1000)


def test_credit_is_checked_before_the_limits() -> None:
    with pytest.raises(PaymentRequired):
        check(
            snapshot(balance=0, unfinished=9, retained=10**9),
            batch(),
            admission(USD, max_unfinished=1),
        )


def test_the_unfinished_limit_is_checked_before_retained_input() -> None:
    with pytest.raises(RateLimited, match="unfinished"):
        check(snapshot(unfinished=9, retained=10**9), batch(), admission(max_unfinished=1))


# ---- the model's capacity ---------------------------------------------------------------


def test_a_batch_that_exactly_fills_the_window_is_accepted() -> None:
    check(snapshot(queued=RATE * WINDOW - 1000), batch(1000), admission(rate=RATE))


def test_one_token_over_capacity_asks_for_a_retry_in_a_whole_minute() -> None:
    with pytest.raises(RateLimited) as refused:
        check(snapshot(queued=RATE * WINDOW - 999), batch(1000), admission(rate=RATE))
    assert refused.value.message == (
        "m-1 cannot take this batch's 1000 output tokens inside its 1h window now. Retry in "
        "about 60s, use a longer window, or split the file."
    )
    assert (refused.value.code, refused.value.retry_after_s) == ("capacity_exceeded", 60)
    # A wait of a minute or more is an estimate for the caller, not one for SDKs to sleep.
    assert refused.value.retryable is False


@pytest.mark.parametrize(
    ("over", "wait"),
    [(RATE * 60, 60), (RATE * 60 + 1, 120), (RATE * 3600, 3600)],
)
def test_the_capacity_wait_is_the_excess_at_the_rate_rounded_up_to_minutes(
    over: int, wait: int
) -> None:
    queued = RATE * WINDOW - 1000 + over
    with pytest.raises(RateLimited) as refused:
        check(snapshot(queued=queued), batch(1000), admission(rate=RATE))
    assert refused.value.retry_after_s == wait
    assert f"Retry in about {wait}s" in refused.value.message


def test_a_model_without_a_throughput_has_no_capacity_limit() -> None:
    check(snapshot(queued=10**15), batch(10**9), admission(rate=None))


def test_output_tokens_left_scale_with_the_unfinished_share_of_lines() -> None:
    assert output_tokens_left(1000, 10, 0) == 1000
    assert output_tokens_left(1000, 10, 7) == 300
    assert output_tokens_left(1000, 3, 1) == 666  # rounded down
    assert output_tokens_left(1000, 0, 0) == 0
