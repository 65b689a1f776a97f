"""What ``POST /v1/batches`` takes (SPEC §4.1), as a typed request."""

from __future__ import annotations

from typing import Literal

import msgspec

DEFAULT_COMPLETION_WINDOW = "24h"


class OutputExpiresAfter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Another key here would be accepted and then ignored: refused like any unknown field.
    anchor: Literal["created_at"]
    seconds: int


class CreateBatchRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str = DEFAULT_COMPLETION_WINDOW
    metadata: dict[str, str] | None = None
    # Checked against the webhook address rules when the batch is created (SPEC §10.4).
    webhook_url: str | None = None
    output_expires_after: OutputExpiresAfter | None = None
    # Extra body fields (Backfill's own): the batch's priority within its org, and whether each
    # answer is checked against its line's response_format schema.
    priority: int = 0
    output_validation: bool = False
