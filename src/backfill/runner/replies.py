"""What an engine's reply means for Backfill: the usage it reports, its error body."""

from __future__ import annotations

import math
from typing import Any

import orjson

from backfill.domain.money import MAX_TOKENS


def usage_of(body: Any) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens the engine reported; zeros when absent."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return (
        _tokens(usage.get("prompt_tokens")),
        _tokens(usage.get("completion_tokens")),
        _tokens(cached),
    )


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
