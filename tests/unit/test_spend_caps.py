"""Spend caps' rules (docs/billing.md, "Spend caps"): the UTC calendar windows, their edges and
reset times, and which cap refuses a batch, with what message."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.domain.money import MAX_BALANCE_USD, PICO_PER_USD
from backfill.domain.spend_caps import (
    CapScope,
    CapUse,
    Period,
    SpendCap,
    Window,
    check_caps,
    iso,
    parse_limit,
    parse_period,
    window,
)
from backfill.errors import InvalidInput, SpendCapReached

USD = PICO_PER_USD


def at(text: str) -> int:
    """Unix seconds of an ISO 8601 UTC time such as ``2026-03-01T00:00:00``."""
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp())


def span(period: Period, when: str) -> tuple[str, str | None]:
    found = window(period, at(when))
    return iso(found.start), None if found.resets_at is None else iso(found.resets_at)


# ---- windows -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("period", "when", "start", "resets"),
    [
        # A day: from midnight UTC, its last second included, the next midnight is the next day.
        (Period.DAY, "2026-03-14T15:09:26", "2026-03-14T00:00:00Z", "2026-03-15T00:00:00Z"),
        (Period.DAY, "2026-03-14T00:00:00", "2026-03-14T00:00:00Z", "2026-03-15T00:00:00Z"),
        (Period.DAY, "2026-03-14T23:59:59", "2026-03-14T00:00:00Z", "2026-03-15T00:00:00Z"),
        (Period.DAY, "2026-12-31T23:59:59", "2026-12-31T00:00:00Z", "2027-01-01T00:00:00Z"),
        # An ISO week: Monday 00:00 to the next Monday, across months and years.
        (Period.WEEK, "2026-03-16T00:00:00", "2026-03-16T00:00:00Z", "2026-03-23T00:00:00Z"),
        (Period.WEEK, "2026-03-22T23:59:59", "2026-03-16T00:00:00Z", "2026-03-23T00:00:00Z"),
        (Period.WEEK, "2024-12-31T12:00:00", "2024-12-30T00:00:00Z", "2025-01-06T00:00:00Z"),
        (Period.WEEK, "2021-01-01T08:00:00", "2020-12-28T00:00:00Z", "2021-01-04T00:00:00Z"),
        (Period.WEEK, "1970-01-01T00:00:00", "1969-12-29T00:00:00Z", "1970-01-05T00:00:00Z"),
        # A month: the 1st 00:00 to the next 1st, whatever its length.
        (Period.MONTH, "2026-01-31T23:59:59", "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"),
        (Period.MONTH, "2026-02-01T00:00:00", "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z"),
        (Period.MONTH, "2024-02-29T23:00:00", "2024-02-01T00:00:00Z", "2024-03-01T00:00:00Z"),
        (Period.MONTH, "2026-12-15T00:00:00", "2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z"),
        (Period.TOTAL, "2026-12-15T00:00:00", "1970-01-01T00:00:00Z", None),
    ],
)
def test_windows_are_utc_calendar_ones(
    period: Period, when: str, start: str, resets: str | None
) -> None:
    assert span(period, when) == (start, resets)


@given(st.integers(min_value=0, max_value=at("2200-01-01T00:00:00")), st.sampled_from(Period))
def test_every_instant_lies_in_one_window_that_the_next_one_follows(
    now: int, period: Period
) -> None:
    found = window(period, now + 0.5)
    assert found.start <= now < (found.resets_at or now + 1)
    # The window is the same from any instant in it, and the next one starts as it resets.
    assert window(period, found.start) == found
    if found.resets_at is None:
        assert found == Window(0, None)
        return
    assert window(period, found.resets_at - 1) == found
    assert window(period, found.resets_at).start == found.resets_at
    first = datetime.fromtimestamp(found.start, UTC)
    length = found.resets_at - found.start
    if period == Period.DAY:
        assert (first.hour, first.minute, length) == (0, 0, 86_400)
    elif period == Period.WEEK:
        assert (first.weekday(), first.hour, length) == (0, 0, 7 * 86_400)
    else:
        assert (first.day, first.hour) == (1, 0)
        assert 28 * 86_400 <= length <= 31 * 86_400


# ---- refusals ------------------------------------------------------------------------------

NOW = at("2026-03-14T15:00:00")


def use(
    period: Period,
    limit_usd: int,
    charged_usd: int = 0,
    reserved_usd: int = 0,
    scope: CapScope = CapScope.ORG,
) -> CapUse:
    scope_id = "org_1" if scope == CapScope.ORG else "key_1"
    cap = SpendCap(scope, scope_id, "org_1", period, limit_usd * USD, 0)
    return CapUse(cap, window(period, NOW), charged_usd * USD, reserved_usd * USD)


def refused(uses: list[CapUse], reserve_usd: int, open_ended: bool = False) -> SpendCapReached:
    with pytest.raises(SpendCapReached) as info:
        check_caps(uses, reserve_usd * USD, open_ended, NOW)
    return info.value


def test_a_batch_that_fits_to_the_picodollar_is_admitted_and_one_more_is_not() -> None:
    check_caps([use(Period.DAY, 10, 3, 2)], 5 * USD, False, NOW)
    with pytest.raises(SpendCapReached):
        check_caps([use(Period.DAY, 10, 3, 2)], 5 * USD + 1, False, NOW)


def test_the_refusal_names_the_cap_what_the_window_holds_and_when_it_resets() -> None:
    error = refused([use(Period.MONTH, 100, 80, 15)], 12)
    assert (error.status, error.code, error.type) == (402, "spend_cap_reached", "spend_cap_reached")
    message = error.message
    assert "needs up to 12 USD" in message
    assert "this organization's monthly spend cap of 100 USD" in message
    assert "80 USD charged and 15 USD still reserved" in message
    assert "since 2026-03-01T00:00:00Z" in message
    assert "5 USD left" in message
    assert "The cap resets at 2026-04-01T00:00:00Z." in message
    assert "Nothing was queued" in message
    assert error.retry_after_s == at("2026-04-01T00:00:00") - NOW
    assert error.retryable is False


def test_a_key_cap_names_the_key() -> None:
    error = refused([use(Period.DAY, 1, scope=CapScope.KEY)], 2)
    assert "API key key_1's daily spend cap of 1 USD" in error.message


def test_the_cap_that_binds_longest_is_the_one_reported() -> None:
    day, month = use(Period.DAY, 10, 9), use(Period.MONTH, 50, 49)
    error = refused([day, month], 2)
    assert "monthly spend cap of 50 USD" in error.message
    assert error.retry_after_s == at("2026-04-01T00:00:00") - NOW
    # With room in the month only the day refuses, until tomorrow.
    error = refused([day, use(Period.MONTH, 50, 9)], 2)
    assert "daily spend cap of 10 USD" in error.message
    assert error.retry_after_s == at("2026-03-15T00:00:00") - NOW
    # An all-time cap never resets: no estimate of when to retry.
    error = refused([day, use(Period.TOTAL, 10, 9)], 2)
    assert "all-time spend cap of 10 USD" in error.message
    assert "does not reset" in error.message
    assert "still reserved by what was created so far" in error.message
    assert error.retry_after_s is None


def test_a_batch_over_the_cap_on_its_own_is_told_to_shrink() -> None:
    error = refused([use(Period.DAY, 10)], 11)
    assert "The batch alone is over the cap" in error.message
    assert "Room also comes back" not in error.message
    assert error.retry_after_s is None


def test_a_reset_a_few_seconds_away_is_left_to_the_clients_retry() -> None:
    cap = SpendCap(CapScope.ORG, "org_1", "org_1", Period.DAY, USD, 0)
    late = at("2026-03-14T23:59:55")
    with pytest.raises(SpendCapReached) as info:
        check_caps([CapUse(cap, window(Period.DAY, late), USD, 0)], 1, False, late)
    assert (info.value.retry_after_s, info.value.retryable) == (5, True)


def test_gpu_time_batches_start_only_while_a_window_has_room() -> None:
    check_caps([use(Period.DAY, 10, 9)], 0, True, NOW)
    error = refused([use(Period.DAY, 10, 10)], 0, open_ended=True)
    assert "billed by GPU time" in error.message
    # GPU time charged past the cap (it is not reserved ahead) shows nothing left.
    assert "0 USD left" in refused([use(Period.DAY, 10, 12)], 0, open_ended=True).message


def test_a_zero_cap_refuses_everything_that_costs_anything() -> None:
    check_caps([use(Period.DAY, 0)], 0, False, NOW)
    error = refused([use(Period.DAY, 0)], 1)
    assert "A cap of 0 USD stops all new batches; an administrator can raise it." in error.message
    assert "split the file" not in error.message
    with pytest.raises(SpendCapReached):
        check_caps([use(Period.DAY, 0)], 0, True, NOW)


def test_a_batch_that_costs_nothing_fits_a_window_gpu_time_took_past_its_cap() -> None:
    check_caps([use(Period.DAY, 10, 12)], 0, False, NOW)


def test_a_cap_the_batch_alone_is_over_is_reported_before_one_that_resets_later() -> None:
    # Over the day's 10 USD on its own, and over the month's room: waiting for the month's
    # reset would not help, so the day's cap is the one named, with no time to retry.
    error = refused([use(Period.DAY, 10), use(Period.MONTH, 100, 95)], 12)
    assert "daily spend cap of 10 USD" in error.message
    assert "The batch alone is over the cap" in error.message
    assert error.retry_after_s is None


# ---- input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("usd", "pico"), [("0", 0), ("100", 100 * USD), ("12.50", 12_500_000_000_000)]
)
def test_limits_are_exact_usd_strings(usd: str, pico: int) -> None:
    assert parse_limit(usd) == pico


@pytest.mark.parametrize("usd", ["-1", "abc", "1e-13", str(MAX_BALANCE_USD + 1), 100, None])
def test_other_limits_are_refused_naming_usd(usd: object) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_limit(usd)
    assert info.value.param == "usd"


def test_periods_are_named() -> None:
    assert [parse_period(p) for p in ("day", "week", "month", "total")] == list(Period)
    with pytest.raises(InvalidInput, match="day, week, month, total") as info:
        parse_period("year")
    assert info.value.param == "period"
