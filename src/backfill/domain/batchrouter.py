"""BatchRouter Standard assignment fields in batch ``metadata`` (SPEC §8.2).

Keys starting with ``batchrouter_`` are the router's terms for the batch, so each is checked
strictly; every other key stays free-form. The terms may shorten a batch's deadline but never
change what it costs: rates in the metadata must be the published prices exactly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

from backfill.domain.durations import parse_go_or_iso_duration
from backfill.domain.files import InputFormat
from backfill.domain.money import PRICE_UNIT, Prices

PREFIX = "batchrouter_"
WORK_UNIT_ID = "batchrouter_work_unit_id"
DEADLINE = "batchrouter_deadline"
ASSIGNMENT_WINDOW = "batchrouter_assignment_window"
TIER = "batchrouter_tier"
ROLE = "batchrouter_role"
INPUT_RATE = "batchrouter_input_rate"
CACHED_INPUT_RATE = "batchrouter_cached_input_rate"
OUTPUT_RATE = "batchrouter_output_rate"
INPUT_FORMAT = "batchrouter_input_format"

SECTIONED_V1 = "sectioned.v1"
STANDARD = "standard"
MAX_WORK_UNIT_ID = 128
# A router assigns work for at most a day, whatever its deadline or window says.
MAX_ASSIGNMENT_S = 24 * 3600
# Less than a minute cannot be honoured: the batch would expire before it starts.
MIN_LEAD_S = 60

_WORK_UNIT_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_WORK_UNIT_ID}}}")
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# Plain decimal notation only: exponents and signs are not how anyone writes a price.
_DECIMAL = re.compile(r"[0-9]{1,20}(?:\.[0-9]{1,20})?")


class BatchRouterRefusal(ValueError):
    """One BatchRouter field that cannot be accepted; ``param`` names it as the API does."""

    def __init__(self, field: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code

    @property
    def param(self) -> str:
        return f"metadata.{self.field}"


@dataclass(frozen=True, slots=True)
class BatchTerms:
    """What a batch is, as far as its BatchRouter fields are checked against it."""

    created_at: int
    """Unix seconds, as the batch reports it."""
    window_end: int
    """When the completion window alone would end the batch."""
    revision: str
    """The pinned model revision (``model_config_id``), named in refusals."""
    prices: Prices | None
    """The revision's batch prices; None for a private deployment billed by GPU time."""
    input_format: InputFormat


def expires_at(metadata: Mapping[str, str] | None, terms: BatchTerms) -> int:
    """When the batch expires: ``terms.window_end`` for a batch without BatchRouter fields,
    else the effective BatchRouter deadline. Raises BatchRouterRefusal for the first field,
    in the body's order, that cannot be accepted."""
    fields = {k: v for k, v in (metadata or {}).items() if k.lower().startswith(PREFIX)}
    if not fields:
        return terms.window_end
    deadline: int | None = None
    window_s: float | None = None
    for key, value in fields.items():
        if key == DEADLINE:
            deadline = parse_deadline(value)
            _check_lead(deadline, terms.created_at)
        elif key == ASSIGNMENT_WINDOW:
            window_s = parse_window(value)
        else:
            check = _CHECKS.get(key)
            if check is None:
                raise _unknown(key)
            check(key, value, terms)
    if WORK_UNIT_ID not in fields:
        raise BatchRouterRefusal(
            WORK_UNIT_ID,
            f"'{WORK_UNIT_ID}' is required with any other BatchRouter field: the id of the work "
            f"unit this batch carries out (1 to {MAX_WORK_UNIT_ID} printable ASCII characters).",
            "missing_required_parameter",
        )
    return effective_deadline(terms.created_at, terms.window_end, deadline, window_s)


def effective_deadline(
    created_at: int, window_end: int, deadline: int | None, window_s: float | None
) -> int:
    """The earliest of the deadline, the assignment window's end, a day after creation and
    the completion window's end: BatchRouter may only shorten what the batch was given."""
    ends = [window_end, created_at + MAX_ASSIGNMENT_S]
    if deadline is not None:
        ends.append(deadline)
    if window_s is not None:
        # Whole seconds, rounded down: never later than the window allows.
        ends.append(created_at + int(window_s))
    return min(ends)


