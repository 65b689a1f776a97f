"""Failures inside the worker itself (storage, the database), as opposed to engine failures.

A request whose input cannot be read or whose result cannot be stored must neither wedge the
batch nor be retried in a hot loop: each batch backs off while its requests keep failing, and
one cause is logged once with its traceback, then counted and summarised.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass, field

from backfill.errors import ContentUnreadable, NotFound
from backfill.ports import Clock
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
    """Backoff per batch and per request, and rate-limited logs per (batch, cause).

    A success resets its batch's streak, so a request that fails on its own (something in its
    reply cannot be stored, or it trips a bug) also keeps a count of its own: it backs off by
    that count, and after ``give_up_after`` failures spread over at least ``give_up_span_s``
    it is taken to be the cause, not a passing outage, and ends with an error row.
    """

    base_s: float
    max_s: float
    summary_every_s: float = 60.0
    give_up_after: int = 5
    give_up_span_s: float = 60.0
    rng: random.Random = field(default_factory=random.Random)
    clock: Clock = field(kw_only=True)
    _streak: Counter[str] = field(default_factory=Counter)
    # (batch, item) -> (failures, monotonic time of the first)
    _items: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)
    _unlogged: Counter[tuple[str, str]] = field(default_factory=Counter)
    _last_summary: float = field(init=False)

    def __post_init__(self) -> None:
        self._last_summary = self.clock.monotonic()

    def transient(
        self, batch_id: str, idx: int, exc: BaseException, *, own: bool = True
    ) -> float | None:
        """Note a failure worth retrying; returns how long the item waits before a new claim,
        or None when it has failed too often and should end with an error row instead.

        ``own`` is False for causes outside the request (its input or the catalog could not be
        read): those are retried until they pass, however long that takes.
        """
        self._streak[batch_id] = streak = min(self._streak[batch_id] + 1, _MAX_STREAK)
        attempt = streak
        if own:
            key = (batch_id, idx)
            count, first = self._items.get(key, (0, self.clock.monotonic()))
            count += 1
            self._items[key] = (count, first)
            if (
                count >= self.give_up_after
                and self.clock.monotonic() - first >= self.give_up_span_s
            ):
                del self._items[key]
                self._note(batch_id, idx, exc, "it failed repeatedly; it ends with an error row")
                return None
            attempt = max(streak, min(count, _MAX_STREAK))
        self._note(batch_id, idx, exc, "released; it will be retried")
        return backoff_s(attempt, self.base_s, self.max_s, None, self.rng)

    def permanent(self, batch_id: str, idx: int, exc: BaseException) -> None:
        self._note(batch_id, idx, exc, "its input cannot be read; it ends as input_unavailable")

    def succeeded(self, batch_id: str, idx: int) -> None:
        if self._streak:
            self._streak.pop(batch_id, None)
        if self._items:
            self._items.pop((batch_id, idx), None)

    def forget(self, batch_id: str) -> None:
        self._streak.pop(batch_id, None)
        for key in [key for key in self._items if key[0] == batch_id]:
            del self._items[key]

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
        now = self.clock.monotonic()
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
