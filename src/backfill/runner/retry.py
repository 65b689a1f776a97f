"""Which engine outcomes are worth retrying, and how long to wait (SPEC §9.2)."""

from __future__ import annotations

import random

# SPEC §9.2: connection errors, timeouts, 408, 429 and 5xx are transient; other 4xx are final.
TRANSIENT_STATUSES = frozenset({408, 429})


def is_transient(status: int) -> bool:
    return status in TRANSIENT_STATUSES or status >= 500


def backoff_s(
    attempt: int,
    base_s: float,
    max_s: float,
    retry_after_s: float | None,
    rng: random.Random,
) -> float:
    """Exponential backoff with full jitter, never shorter than the engine's Retry-After."""
    ceiling = min(max_s, base_s * (2 ** max(0, attempt - 1)))
    delay = rng.uniform(ceiling / 2, ceiling)
    if retry_after_s is not None:
        delay = max(delay, retry_after_s)
    return delay
