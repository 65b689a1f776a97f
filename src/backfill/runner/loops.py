"""The worker's named background loops, each kept alive through unexpected errors (the
database may blip) until the worker stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("backfill.runner")

Job = Callable[[], Awaitable[object]]


class Loops:
    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks)

    def repeat(self, name: str, step: Job) -> None:
        """Run ``step`` again and again until stopped, as the task ``name``."""
        self._tasks.append(asyncio.create_task(self._guard(name, step), name=name))

    def every(self, name: str, seconds: float, job: Job, *, at_once: bool = False) -> None:
        """Run ``job`` every ``seconds`` (first at once, or after one period)."""

        async def step() -> None:
            if not at_once:
                await self.pause(seconds)
                if self.stopping.is_set():
                    return
            await job()
            if at_once:
                await self.pause(seconds)

        self.repeat(name, step)

    async def pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the worker stops."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _guard(self, name: str, step: Job) -> None:
        while not self.stopping.is_set():
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker %s loop failed; restarting it", name)
                await self.pause(1.0)
