"""What an engine's reply means for Backfill: the outcome row it becomes, the usage it
reports, its error body."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from backfill.domain import ids
from backfill.domain.embeddings import Requested, conform
from backfill.domain.money import MAX_TOKENS
from backfill.domain.output_schema import Expected, mismatch
from backfill.domain.results import (
    ERROR_MESSAGES,
    error_row,
    http_error_row,
    mismatch_row,
    success_row,
)

_NOT_JSON = {
    "error": {
        "message": "The engine answered 200 with a body that is not JSON.",
        "type": "engine_error",
    }
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended: its output or error row (not yet sealed) and its usage."""

    ok: bool
    row: bytes
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    request_id: str | None = None
    billed: bool = False
    """Failed, and charged all the same (``ItemResult.billed``)."""


def failed(custom_id: str, code: str, message: str | None = None) -> Outcome:
    """An error row with one of Backfill's own codes."""
    return Outcome(False, error_row(custom_id, code, message or ERROR_MESSAGES[code]))


def engine_error(custom_id: str, status: int, raw: bytes) -> Outcome:
    """The engine's own HTTP error, kept as it answered."""
    return Outcome(False, http_error_row(custom_id, status, json_or_text(raw)))


def succeeded(
    custom_id: str,
    raw: bytes,
    embeddings: Requested | None = None,
    expected: Expected | None = None,
) -> Outcome:
    """A 200 reply: its body as the engine answered it (``model`` too: the name the engine
    answered under, whatever name or alias the line used), with the usage it reports; an
    embeddings answer reshaped as its request asked (``domain/embeddings.py``).

    ``expected``: what the answer must be (a batch with ``output_validation``); one that is
    not becomes an ``output_schema_mismatch`` error row that keeps the answer and is charged
    as the engine produced it, so rerunning the batch's failed lines reruns it."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Outcome(False, http_error_row(custom_id, 502, _NOT_JSON))
    if embeddings is not None:
        conform(body, embeddings)
    usage = usage_of(body)
    request_id = ids.request_id()
    why = None if expected is None else mismatch(expected, body)
    if why is None:
        row = success_row(custom_id, 200, body, request_id)
    else:
        row = mismatch_row(custom_id, body, request_id, why)
    return Outcome(
        why is None,
        row,
        input_tokens=usage[0],
        output_tokens=usage[1],
        cached_tokens=usage[2],
        request_id=request_id,
        billed=why is not None,
    )


def usage_of(body: Any) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens the engine reported; zeros when absent.

    Chat, completions and embeddings replies count ``prompt_tokens`` (embeddings have no
    completion tokens); Responses replies count ``input_tokens`` and ``output_tokens``."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    if "input_tokens" in usage:
        details = usage.get("input_tokens_details")
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    else:
        details = usage.get("prompt_tokens_details")
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return _tokens(prompt), _tokens(completion), _tokens(cached)


def _tokens(value: Any) -> int:
    """One usage count as Backfill stores and bills it, from 0 to MAX_TOKENS: the engine is
    not trusted, and a count past the columns' range would fail the whole group commit while
    a negative one would credit the org."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return 0
    return min(max(int(value), 0), MAX_TOKENS)


def json_or_text(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"error": {"message": raw[:2000].decode(errors="replace"), "type": "engine_error"}}
