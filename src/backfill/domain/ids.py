"""Identifiers in the shapes OpenAI clients expect."""

from __future__ import annotations

import secrets
import time


def _token() -> str:
    return secrets.token_hex(12)


def _ordered_token() -> str:
    """24 hex digits that sort by creation time (milliseconds, then 48 random bits): ids
    stored as a primary key by the million go in at the end of its index instead of on a
    random page of it, so storing one does not get slower as the table grows."""
    return f"{time.time_ns() // 1_000_000:012x}{secrets.token_hex(6)}"


def file_id() -> str:
    return f"file-{_token()}"


def batch_id() -> str:
    return f"batch_{_token()}"


def batch_request_id() -> str:
    return f"batch_req_{_token()}"


def request_id() -> str:
    # The key of every receipt (SPEC §7.3): one per request served.
    return f"req_{_ordered_token()}"


def org_id() -> str:
    return f"org_{_token()}"


def lease_token() -> str:
    return secrets.token_hex(8)


# The width of every id column; also the bound on a key id an admin may name.
MAX_ID_CHARS = 64


def plausible(value: str, max_chars: int = MAX_ID_CHARS) -> bool:
    """Whether ``value`` could be an id or a name at all. Anything else (empty, huge, NUL or
    other control characters) is simply not found, without asking the database (PostgreSQL
    refuses NUL in text, for one)."""
    return 0 < len(value) <= max_chars and value.isprintable()
