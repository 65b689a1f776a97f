"""Fetch places: how many requests of this worker fetch their remote images at once, before
they take an engine slot. A slow image host then holds a fetch place, never an engine slot
that other orgs' requests wait for (the 2026-12-05 review, finding M2)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class FetchPool:
    """At most ``concurrency`` requests fetch at once, and as many more wait for a place. A
    request that finds both full is turned away: its line goes back to the queue, so a batch
    of image lines is never all claimed into one worker while its image hosts take their
    time, and the engine slots keep serving the lines that are ready."""

    def __init__(self, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError("a fetch pool needs at least one place")
        self.concurrency = concurrency
        self.place = asyncio.Semaphore(concurrency)
        self._room = 2 * concurrency
        self._admitted = 0
        self._turned_away = False
        # Told when a request leaves after another was turned away: its line may come back.
        # Not told otherwise: a claim for each fetch that ends would mostly find nothing.
        self.on_free: Callable[[], None] = lambda: None

    @property
    def admitted(self) -> int:
        """Requests fetching or waiting for a place now."""
        return self._admitted

    def admit(self) -> bool:
        """Count a request in (then it waits for ``place``); False when the pool is full."""
        if self._admitted >= self._room:
            self._turned_away = True
            return False
        self._admitted += 1
        return True

    def leave(self) -> None:
        """An admitted request ended or went on to its engine slot (once per ``admit``)."""
        self._admitted -= 1
        if self._turned_away:
            self._turned_away = False
            self.on_free()
