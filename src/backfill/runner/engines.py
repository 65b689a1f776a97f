"""Engine slots and health: how many requests each engine may take now, and the claimed
requests waiting for one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from backfill.domain.records import ClaimedItem, WorkBatch
from backfill.ports import Engine
from backfill.runner.inputs import ClaimInput

log = logging.getLogger("backfill.runner")


@dataclass(frozen=True, slots=True)
class Queued:
    """A claimed request waiting for a free slot of its engine."""

    batch: WorkBatch
    item: ClaimedItem
    input: ClaimInput


Start = Callable[["EngineSlot", Queued], None]
"""Runs a queued request on the slot that just counted it in flight; must not block."""


class EngineSlot:
    """One engine: its in-flight count, its claimed backlog and its last known health.

    Only these methods change them. A request that ends calls ``done``; its slot goes at once
    to the next queued request (through ``start``), so a busy engine never waits for a claim
    round trip, and ``wake`` tells the dispatcher to claim more.
    """

    def __init__(self, engine: Engine, start: Start, wake: Callable[[], None]) -> None:
        self.engine = engine
        self._start = start
        self._wake = wake
        self._in_flight = 0
        self._healthy = False
        self._backlog: deque[Queued] = deque()
        # Claimed items waiting for a free slot: a quarter of the slots' worth at most.
        self.prefetch = max(1, engine.max_concurrency // 4)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def backlog(self) -> tuple[Queued, ...]:
        return tuple(self._backlog)

    @property
    def free(self) -> int:
        return max(0, self.engine.max_concurrency - self._in_flight) if self._healthy else 0

    @property
    def claim_threshold(self) -> int:
        """Claim once this many items are wanted: fewer, larger claims cost less CPU."""
        return max(1, self.prefetch // 2)

    @property
    def wanted(self) -> int:
        """How many more items to claim for this engine now."""
        if not self._healthy:
            return 0
        return max(
            0, self.engine.max_concurrency + self.prefetch - self._in_flight - len(self._backlog)
        )

    def offer(self, queued: Iterable[Queued]) -> None:
        """Queue claimed requests; as many as there are free slots start now."""
        self._backlog.extend(queued)
        self._fill()

    def done(self) -> None:
        """A request started by this slot ended: its place goes to the next queued one."""
        if self._in_flight <= 0:
            raise RuntimeError(f"engine {self.engine.name}: a request ended that never started")
        self._in_flight -= 1
        self._wake()
        self._fill()

    def drop(self, where: Callable[[WorkBatch], bool]) -> list[Queued]:
        """Take the queued requests of the batches ``where`` selects out of the backlog; the
        caller gives their leases back."""
        dropped: list[Queued] = []
        keep: deque[Queued] = deque()
        for queued in self._backlog:
            (dropped if where(queued.batch) else keep).append(queued)
        self._backlog = keep
        return dropped

    async def check(self) -> bool:
        """Ask the engine whether it is up; one that comes back takes its backlog at once."""
        was = self._healthy
        self._healthy = await self.engine.healthy()
        if self._healthy != was:
            log.info("engine %s is %s", self.engine.name, "up" if self._healthy else "down")
            if self._healthy:
                self._wake()
                self._fill()
        return self._healthy

    def _fill(self) -> None:
        while self.free > 0 and self._backlog:
            queued = self._backlog.popleft()
            self._in_flight += 1
            self._start(self, queued)


class EnginePool:
    """Every engine's slot, their health watch, and the wake-up that tells the dispatcher
    capacity freed up (or work arrived)."""

    def __init__(self, engines: Sequence[Engine], start: Start) -> None:
        self._woken = asyncio.Event()
        self.slots = [EngineSlot(e, start, self._woken.set) for e in engines]
        self._task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        self._woken.set()

    def clear_wake(self) -> None:
        self._woken.clear()

    async def wait_woken(self, timeout_s: float) -> bool:
        """Wait until ``wake`` (True) or ``timeout_s`` (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._woken.wait(), timeout_s)
        return self._woken.is_set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="engine-health")

    async def _watch(self) -> None:
        while True:
            for slot in self.slots:
                await slot.check()
            healthy = all(s.healthy for s in self.slots)
            await asyncio.sleep(5.0 if healthy else 0.5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for slot in self.slots:
            await slot.engine.close()