def parse_deadline(text: str) -> int:
    """Unix seconds of an RFC 3339 timestamp with its offset, fractions dropped (never later
    than asked)."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise BatchRouterRefusal(
            DEADLINE,
            f"'{DEADLINE}' must be an RFC 3339 timestamp with a time zone, such as "
            f"'2026-12-01T18:00:00Z' or '2026-12-01T19:00:00+01:00' (it is {text!r}).",
        )
    year, month, day, hour, minute, second = (int(g) for g in match.group(1, 2, 3, 4, 5, 6))
    sign, off_h, off_m = match.group(9, 10, 11)
    offset = UTC
    if sign is not None:
        if int(off_h) > 23 or int(off_m) > 59:
            raise BatchRouterRefusal(
                DEADLINE, f"'{DEADLINE}' {text!r} has a time zone offset beyond ±23:59."
            )
        span = timedelta(hours=int(off_h), minutes=int(off_m))
        offset = timezone(-span if sign == "-" else span)
    # RFC 3339 allows a leap second (:60); it is the instant after :59.
    leap = 1 if second == 60 else 0
    try:
        moment = datetime(year, month, day, hour, minute, second - leap, tzinfo=offset)
    except ValueError as exc:
        raise BatchRouterRefusal(
            DEADLINE, f"'{DEADLINE}' {text!r} is not a real date and time: {exc}."
        ) from None
    return int((moment - _EPOCH).total_seconds()) + leap


def parse_window(text: str) -> float:
    """Seconds in an assignment window (a Go or ISO 8601 duration), at least a minute."""
    try:
        seconds = parse_go_or_iso_duration(text)
    except ValueError as exc:
        raise BatchRouterRefusal(ASSIGNMENT_WINDOW, f"'{ASSIGNMENT_WINDOW}': {exc}.") from None
    if seconds < MIN_LEAD_S:
        raise BatchRouterRefusal(
            ASSIGNMENT_WINDOW,
            f"'{ASSIGNMENT_WINDOW}' must be at least {MIN_LEAD_S}s (it is {text!r}): the batch "
            "would expire before it could run.",
        )
    return seconds


def _check_lead(deadline: int, created_at: int) -> None:
    if deadline - created_at < MIN_LEAD_S:
        when = datetime.fromtimestamp(created_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        raise BatchRouterRefusal(
            DEADLINE,
            f"'{DEADLINE}' must be at least {MIN_LEAD_S}s after the batch is created ({when}); "
            "a deadline that has passed or is about to cannot be met.",
        )


def _unknown(key: str) -> BatchRouterRefusal:
    known = sorted([*_CHECKS, DEADLINE, ASSIGNMENT_WINDOW])
    if key.lower() in known:
        return BatchRouterRefusal(
            key, f"BatchRouter fields are lower case: send {key.lower()!r}, not {key!r}."
        )
    return BatchRouterRefusal(
        key,
        f"Unknown BatchRouter field {key!r}; the prefix '{PREFIX}' is reserved for the fields "
        f"Backfill takes: {known}. Rename the key to keep it as free-form metadata.",
    )


def _check_work_unit_id(key: str, value: str, terms: BatchTerms) -> None:
    if _WORK_UNIT_ID.fullmatch(value) is None:
        raise BatchRouterRefusal(
            key,
            f"'{key}' must be 1 to {MAX_WORK_UNIT_ID} printable ASCII characters without "
            f"spaces (it is {value[:40]!r}{'...' if len(value) > 40 else ''}).",
        )


def _check_standard(key: str, value: str, terms: BatchTerms) -> None:
    if value != STANDARD:
        raise BatchRouterRefusal(
            key,
            f"'{key}' must be '{STANDARD}' (it is {value!r}): Backfill serves only the "
            "BatchRouter Standard assignment.",
        )


def _check_input_format(key: str, value: str, terms: BatchTerms) -> None:
    if value != SECTIONED_V1:
        raise BatchRouterRefusal(
            key, f"'{key}' must be '{SECTIONED_V1}' or left out (it is {value!r})."
        )
    if terms.input_format != InputFormat.SECTIONED:
        raise BatchRouterRefusal(
            key,
            f"'{key}' is '{SECTIONED_V1}' but the input file was uploaded as "
            f"{terms.input_format.value!r}; upload the file in BatchRouter sectioned JSONL (first "
            f'line {{"format":"{InputFormat.SECTIONED.value}"}}) or leave the field out.',
        )


def _rate_check(price: Callable[[Prices], int], name: str) -> _Check:
    def check(key: str, value: str, terms: BatchTerms) -> None:
        if terms.prices is None:
            raise BatchRouterRefusal(
                key,
                f"'{key}' cannot be met: {terms.revision} is a private deployment billed by GPU "
                "time, which has no token prices. Leave the rates out.",
            )
        published = price(terms.prices)
        if _DECIMAL.fullmatch(value) is None:
            raise BatchRouterRefusal(
                key,
                f"'{key}' must be a decimal number in {PRICE_UNIT}, such as '{published}' (it "
                f"is {value!r}).",
            )
        if Decimal(value) != published:
            raise BatchRouterRefusal(
                key,
                f"'{key}' is {value!r} but the published batch {name} price of "
                f"{terms.revision} is {published} {PRICE_UNIT} (GET /v1/models); metadata never "
                f"overrides prices. Send '{published}' or leave the field out.",
            )

    return check


_Check = Callable[[str, str, BatchTerms], None]

# Every field but the deadline and the window, which also feed the effective deadline.
_CHECKS: dict[str, _Check] = {
    WORK_UNIT_ID: _check_work_unit_id,
    TIER: _check_standard,
    ROLE: _check_standard,
    INPUT_RATE: _rate_check(lambda p: p.input, "input"),
    CACHED_INPUT_RATE: _rate_check(lambda p: p.cached_input, "cached input"),
    OUTPUT_RATE: _rate_check(lambda p: p.output, "output"),
    INPUT_FORMAT: _check_input_format,
}
