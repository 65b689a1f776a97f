"""The simulated model, its prices, and request lines for it."""

from __future__ import annotations

from typing import Any

import orjson

from backfill.settings import PricingSettings

SIM_MODEL = "sim-model"
# Batch prices of the simulated model, microdollars per million tokens.
SIM_PRICES = PricingSettings(input=100_000, cached_input=50_000, output=400_000)
STARTING_CREDIT_USD = "1000"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def chat_line(
    custom_id: str,
    content: str = "hello",
    *,
    model: str = SIM_MODEL,
    max_tokens: int = 16,
    **body: Any,
) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)
