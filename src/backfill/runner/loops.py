"""The worker's named background loops, each kept alive through unexpected errors (the
database may blip) until the worker stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import TypeVar

log = logging.getLogger("backfill.runner")

Job = Callable[[], Awaitable[object]]
Poll = Callable[[], Awaitable[bool]]
_T = TypeVar("_T")


class Pace:
    """How long a polling loop waits between polls: ``base_s`` while its polls find work,
    twice as long after each that finds none, up to ``idle_s``. ``wake`` ends the wait now;
    ``hurry`` makes the next poll come at most ``base_s`` after the last (this process just did
    something that may have made work for the loop).

    An idle worker polls only for work another process can make (a batch created through
    another API process, a lease that ran out): each poll is a query, and on a machine the
    engine shares, every CPU-millisecond is taken from the model (docs/performance.md, "Quiet
    when waiting").
    """

    def __init__(self, base_s: float, idle_s: float) -> None:
        self.base_s = base_s
        self.idle_s = max(base_s, idle_s)
        self._wait_s = base_s
        self._woken = asyncio.Event()
        self._hurried = False
        self._paused_at: float | None = None  # loop time the pause under way began
        self._timer: asyncio.TimerHandle | None = None

    @property
    def wait_s(self) -> float:
        return self._wait_s

    def found(self, anything: bool) -> None:
        """The last poll found work (or none): the next wait is the base (or twice the last)."""
        if anything or self._hurried:
            self._wait_s = self.base_s
        else:
            self._wait_s = min(self._wait_s * 2, self.idle_s)
        self._hurried = False

    def wake(self) -> None:
        self._wait_s = self.base_s
        self._woken.set()

    def hurry(self) -> None:
        self._hurried = True  # and the wait after the next poll is the base
        if self._paused_at is None or self._timer is not None or self._wait_s <= self.base_s:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(
            max(0.0, self._paused_at + self.base_s - loop.time()), self._woken.set
        )

    async def pause(self) -> None:
        """Wait ``wait_s``, or less when woken or hurried; a wake during the poll ends the next
        pause at once."""
        self._paused_at = asyncio.get_running_loop().time()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self._wait_s)
        finally:
            self._paused_at = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._woken.clear()


class Loops:
    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._paces: list[Pace] = []

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

    def poll(self, name: str, pace: Pace, poll: Poll) -> None:
        """Run ``poll`` at once, then as ``pace`` says: sooner while it finds work (it returns
        True), less often while it finds none, at once when the pace is woken."""

        async def step() -> None:
            pace.found(await poll())
            if not self.stopping.is_set():
                await pace.pause()

        self._paces.append(pace)
        self.repeat(name, step)

    def stop(self) -> None:
        """Every loop ends after the step it is in; their waits end now."""
        self.stopping.set()
        for pace in self._paces:
            pace.wake()

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


async def end_within(tasks: Collection[asyncio.Task[_T]], grace_s: float) -> set[asyncio.Task[_T]]:
    """Wait up to ``grace_s`` for ``tasks`` to end, then cancel those still running and wait
    for them too; those cut short are returned."""
    if not tasks:
        return set()
    if grace_s > 0:
        await asyncio.wait(tasks, timeout=grace_s)
    late = {task for task in tasks if not task.done()}
    for task in late:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return late
