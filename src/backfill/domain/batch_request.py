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
    # Backfill sends no webhooks, so only null is taken: a caller counting on a notification
    # learns at once that none will come.
    webhook_url: None = None
    output_expires_after: OutputExpiresAfter | None = None
