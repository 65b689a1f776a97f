"""Rerunning a batch's failed lines (SPEC §4.8): what a retry takes, where the lines are kept,
and the creation request a rerun amounts to.

A batch's accepted input is removed soon after it ends (SPEC §10.3), so the finalizer keeps
the request lines of every line that did not succeed in a blob of their own, the *rerun
input*, beside the error file: it is named after the error file, expires with it and is
removed with it. A retry uploads that blob again as a new input file and creates a batch
from it through the ordinary creation path.
"""

from __future__ import annotations

from typing import Any

import msgspec

from backfill.domain import batchrouter
from backfill.domain.batch_request import OutputExpiresAfter
from backfill.domain.files import content_key
from backfill.domain.records import BatchRecord

# What a retry body may name; anything else is refused (400), never ignored.
RETRY_FIELDS = ("completion_window", "metadata", "output_expires_after")


class RetryBatchRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The optional body of ``POST /v1/batches/{id}/retry``. A field left out is taken from
    the batch being rerun; ``metadata: null`` clears it."""

    completion_window: str | msgspec.UnsetType = msgspec.UNSET
    metadata: dict[str, str] | msgspec.UnsetType | None = msgspec.UNSET
    output_expires_after: OutputExpiresAfter | msgspec.UnsetType | None = msgspec.UNSET


def rerun_key(error_file_id: str) -> str:
    """The blob holding the request lines of the rows of error file ``error_file_id``."""
    return f"{content_key(error_file_id)}.rerun"


def rerun_creation(
    original: BatchRecord, retry: RetryBatchRequest, input_file_id: str, *, expanded: bool
) -> dict[str, Any]:
    """The ``POST /v1/batches`` body that reruns ``original`` from ``input_file_id``.

    ``expanded``: the input is the rerun input, plain JSONL whatever the original's format
    was, so an inherited ``batchrouter_input_format`` (which must match the file) is dropped.
    """
    metadata = original.metadata if retry.metadata is msgspec.UNSET else retry.metadata
    if expanded and metadata and batchrouter.INPUT_FORMAT in metadata:
        metadata = {k: v for k, v in metadata.items() if k != batchrouter.INPUT_FORMAT}
    if retry.output_expires_after is not msgspec.UNSET:
        expiry = retry.output_expires_after
    elif original.output_expires_after_s is not None:
        expiry = OutputExpiresAfter("created_at", original.output_expires_after_s)
    else:
        expiry = None
    window = original.completion_window
    if not isinstance(retry.completion_window, msgspec.UnsetType):
        window = retry.completion_window
    return {
        "input_file_id": input_file_id,
        "endpoint": original.endpoint,
        "completion_window": window,
        "metadata": metadata,
        "webhook_url": original.webhook_url,
        "output_expires_after": msgspec.to_builtins(expiry),
        # Its answers are checked as the original's were: a line that failed its schema is
        # rerun to get one that matches.
        "output_validation": original.output_validation,
    }
