"""Failures inside the worker itself (storage, the database), as opposed to engine failures.

A request whose input cannot be read or whose result cannot be stored must neither wedge the
batch nor be retried in a hot loop: each batch backs off while its requests keep failing, and
one cause is logged once with its traceback, then counted and summarised.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from backfill.errors import ContentUnreadable, NotFound
from backfill.runner.retry import backoff_s

log = logging.getLogger("backfill.runner")

# Past this many failures in a row the backoff is at its ceiling anyway; capping the exponent
# keeps the arithmetic finite.
_MAX_STREAK = 32


def is_permanent(exc: BaseException) -> bool:
    """Stored input that is gone, damaged or sealed under another key: no retry can read it."""
    return isinstance(exc, ContentUnreadable | NotFound)


@dataclass
class WorkerFailures:
    """Backoff per batch and rate-limited logs per (batch, cause)."""

    base_s: float
    max_s: float
    summary_every_s: float = 60.0
    rng: random.Random = field(default_factory=random.Random)
    _streak: Counter[str] = field(default_factory=Counter)
    _unlogged: Counter[tuple[str, str]] = field(default_factory=Counter)
    _last_summary: float = field(default_factory=time.monotonic)

    def transient(self, batch_id: str, idx: int, exc: BaseException) -> float:
        """Note a failure worth retrying; returns how long the item waits before a new claim."""
        self._streak[batch_id] = streak = min(self._streak[batch_id] + 1, _MAX_STREAK)
        self._note(batch_id, idx, exc, "released; it will be retried")
        return backoff_s(streak, self.base_s, self.max_s, None, self.rng)

    def permanent(self, batch_id: str, idx: int, exc: BaseException) -> None:
        self._note(batch_id, idx, exc, "its input cannot be read; it ends as input_unavailable")

    def succeeded(self, batch_id: str) -> None:
        if self._streak:
            self._streak.pop(batch_id, None)

    def forget(self, batch_id: str) -> None:
        self._streak.pop(batch_id, None)

    def _note(self, batch_id: str, idx: int, exc: BaseException, what: str) -> None:
        key = (batch_id, exc.__class__.__name__)
        if key in self._unlogged:
            self._unlogged[key] += 1
            return
        self._unlogged[key] = 0
        log.warning(
            "request %s of %s failed inside the worker (%s); further failures of this batch "
            "with the same cause are counted and summarised",
            idx,
            batch_id,
            what,
            exc_info=exc,
        )

    def summarise(self) -> None:
        """Log how often each cause recurred since the last summary, at most once a period."""
        now = time.monotonic()
        if now - self._last_summary < self.summary_every_s:
            return
        self._last_summary = now
        for (batch_id, cause), count in sorted(self._unlogged.items()):
            if count:
                log.warning(
                    "%d more requests of %s failed inside the worker with %s in the last %.0f s",
                    count,
                    batch_id,
                    cause,
                    self.summary_every_s,
                )
        # A cause that comes back after a quiet period is logged with its traceback again.
        self._unlogged.clear()
