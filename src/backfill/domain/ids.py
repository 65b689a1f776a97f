"""Identifiers in the shapes OpenAI clients expect."""

from __future__ import annotations

import secrets
import uuid


def _token() -> str:
    return secrets.token_hex(12)


def file_id() -> str:
    return f"file-{_token()}"


def batch_id() -> str:
    return f"batch_{_token()}"


def batch_request_id() -> str:
    return f"batch_req_{_token()}"


def request_id() -> str:
    return f"req_{_token()}"


def org_id() -> str:
    return f"org_{_token()}"


def key_id() -> str:
    return f"key_{secrets.token_hex(8)}"


def credit_id() -> str:
    return f"cr_{uuid.uuid4().hex}"


def lease_token() -> str:
    return secrets.token_hex(8)


# The width of every id column; also the bound on a key id an admin may name.
MAX_ID_CHARS = 64


def plausible(value: str, max_chars: int = MAX_ID_CHARS) -> bool:
    """Whether ``value`` could be an id or a name at all. Anything else (empty, huge, NUL or
    other control characters) is simply not found, without asking the database (PostgreSQL
    refuses NUL in text, for one)."""
    return 0 < len(value) <= max_chars and value.isprintable()


def message_id() -> str:
    """A notification's id: the ``webhook-id`` of every attempt to deliver it."""
    return f"msg_{_token()}"


def event_id() -> str:
    return f"evt_{_token()}"


def webhook_endpoint_id() -> str:
    return f"we_{_token()}"
