"""Rerun rules without I/O: the creation a retry amounts to, and how the rerun input is read."""

from __future__ import annotations

import msgspec

from backfill.domain.batch_request import CreateBatchRequest
from backfill.domain.lifecycle import BatchStatus
from backfill.domain.records import BatchRecord
from backfill.domain.reruns import RetryBatchRequest, rerun_creation, rerun_key
from backfill.runner.rerun_input import spans

MIB = 1 << 20


def original(**changes: object) -> BatchRecord:
    record = BatchRecord(
        id="batch_1",
        org_id="org_1",
        endpoint="/v1/chat/completions",
        model="m",
        model_config_id="m-v1",
        input_file_id="file-in",
        completion_window="48h",
        status=BatchStatus.CANCELLED,
        created_at=1,
        expires_at=2,
        total=3,
        metadata={"team": "evals", "batchrouter_input_format": "sectioned.v1"},
        output_expires_after_s=7200,
    )
    for name, value in changes.items():
        setattr(record, name, value)
    return record


def creation(retry: RetryBatchRequest, *, expanded: bool = True) -> CreateBatchRequest:
    body = rerun_creation(original(), retry, "file-rerun", expanded=expanded)
    return msgspec.convert(body, CreateBatchRequest)


def test_a_retry_without_fields_takes_the_batchs_own() -> None:
    made = creation(RetryBatchRequest())
    assert made.input_file_id == "file-rerun"
    assert made.endpoint == "/v1/chat/completions"
    assert made.completion_window == "48h"
    # The rerun input is plain JSONL: the sectioned-format field would no longer match it.
    assert made.metadata == {"team": "evals"}
    assert made.output_expires_after is not None
    assert made.output_expires_after.seconds == 7200


def test_a_rerun_checks_its_answers_as_the_batch_did() -> None:
    assert creation(RetryBatchRequest()).output_validation is False
    body = rerun_creation(
        original(output_validation=True), RetryBatchRequest(), "file-rerun", expanded=True
    )
    assert msgspec.convert(body, CreateBatchRequest).output_validation is True


def test_the_original_input_keeps_its_format_field() -> None:
    made = creation(RetryBatchRequest(), expanded=False)
    assert made.metadata == {"team": "evals", "batchrouter_input_format": "sectioned.v1"}


def test_retry_fields_override_and_null_clears() -> None:
    retry = msgspec.convert(
        {"completion_window": "24h", "metadata": None, "output_expires_after": None},
        RetryBatchRequest,
    )
    made = creation(retry)
    assert (made.completion_window, made.metadata, made.output_expires_after) == (
        "24h",
        None,
        None,
    )


def test_the_rerun_input_is_named_after_the_error_file() -> None:
    assert rerun_key("file-err") == "files/file-err.rerun"


def test_spans_read_neighbours_together_and_stay_bounded() -> None:
    lines = [(0, 10), (20, 10), (5 * MIB, 10), (5 * MIB + 30, 0), (6 * MIB, 9 * MIB)]
    assert list(spans(lines)) == [
        (0, 30, [(0, 10), (20, 10)]),
        (5 * MIB, 5 * MIB + 10, [(5 * MIB, 10)]),
        # A line longer than the span cap is read alone.
        (6 * MIB, 15 * MIB, [(6 * MIB, 9 * MIB)]),
    ]
    many = [(i * 1000, 1000) for i in range(20_000)]
    reads = list(spans(many))
    assert all(end - start <= 8 * MIB for start, end, _ in reads)
    assert [line for _, _, group in reads for line in group] == many
