"""BatchRouter assignment fields in batch metadata: each field's rules and the effective
deadline (SPEC §8.2)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.domain.batchrouter import (
    MAX_ASSIGNMENT_S,
    BatchRouterRefusal,
    BatchTerms,
    effective_deadline,
    expires_at,
    parse_deadline,
    parse_window,
)
from backfill.domain.durations import parse_go_or_iso_duration
from backfill.domain.files import InputFormat
from backfill.domain.money import Prices

# 2026-06-01T12:00:00Z
CREATED = 1_780_315_200
HOUR = 3600
DAY = 24 * HOUR
PRICES = Prices(input=100_000, cached_input=50_000, output=400_000)
TERMS = BatchTerms(
    created_at=CREATED,
    window_end=CREATED + 7 * DAY,
    revision="sim-model-v1",
    prices=PRICES,
    input_format=InputFormat.JSONL,
)
ID = {"batchrouter_work_unit_id": "wu-42"}


def iso(unix: int) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def refusal(metadata: dict[str, str], terms: BatchTerms = TERMS) -> BatchRouterRefusal:
    with pytest.raises(BatchRouterRefusal) as info:
        expires_at(metadata, terms)
    return info.value


def assert_refused(
    metadata: dict[str, str], field: str, *words: str, terms: BatchTerms = TERMS
) -> BatchRouterRefusal:
    exc = refusal(metadata, terms)
    assert exc.param == f"metadata.{field}"
    assert exc.field == field
    assert exc.code == "invalid_value"
    for word in (field, *words):
        assert word in exc.message, exc.message
    return exc


# ---- metadata without BatchRouter fields ------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [None, {}, {"description": "nightly eval"}, {"router": "x", "batch_router": "y"}],
)
def test_free_form_metadata_keeps_the_completion_window(metadata: dict[str, str] | None) -> None:
    assert expires_at(metadata, TERMS) == TERMS.window_end


def test_free_form_keys_beside_batchrouter_fields_are_left_alone() -> None:
    metadata = {**ID, "description": "nightly eval", "owner": "team a"}
    assert expires_at(metadata, TERMS) == CREATED + DAY


# ---- work unit id -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["a", "wu-42", "x" * 128, "!~#$%&'()*+,-./:;<=>?@[]^_`{|}"])
def test_work_unit_id_accepted(value: str) -> None:
    assert expires_at({"batchrouter_work_unit_id": value}, TERMS) == CREATED + DAY


@pytest.mark.parametrize(
    "value", ["", "x" * 129, "has space", "tab\there", "new\nline", "caf\u00e9", "\x7f", " lead"]
)
def test_work_unit_id_refused(value: str) -> None:
    assert_refused({"batchrouter_work_unit_id": value}, "batchrouter_work_unit_id", "printable")


@pytest.mark.parametrize(
    "field",
    [
        "batchrouter_deadline",
        "batchrouter_assignment_window",
        "batchrouter_tier",
        "batchrouter_role",
        "batchrouter_input_rate",
        "batchrouter_input_format",
    ],
)
def test_any_batchrouter_field_needs_the_work_unit_id(field: str) -> None:
    valid = {
        "batchrouter_deadline": iso(CREATED + HOUR),
        "batchrouter_assignment_window": "6h",
        "batchrouter_tier": "standard",
        "batchrouter_role": "standard",
        "batchrouter_input_rate": "100000",
        "batchrouter_input_format": "sectioned.v1",
    }
    terms = replace(TERMS, input_format=InputFormat.SECTIONED)
    exc = refusal({field: valid[field]}, terms)
    assert exc.param == "metadata.batchrouter_work_unit_id"
    assert exc.code == "missing_required_parameter"
    assert "required" in exc.message


# ---- deadline ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "unix"),
    [
        ("2026-06-01T13:00:00Z", CREATED + HOUR),
        ("2026-06-01t13:00:00z", CREATED + HOUR),
        ("2026-06-01T14:00:00+01:00", CREATED + HOUR),
        ("2026-06-01T08:30:00-04:30", CREATED + HOUR),
        ("2026-06-01T13:00:00-00:00", CREATED + HOUR),
        ("2026-06-01T13:00:00.999999Z", CREATED + HOUR),
        ("2026-06-01T13:00:00.5+00:00", CREATED + HOUR),
        ("2026-06-01T12:59:60Z", CREATED + HOUR),
        ("2026-06-02T11:00:00+23:59", CREATED - 59 * 60),
    ],
)
def test_deadline_parses_rfc3339_with_any_offset(text: str, unix: int) -> None:
    assert parse_deadline(text) == unix


@pytest.mark.parametrize(
    "text",
    [
        "",
        "2026-06-01",
        "2026-06-01T13:00:00",  # no time zone
        "2026-06-01 13:00:00Z",
        "2026-06-01T13:00Z",
        "2026-06-01T13:00:00+0100",
        "2026-06-01T13:00:00+01",
        "20260601T130000Z",
        "1780318800",
        "tomorrow",
        "2026-06-01T13:00:00Z\n",
        "2026-06-01T13:00:00.Z",
        "2026-06-01T13:00:00.1234567890Z",
    ],
)
def test_deadline_must_be_rfc3339(text: str) -> None:
    exc = assert_refused({**ID, "batchrouter_deadline": text}, "batchrouter_deadline", "RFC 3339")
    assert "2026-12-01T18:00:00Z" in exc.message


@pytest.mark.parametrize(
    "text",
    [
        "2026-02-30T12:00:00Z",
        "2026-13-01T12:00:00Z",
        "2026-06-01T24:00:00Z",
        "2026-06-01T12:60:00Z",
        "0000-01-01T00:00:00Z",
    ],
)
def test_deadline_must_be_a_real_date(text: str) -> None:
    assert_refused({**ID, "batchrouter_deadline": text}, "batchrouter_deadline", "real date")


@pytest.mark.parametrize("text", ["2026-06-01T13:00:00+24:00", "2026-06-01T13:00:00-05:60"])
def test_deadline_offset_is_bounded(text: str) -> None:
    assert_refused({**ID, "batchrouter_deadline": text}, "batchrouter_deadline", "offset")


@pytest.mark.parametrize("lead", [59, 0, -1, -DAY])
def test_deadline_needs_a_minute_of_lead(lead: int) -> None:
    exc = assert_refused(
        {**ID, "batchrouter_deadline": iso(CREATED + lead)}, "batchrouter_deadline", "60s"
    )
    assert iso(CREATED) in exc.message


def test_deadline_a_minute_ahead_is_taken() -> None:
    metadata = {**ID, "batchrouter_deadline": iso(CREATED + 60)}
    assert expires_at(metadata, TERMS) == CREATED + 60


# ---- assignment window ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90m", 5400),
        ("6h", 6 * HOUR),
        ("1h30m", 5400),
        ("3600s", 3600),
        ("1h30m0s", 5400),
        ("1.5h", 5400),
        ("60s", 60),
        ("PT6H", 6 * HOUR),
        ("PT90M", 5400),
        ("PT1H30M", 5400),
        ("PT3600S", 3600),
        ("P1D", DAY),
        ("P1DT6H", 30 * HOUR),
        ("P2W", 14 * DAY),
    ],
)
def test_assignment_window_takes_go_and_iso_durations(text: str, seconds: int) -> None:
    assert parse_window(text) == seconds
    assert parse_go_or_iso_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "",
        "6",
        "6 h",
        "6H",
        "pt6h",
        "1d",
        "-1h",
        "+1h",
        "30m1h",
        "1h1h",
        "P",
        "PT",
        "P1DT",
        "P1Y",
        "P1M",
        "PT1.5H",
        "6h\n",
        "99999999999h",
    ],
)
def test_assignment_window_refuses_what_is_not_a_duration(text: str) -> None:
    exc = assert_refused(
        {**ID, "batchrouter_assignment_window": text}, "batchrouter_assignment_window", "PT6H"
    )
    assert "'90m'" in exc.message


@pytest.mark.parametrize("text", ["0s", "PT0S", "0h0m"])
def test_assignment_window_must_be_positive(text: str) -> None:
    assert_refused(
        {**ID, "batchrouter_assignment_window": text}, "batchrouter_assignment_window", "positive"
    )


@pytest.mark.parametrize("text", ["59s", "PT59S", "59999ms"])
def test_assignment_window_of_under_a_minute_is_refused(text: str) -> None:
    assert_refused(
        {**ID, "batchrouter_assignment_window": text}, "batchrouter_assignment_window", "60s"
    )


# ---- tier, role, input format -----------------------------------------------------------------


@pytest.mark.parametrize("field", ["batchrouter_tier", "batchrouter_role"])
def test_tier_and_role_are_standard_only(field: str) -> None:
    assert expires_at({**ID, field: "standard"}, TERMS) == CREATED + DAY
    for value in ["priority", "Standard", "", "standard "]:
        assert_refused({**ID, field: value}, field, "'standard'")


def test_sectioned_input_format_needs_a_sectioned_file() -> None:
    sectioned = replace(TERMS, input_format=InputFormat.SECTIONED)
    metadata = {**ID, "batchrouter_input_format": "sectioned.v1"}
    assert expires_at(metadata, sectioned) == CREATED + DAY
    exc = assert_refused(
        metadata, "batchrouter_input_format", "'jsonl'", "batchrouter.sectioned.v1"
    )
    assert "leave the field out" in exc.message


def test_a_sectioned_file_needs_no_input_format_field() -> None:
    sectioned = replace(TERMS, input_format=InputFormat.SECTIONED)
    assert expires_at(ID, sectioned) == CREATED + DAY


@pytest.mark.parametrize("value", ["jsonl", "sectioned.v2", "batchrouter.sectioned.v1", ""])
def test_input_format_takes_only_sectioned_v1(value: str) -> None:
    sectioned = replace(TERMS, input_format=InputFormat.SECTIONED)
    assert_refused(
        {**ID, "batchrouter_input_format": value},
        "batchrouter_input_format",
        "'sectioned.v1'",
        terms=sectioned,
    )


# ---- rates ------------------------------------------------------------------------------------

RATES = {
    "batchrouter_input_rate": "100000",
    "batchrouter_cached_input_rate": "50000",
    "batchrouter_output_rate": "400000",
}


def test_published_rates_are_accepted_as_exact_decimals() -> None:
    assert expires_at({**ID, **RATES}, TERMS) == CREATED + DAY
    spelled = {
        "batchrouter_input_rate": "100000.0",
        "batchrouter_cached_input_rate": "050000",
        "batchrouter_output_rate": "400000.000000",
    }
    assert expires_at({**ID, **spelled}, TERMS) == CREATED + DAY


@pytest.mark.parametrize(
    ("field", "value", "published"),
    [
        ("batchrouter_input_rate", "100001", "100000"),
        ("batchrouter_input_rate", "99999.99", "100000"),
        ("batchrouter_input_rate", "100000." + "0" * 19 + "1", "100000"),
        ("batchrouter_cached_input_rate", "100000", "50000"),
        ("batchrouter_output_rate", "0", "400000"),
    ],
)
def test_a_rate_other_than_the_published_price_is_refused(
    field: str, value: str, published: str
) -> None:
    exc = assert_refused(
        {**ID, field: value}, field, repr(value), published, "microusd_per_million_tokens"
    )
    assert "never overrides prices" in exc.message
    assert "sim-model-v1" in exc.message


@pytest.mark.parametrize("value", ["", "1e5", "-100000", "+100000", "0x186a0", "NaN", "1,000", "."])
def test_a_rate_must_be_a_plain_decimal(value: str) -> None:
    assert_refused({**ID, "batchrouter_input_rate": value}, "batchrouter_input_rate", "decimal")


@pytest.mark.parametrize("field", sorted(RATES))
def test_rates_are_refused_for_gpu_time_billing(field: str) -> None:
    private = replace(TERMS, prices=None)
    assert expires_at(ID, private) == CREATED + DAY
    assert_refused({**ID, field: RATES[field]}, field, "GPU time", terms=private)


# ---- unknown fields ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["batchrouter_priority", "batchrouter_", "batchrouter_deadline_2"])
def test_unknown_batchrouter_keys_are_refused_by_name(key: str) -> None:
    exc = assert_refused({**ID, key: "x"}, key, "Unknown")
    assert "batchrouter_deadline" in exc.message


@pytest.mark.parametrize("key", ["BatchRouter_deadline", "BATCHROUTER_TIER"])
def test_batchrouter_keys_in_another_case_are_refused(key: str) -> None:
    exc = assert_refused({**ID, key: "standard"}, key, key.lower(), "lower case")
    assert exc.param == f"metadata.{key}"


def test_the_first_bad_field_in_the_body_is_reported() -> None:
    metadata = {**ID, "batchrouter_tier": "gold", "batchrouter_role": "lead"}
    assert refusal(metadata).field == "batchrouter_tier"
    assert refusal(dict(reversed(metadata.items()))).field == "batchrouter_role"


# ---- the effective deadline -------------------------------------------------------------------


def test_deadline_before_the_window_wins() -> None:
    metadata = {
        **ID,
        "batchrouter_deadline": iso(CREATED + 2 * HOUR),
        "batchrouter_assignment_window": "6h",
    }
    assert expires_at(metadata, TERMS) == CREATED + 2 * HOUR


def test_window_before_the_deadline_wins() -> None:
    metadata = {
        **ID,
        "batchrouter_deadline": iso(CREATED + 10 * HOUR),
        "batchrouter_assignment_window": "PT90M",
    }
    assert expires_at(metadata, TERMS) == CREATED + 90 * 60


@pytest.mark.parametrize(
    "metadata",
    [
        {"batchrouter_deadline": iso(CREATED + 3 * DAY)},
        {"batchrouter_assignment_window": "48h"},
        {"batchrouter_deadline": iso(CREATED + 30 * HOUR), "batchrouter_assignment_window": "P2D"},
        {},
    ],
)
def test_a_day_caps_the_deadline_rather_than_refusing_it(metadata: dict[str, str]) -> None:
    assert expires_at({**ID, **metadata}, TERMS) == CREATED + MAX_ASSIGNMENT_S


def test_the_completion_window_is_never_lengthened() -> None:
    short = replace(TERMS, window_end=CREATED + HOUR)
    metadata = {**ID, "batchrouter_deadline": iso(CREATED + 2 * HOUR)}
    assert expires_at(metadata, short) == CREATED + HOUR
    assert expires_at({**ID, "batchrouter_assignment_window": "6h"}, short) == CREATED + HOUR


def test_fractional_windows_round_down() -> None:
    assert expires_at({**ID, "batchrouter_assignment_window": "90.9s"}, TERMS) == CREATED + 90


def test_metadata_values_are_not_changed() -> None:
    metadata = {**ID, "batchrouter_deadline": iso(CREATED + HOUR), "note": "kept"}
    before = dict(metadata)
    expires_at(metadata, TERMS)
    assert metadata == before


# Any instant from 2000 to 2100, as created_at.
created_ats = st.integers(min_value=946_684_800, max_value=4_102_444_800)


@given(
    created=created_ats,
    window=st.integers(min_value=60, max_value=30 * DAY),
    deadline_lead=st.none() | st.integers(min_value=60, max_value=400 * DAY),
    assignment=st.none() | st.floats(min_value=60, max_value=1e9, allow_nan=False),
)
def test_effective_deadline_is_within_every_bound(
    created: int, window: int, deadline_lead: int | None, assignment: float | None
) -> None:
    deadline = None if deadline_lead is None else created + deadline_lead
    end = effective_deadline(created, created + window, deadline, assignment)
    assert created + 60 <= end <= created + MAX_ASSIGNMENT_S
    assert end <= created + window
    if deadline is not None:
        assert end <= deadline
    if assignment is not None:
        assert end <= created + assignment
    bounds = {
        created + window,
        created + MAX_ASSIGNMENT_S,
        deadline,
        created + int(assignment or 0),
    }
    assert end in bounds


@given(
    created=created_ats,
    deadline_lead=st.integers(min_value=60, max_value=400 * DAY),
    offset_minutes=st.integers(min_value=-(23 * 60 + 59), max_value=23 * 60 + 59),
    hours=st.integers(min_value=0, max_value=200),
    minutes=st.integers(min_value=0, max_value=200),
)
def test_written_metadata_gives_the_same_deadline(
    created: int, deadline_lead: int, offset_minutes: int, hours: int, minutes: int
) -> None:
    """Whatever offset the deadline is written in and whichever form the window takes."""
    deadline = created + deadline_lead
    sign = "-" if offset_minutes < 0 else "+"
    shifted = datetime.fromtimestamp(deadline + offset_minutes * 60, UTC)
    stamp = shifted.strftime("%Y-%m-%dT%H:%M:%S") + (
        f"{sign}{abs(offset_minutes) // 60:02d}:{abs(offset_minutes) % 60:02d}"
    )
    assert parse_deadline(stamp) == deadline
    window_s = hours * HOUR + minutes * 60
    terms = replace(TERMS, created_at=created, window_end=created + 7 * DAY)
    expected = effective_deadline(created, created + 7 * DAY, deadline, window_s or None)
    for window in [f"{hours}h{minutes}m", f"PT{hours}H{minutes}M"] if window_s >= 60 else []:
        metadata = {**ID, "batchrouter_deadline": stamp, "batchrouter_assignment_window": window}
        assert expires_at(metadata, terms) == expected
        assert expected <= min(deadline, created + window_s, created + MAX_ASSIGNMENT_S)
