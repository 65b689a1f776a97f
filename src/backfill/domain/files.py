"""What a file is: its purposes and statuses, where its bytes live, and how long it is kept."""

from __future__ import annotations

from enum import StrEnum


class FilePurpose(StrEnum):
    BATCH = "batch"
    """An uploaded input file."""
    BATCH_OUTPUT = "batch_output"
    """A batch's output or error file."""


class FileStatus(StrEnum):
    PROCESSED = "processed"
    """Validated (inputs) or written (outputs): readable."""
    DELETED = "deleted"
    """Its content is gone; the row stays so ids are never reused."""


# An accepted batch keeps its input at least this long past its deadline: a batch that ends
# early lets it go at once (``input_expires_at`` at publish), one that runs late still has it.
ACCEPTED_INPUT_GRACE_S = 24 * 3600


def content_key(file_id: str) -> str:
    """The blob holding a file's bytes."""
    return f"files/{file_id}"


def index_key(file_id: str) -> str:
    """The blob holding an input file's line index (``LineIndex``)."""
    return f"files/{file_id}.index"


def input_expiry_at_publish(current: int | None, now: int) -> int:
    """When a finished batch's input may go: now, unless it was due to go sooner. The janitor
    still keeps it while another unfinished batch reads it."""
    return now if current is None else min(current, now)
