"""Deadline-aware admission on a snapshot: the measured rate against the lines already
accepted, the boundary, the rounded answer and the Retry-After."""

from __future__ import annotations

import dataclasses

import pytest

from backfill.domain.admission import AdmissionSnapshot, check, check_deadline
from backfill.domain.records import Admission
from backfill.errors import RateLimited
from tests.unit.test_admission import WINDOW, admission, batch

RPS = 2.5  # 9,000 requests fit the one-hour window


def snapshot(unfinished: int, rps: float | None = RPS) -> AdmissionSnapshot:
    return AdmissionSnapshot(
        balance=10**15,
        reserved=0,
        unfinished=0,
        retained_input_bytes=0,
        measured_rps=rps,
        unfinished_lines=unfinished,
    )


def deadline_aware() -> Admission:
    return dataclasses.replace(admission(), deadline_aware=True)


def test_a_batch_that_exactly_fills_the_window_behind_the_backlog_is_accepted() -> None:
    check(snapshot(8_000), dataclasses.replace(batch(), total=1_000), deadline_aware())


def test_one_line_over_is_refused_saying_what_would_fit_and_when_to_retry() -> None:
    with pytest.raises(RateLimited) as refused:
        check(snapshot(8_001), dataclasses.replace(batch(), total=1_000), deadline_aware())
    assert refused.value.message == (
        "m-1 cannot finish this batch's 1000 requests inside its 1h window at the rate it "
        "serves now: about 990 requests would fit in that window now. Retry in about 60s, use "
        "a longer window, or split the file."
    )
    assert (refused.value.status, refused.value.code, refused.value.retry_after_s) == (
        429,
        "capacity_exceeded",
        60,
    )


@pytest.mark.parametrize(
    ("unfinished", "fits"),
    [(1, "about 8,900 requests"), (5_678, "about 3,300 requests"), (8_950, "about 50 requests")],
)
def test_what_fits_is_rounded_down_to_two_digits(unfinished: int, fits: str) -> None:
    """The backlog is mostly other orgs' work: the answer must not give it to the line."""
    with pytest.raises(RateLimited) as refused:
        check_deadline(unfinished, dataclasses.replace(batch(), total=10_000), RPS)
    assert f"{fits} would fit" in refused.value.message


def test_a_backlog_past_the_window_says_none_would_fit_and_waits_it_out() -> None:
    with pytest.raises(RateLimited) as refused:
        check_deadline(int(RPS * WINDOW) + 150, dataclasses.replace(batch(), total=1), RPS)
    assert "none of its requests would fit" in refused.value.message
    # 151 lines over at 2.5/s is 61 s: two whole minutes.
    assert refused.value.retry_after_s == 120


def test_no_measured_rate_or_the_setting_off_refuses_nothing() -> None:
    huge = dataclasses.replace(batch(), total=10**9)
    check(snapshot(10**9, rps=None), huge, deadline_aware())
    check(snapshot(10**9), huge, admission())  # deadline_aware is off by default


def test_an_engine_that_starts_on_demand_first_leaves_less_of_the_window() -> None:
    # 9,000 requests fit the hour at 2.5/s; a 60 s start leaves room for 8,850.
    check_deadline(0, dataclasses.replace(batch(), total=8_850), RPS, start_delay_s=60.0)
    with pytest.raises(RateLimited) as refused:
        check_deadline(0, dataclasses.replace(batch(), total=8_851), RPS, start_delay_s=60.0)
    assert "its engine starts on demand first, in about 60 s" in refused.value.message
    wait = dataclasses.replace(snapshot(0), start_delay_s=60.0)
    with pytest.raises(RateLimited):
        check(wait, dataclasses.replace(batch(), total=8_851), deadline_aware())
