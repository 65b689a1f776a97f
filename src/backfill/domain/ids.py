"""Identifiers in the shapes OpenAI clients expect."""

from __future__ import annotations

import secrets


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


def lease_token() -> str:
    return secrets.token_hex(8)
