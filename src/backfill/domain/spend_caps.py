"""Spend caps (docs/billing.md, "Spend caps"): a limit in USD on what an org, or one of its API
keys, may spend in a calendar day, ISO week or month (UTC), or in all.

A batch counts in the window it was **created** in, whole: what it was charged so far plus what
it still holds reserved. Its worst case is reserved at creation and only ever shrinks after
(a request's charge replaces part of the reservation, the rest is released when it ends), so
a window's spend never grows past what admission saw, and admission decides on one read made
under the org's lock. GPU time of private deployments counts in the UTC day it is charged, for
org caps only (a span of GPU time serves every batch of the org in flight, so no key owns it).

Pure: the store reads a ``CapUse`` per cap under the org's lock and calls ``check_caps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from backfill.domain.money import MAX_BALANCE, MAX_BALANCE_USD, pico_to_usd, usd_to_pico
from backfill.errors import InvalidInput, SpendCapReached

DAY_S = 86_400
# 1970-01-01, day 0 of Unix time, was a Thursday: day ``d`` is ``(d + 3) % 7`` days past a Monday.
_THURSDAY = 3


class Period(StrEnum):
    """The window a cap limits: a calendar day, an ISO week (from Monday), a calendar month,
    all in UTC; or all time."""

    DAY = "day"
    WEEK = "week"
    MONTH = "month"
    TOTAL = "total"


class CapScope(StrEnum):
    ORG = "org"
    KEY = "key"


_ADJECTIVE = {
    Period.DAY: "daily",
    Period.WEEK: "weekly",
    Period.MONTH: "monthly",
    Period.TOTAL: "all-time",
}


@dataclass(frozen=True, slots=True)
class SpendCap:
    """A cap as stored: on an org (``scope_id`` is its id) or on one of its keys (the key's)."""

    scope: CapScope
    scope_id: str
    org_id: str
    period: Period
    limit: int
    """Picodollars."""
    updated_at: int


@dataclass(frozen=True, slots=True)
class Window:
    """``[start, resets_at)`` in Unix seconds; all time is ``[0, None)``."""

    start: int
    resets_at: int | None


@dataclass(frozen=True, slots=True)
class CapUse:
    """A cap and what its current window holds, read in one statement."""

    cap: SpendCap
    window: Window
    charged: int
    """Picodollars charged in the window: by its batches so far, and GPU time (org caps)."""
    reserved: int
    """Picodollars its batches still hold reserved."""

    @property
    def used(self) -> int:
        return self.charged + self.reserved

    @property
    def left(self) -> int:
        return max(0, self.cap.limit - self.used)


def window(period: Period, now: float) -> Window:
    """The window of ``period`` that holds the instant ``now``."""
    if period == Period.TOTAL:
        return Window(0, None)
    day = int(now // DAY_S)
    if period == Period.DAY:
        return Window(day * DAY_S, (day + 1) * DAY_S)
    if period == Period.WEEK:
        monday = day - (day + _THURSDAY) % 7
        return Window(monday * DAY_S, (monday + 7) * DAY_S)
    at = datetime.fromtimestamp(day * DAY_S, UTC)
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    end = datetime(at.year + at.month // 12, at.month % 12 + 1, 1, tzinfo=UTC)
    return Window(int(start.timestamp()), int(end.timestamp()))


def iso(ts: int) -> str:
    """Unix seconds as ISO 8601 UTC, e.g. ``2026-06-01T00:00:00Z``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_period(value: object) -> Period:
    """A period from user input; a 400 naming the choices otherwise."""
    if isinstance(value, str):
        try:
            return Period(value)
        except ValueError:
            pass
    choices = ", ".join(p.value for p in Period)
    raise InvalidInput(
        f"'period' must be one of {choices} (it is {value!r}).",
        code="invalid_value",
        param="period",
    )


def parse_limit(usd: object) -> int:
    """A cap's limit from a USD string, in picodollars; a 400 naming ``usd`` otherwise."""
    bound = f'a cap is an amount of USD from 0 to {MAX_BALANCE_USD}, as a string (e.g. "100")'
    if not isinstance(usd, str):
        raise InvalidInput(f"'usd' is not valid: {bound}.", code="invalid_value", param="usd")
    try:
        limit = usd_to_pico(usd)
    except ValueError as exc:
        raise InvalidInput(f"{exc}; {bound}.", code="invalid_value", param="usd") from None
    if not 0 <= limit <= MAX_BALANCE:
        raise InvalidInput(f"{usd!r} is out of range; {bound}.", code="invalid_value", param="usd")
    return limit


def whose(cap: SpendCap) -> str:
    return "this organization's" if cap.scope == CapScope.ORG else f"API key {cap.scope_id}'s"


def describe(cap: SpendCap) -> str:
    """E.g. ``this organization's monthly spend cap of 100 USD``."""
    return f"{whose(cap)} {_ADJECTIVE[cap.period]} spend cap of {pico_to_usd(cap.limit)} USD"


def exceeded(use: CapUse, reserve: int, open_ended: bool) -> bool:
    """Whether a batch reserving ``reserve`` would take ``use``'s window past its cap. A batch
    billed by GPU time (``open_ended``) reserves nothing and has no bound: it is refused once
    the window has nothing left."""
    if open_ended:
        return use.used >= use.cap.limit
    if reserve == 0:
        return False  # a batch that costs nothing fits even a window already over its cap
    return use.used + reserve > use.cap.limit


def check_caps(uses: Sequence[CapUse], reserve: int, open_ended: bool, now: float) -> None:
    """Raise ``SpendCapReached`` for the cap that binds longest when the batch does not fit
    every cap; return when it fits them all."""
    over = [use for use in uses if exceeded(use, reserve, open_ended)]
    if not over:
        return
    # The cap that resets last decides when retrying can help; an all-time cap never resets,
    # and a cap the batch alone is over never helps either, whenever it resets.
    binding = max(
        over,
        key=lambda u: (
            u.window.resets_at is None or (not open_ended and reserve > u.cap.limit),
            u.window.resets_at or 0,
            u.cap.scope == CapScope.ORG,
        ),
    )
    raise refusal(binding, reserve, open_ended, now)


def refusal(use: CapUse, reserve: int, open_ended: bool, now: float) -> SpendCapReached:
    cap, resets_at = use.cap, use.window.resets_at
    since = "so far" if resets_at is None else f"since {iso(use.window.start)}"
    held = (
        f"{pico_to_usd(use.charged)} USD charged and {pico_to_usd(use.reserved)} USD still "
        f"reserved by what was created {since}, {pico_to_usd(use.left)} USD left"
    )
    if open_ended:
        need = (
            f"A batch billed by GPU time can start only while its spend caps have room, and "
            f"{describe(cap)} is reached: {held}."
        )
    else:
        need = (
            f"This batch needs up to {pico_to_usd(reserve)} USD for its worst case, which "
            f"would take {describe(cap)} past its limit: {held}."
        )
    wait: int | None = None
    room = " Room also comes back when a batch of the window ends for less than it reserved."
    if cap.limit == 0:
        after, room = " A cap of 0 USD stops all new batches; an administrator can raise it.", ""
    elif reserve > cap.limit:
        after, room = " The batch alone is over the cap: split the file or lower max_tokens.", ""
    elif resets_at is None:
        after = " An all-time cap does not reset; an administrator can raise it."
    else:
        wait = max(1, int(resets_at - now))
        after = f" The cap resets at {iso(resets_at)}."
    return SpendCapReached(
        f"{need}{after}{room} Nothing was queued and the input file can be used again.",
        retry_after_s=wait,
    )
