"""The requests a worker runs now, by batch: the lease renewal holds exactly those, cancel
waits for them (or stops those still fetching images), expiry abandons them."""

from __future__ import annotations

import asyncio
import functools

from backfill.runner.inputs import Queued


class RunningRequests:
    def __init__(self) -> None:
        # Tasks running now (with their item index), by batch; a batch leaves with its last.
        # Those fetching images, holding no slot, are in ``_fetching`` too.
        self._running: dict[str, dict[asyncio.Task[None], int]] = {}
        self._fetching: set[asyncio.Task[None]] = set()

    def _track(self, queued: Queued, task: asyncio.Task[None], *, fetching: bool = False) -> None:
        if fetching:
            self._fetching.add(task)
            task.add_done_callback(self._fetching.discard)
        batch_id = queued.batch.id
        self._running.setdefault(batch_id, {})[task] = queued.item.idx
        task.add_done_callback(functools.partial(self._ended, batch_id))

    def _ended(self, batch_id: str, task: asyncio.Task[None]) -> None:
        tasks = self._running.get(batch_id)
        if tasks is not None:
            tasks.pop(task, None)
            if not tasks:
                del self._running[batch_id]

    def busy(self, batch_id: str) -> bool:
        return batch_id in self._running

    def held(self) -> dict[str, set[int]]:
        """The items whose requests run now, by batch."""
        return {batch_id: set(tasks.values()) for batch_id, tasks in self._running.items()}

    @property
    def fetching(self) -> int:
        """How many requests fetch images now, or wait for a fetch place."""
        return len(self._fetching)

    @property
    def running(self) -> int:
        """How many requests run now (those storing their result and those fetching images
        included)."""
        return sum(map(len, self._running.values()))

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return [task for tasks in self._running.values() for task in tasks]
