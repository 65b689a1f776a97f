"""Clocks: the system's, and a settable one for tests that drive time."""

from __future__ import annotations

import time


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """Starts at the real time; only ``advance`` moves it, both readings together."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else start
        self._monotonic = 0.0

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> None:
        self._now += seconds
        self._monotonic += seconds
